"""The fold of one group: its merged files (token state through fold_tokens, layer totals, window
scalars, sequence moments, massive activations, moments, bottom-k samples and the measures derived
from them) written from its old merged entry, the partials to add and the partials to remove.

Cost per group: token rows as in fold_tokens; moments fold one layer at a time (memory O(d²)), the
bottom-k sample one layer at a time (O(k·d)).  Removing a partial un-folds its token and layer sums;
the group's moments and samples are then re-merged from its members (a bottom-k sample cannot be
un-merged; a removal is rare, and the moments then cost one read of the members' d×d tables).

Storage per group: token_stats a few bytes per (layer, token type) compressed; token_vectors 8·d B
per (layer, token type), written only for a group of two or more partials (one partial's state is
its own token_sums), and moments_merged 16·d² B per layer, until `compact` drops them.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Iterable, Iterator

import numpy as np
import pyarrow as pa


from .. import schema, store
from ..storage import Storage, open_storage
from ..store import Entry
from .fold_attention import fold_attention
from .fold_tokens import fold_rows, fold_token_state
from .groups import checked, group_key, inputs_of
from ..measures import (covariance, cross_covariance, linearity_from_cov, similarities_from_cov, twonn_microscope,
                       twonn_skdim)

# ---------------------------------------------------------------- layer totals


_LAYER_INTS = ("n", "n_nonfinite", "n_zero", "windows", "unit_windows")
_LAYER_VECS = ("sum_h", "sum_u2", "sum_ubar")
_LAYER_FLOATS = ("window_cos", "sum_ubar_sq")
_CHANGE = schema.CHANGE_SUMS  # NULL on the last layer: a NULL in any partial makes the group's NULL


def _fold_layers(st: Storage, old: Entry | None, adds: list[Entry], removes: list[Entry]) -> dict[int, dict]:
    """layer_totals of the group: the old ones, minus the removed partials' layer_sums, plus the added."""
    state: dict[int, dict] = {}
    if old is not None:
        for r in st.read_table(old["files"]["layer_totals"]).to_pylist():
            state[r["layer"]] = {**r, **{k: np.asarray(r[k], np.float64) for k in ("vec", *_LAYER_VECS)}}
    for sign, entries in ((-1, removes), (1, adds)):
        for e in entries:
            for r in st.read_table(e["files"]["layer_sums"]).to_pylist():
                v = np.asarray(r["vec"], np.float64)
                tot = state.get(r["layer"])
                if tot is None:
                    tot = state[r["layer"]] = {
                        "layer": r["layer"], "layer_kind": r["layer_kind"], "n_layers": r["n_layers"],
                        "sum_sq": 0.0, "vec": np.zeros_like(v), **{k: 0.0 for k in _LAYER_FLOATS},
                        **{k: 0 for k in (*_LAYER_INTS, *_CHANGE)}, **{k: np.zeros_like(v) for k in _LAYER_VECS}}
                sq = np.array([tot["sum_sq"]])
                fold_rows(tot["vec"].reshape(1, -1), sq, np.array([0]), v[None], np.array([r["sum_sq"]]), sign)
                tot["sum_sq"] = float(sq[0])
                for k in _LAYER_INTS:
                    tot[k] += sign * r[k]
                for k in _LAYER_FLOATS:
                    tot[k] += sign * r[k]
                for k in _CHANGE:
                    tot[k] = None if tot[k] is None or r[k] is None else tot[k] + sign * r[k]
                for k in _LAYER_VECS:
                    tot[k] = tot[k] + sign * np.asarray(r[k])
    return state


# Per-layer scalars of extract/sequences.py: NULL in a group where any partial lacks them (an older
# run, --no-sequences, no --prompt-entropy), so a group's value never silently covers part of it.
_WINDOW_SCALARS = schema.WINDOW_SCALARS


def _window_scalars(st: Storage, layers: dict[int, dict], old: Entry | None, adds: list[Entry],
                    removes: list[Entry], members: list[Entry]) -> None:
    """Set the window scalars of `layers`: the old merged values plus the added partials' when nothing
    is removed (as the other layer totals), else the sums over the members' layer_sums (L rows each;
    a NULL cannot be un-added).  A partial lacking a layer's values makes them NULL."""
    incremental = old is not None and not removes
    tot: dict[int, dict] = {}
    for layer, r in layers.items():
        if incremental:  # the old group's values (NULL for a layer the old group did not have)
            tot[layer] = {c: r.get(c) for c in _WINDOW_SCALARS}
        else:
            tot[layer] = dict.fromkeys(_WINDOW_SCALARS, 0)
    for e in (adds if incremental else members):
        seen = set()
        for r in st.read_table(e["files"]["layer_sums"], columns=["layer", *_WINDOW_SCALARS]).to_pylist():
            seen.add(r["layer"])
            t = tot.setdefault(r["layer"], dict.fromkeys(_WINDOW_SCALARS, None if incremental else 0))
            for c in _WINDOW_SCALARS:
                t[c] = None if t[c] is None or r[c] is None else t[c] + r[c]
        for layer in set(tot) - seen:
            tot[layer] = dict.fromkeys(_WINDOW_SCALARS, None)
    for layer, r in layers.items():
        r.update(tot[layer])


def _fold_sequences(st: Storage, old: Entry | None, adds: list[Entry], removes: list[Entry], members: list[Entry],
                    n_layers: int, out: "_Writers") -> None:
    """Merged sequence moments (the old merged ones plus the new partials' when nothing is removed,
    else from the members) and their eigenvalues, per layer and pooling."""
    if not members or not all("sequence_moments" in e["files"] for e in members):
        return
    if old is not None and "sequence_moments_merged" in old["files"] and not removes:
        sources = [(old, "sequence_moments_merged")] + [(e, "sequence_moments") for e in adds]
    else:
        sources = [(e, "sequence_moments") for e in members]
    for layer in range(n_layers):
        sums: dict[str, dict] = {}
        for e, t in sources:
            tab = _read_layer(st, e["files"][t], layer, ["pooling", "n", "s1", "s2"])
            for i in range(tab.num_rows):
                row = tab.slice(i, 1)
                vec = lambda c: row.column(c).combine_chunks().flatten().to_numpy(zero_copy_only=False)  # noqa: E731
                pooling = row.column("pooling")[0].as_py()
                m = sums.setdefault(pooling, {"n": 0, "s1": 0.0, "s2": 0.0})
                m["n"] += row.column("n")[0].as_py()
                m["s1"] = m["s1"] + vec("s1")
                m["s2"] = m["s2"] + vec("s2")
        for pooling, m in sorted(sums.items()):
            d = len(m["s1"])
            out.rows("sequence_moments_merged", {"layer": [layer], "pooling": [pooling], "n": [m["n"]],
                                                 "s1": [m["s1"]], "s2": [m["s2"]]})
            S = m["s2"].reshape(d, d)
            if pooling == "normalized" and m["n"] >= 1:
                lam = np.linalg.eigvalsh(S / m["n"])  # Σẑẑᵀ/W, not centred
            elif pooling != "normalized" and m["n"] >= 2:
                lam = np.linalg.eigvalsh(covariance(m["n"], m["s1"], S))
            else:
                continue
            out.rows("sequence_eigenvalues", {"layer": [layer] * d, "pooling": [pooling] * d,
                                              "windows": [m["n"]] * d, "k": list(range(1, d + 1)),
                                              "eigenvalue": lam[::-1].tolist()})


_MASSIVE_COLUMNS = ("layer", "rank", "abs_value", "dim", "token_id", "document", "position")


def _merge_massive(st: Storage, old: Entry | None, adds: list[Entry], removes: list[Entry], members: list[Entry],
                   out: "_Writers") -> None:
    """The group's top-k |h| per layer: the top-k of the old merged top-k and the added partials'
    (all members' when a partial is removed), ordered by |h| descending, then document source,
    document, position, dimension — the top-k of a union is the top-k of the parts' top-ks."""
    if not members or not all("massive" in e["files"] for e in members):
        return
    rows = []
    if old is not None and "massive_merged" in old["files"] and not removes:
        rows += st.read_table(old["files"]["massive_merged"], columns=[*_MASSIVE_COLUMNS, "document_source"]).to_pylist()
        parts = adds
    else:
        parts = members
    for e in parts:
        rows += [{**r, "document_source": e["source"]}
                 for r in st.read_table(e["files"]["massive"], columns=list(_MASSIVE_COLUMNS)).to_pylist()]
    k = max((r["rank"] for r in rows), default=0)
    rows.sort(key=lambda r: (r["layer"], -r["abs_value"], r["document_source"], r["document"], r["position"],
                             r["dim"]))
    by_layer = defaultdict(list)
    for r in rows:
        if len(by_layer[r["layer"]]) < k:
            by_layer[r["layer"]].append({**r, "rank": len(by_layer[r["layer"]]) + 1})
    top = [r for layer in sorted(by_layer) for r in by_layer[layer]]
    if top:
        out.rows("massive_merged", {c: [r[c] for r in top] for c in (*_MASSIVE_COLUMNS[:5], "document_source",
                                                                     *_MASSIVE_COLUMNS[5:])})


# ---------------------------------------------------------------- moments and samples


def _read_layer(st: Storage, rel: str, layer: int, columns=None) -> pa.Table:
    return st.read_table(rel, columns=columns, filters=[("layer", "=", layer)])


def _moment_sum(rows: Iterable[dict]) -> dict | None:
    m = None
    for r in rows:
        if m is None:
            m = {"n": 0, "s1": 0.0, "s2": 0.0, "n_pair": None, "s_cross": None}
        m["n"] += r["n"]
        m["s1"] = m["s1"] + r["s1"]
        m["s2"] = m["s2"] + r["s2"]
        if r["s_cross"] is not None:
            m["n_pair"] = (m["n_pair"] or 0) + r["n_pair"]
            m["s_cross"] = (0.0 if m["s_cross"] is None else m["s_cross"]) + r["s_cross"]
    return m


def _moment_rows(table: pa.Table) -> Iterator[dict]:
    """Rows of a moments table with the d×d lists as numpy arrays (no Python floats)."""
    for i in range(table.num_rows):
        row = table.slice(i, 1)
        vec = lambda c: (None if row.column(c).null_count else  # noqa: E731
                         row.column(c).combine_chunks().flatten().to_numpy(zero_copy_only=False))
        yield {"n": row.column("n")[0].as_py(), "n_pair": row.column("n_pair")[0].as_py(),
               "s1": vec("s1"), "s2": vec("s2"), "s_cross": vec("s_cross")}


def _moments_layer(st: Storage, layer: int, sources: list[tuple[Entry, str]]) -> dict | None:
    """The sum of the given moments tables (entry, table) at one layer (None: no rows)."""
    return _moment_sum(r for e, t in sources for r in _moment_rows(_read_layer(st, e["files"][t], layer)))


def _sample_layer(st: Storage, layer: int, sources: list[tuple[Entry, str]], k: int) -> pa.Table | None:
    """The bottom-k (by key) of the union of the given samples at one layer."""
    cols = ["key", "document", "position", "token_id", "vec"]
    parts = [_read_layer(st, e["files"][t], layer, cols) for e, t in sources]
    parts = [p for p in parts if p.num_rows]
    if not parts:
        return None
    t = pa.concat_tables(parts)
    order = np.argsort(t.column("key").to_numpy(), kind="stable")[:k]
    return t.take(pa.array(order))


# ---------------------------------------------------------------- one group


class _Writers:
    """The group's output files, aborted together unless all close."""

    def __init__(self, st: Storage, key: dict, run_id: str):
        self.st, self.key, self.run_id = st, key, run_id
        self.open: dict[str, store.TableWriter] = {}
        self.files: dict[str, str] = {}

    def __getitem__(self, table: str) -> store.TableWriter:
        if table not in self.open:
            values = {k: self.key[k] for k in schema.MERGED_PARTITIONS}
            self.open[table] = store.TableWriter(self.st, table, values, self.run_id)
        return self.open[table]

    def rows(self, table: str, cols: dict) -> None:
        n = len(next(iter(cols.values())))
        self[table].write({k: [v] * n for k, v in self.key.items()} | cols)

    def close(self) -> dict[str, str]:
        for table, w in self.open.items():
            self.files[table] = w.close()
        return self.files

    def abort(self) -> None:
        for w in self.open.values():
            w.abort()
        for rel in self.files.values():
            with contextlib.suppress(Exception):  # a storage fault: left as an orphan for validate --fix
                self.st.delete(rel)
        store.release_leases(self.st, [self.run_id])


def fold_group(root, model: str, checkpoint: str, group: str, old: Entry | None, adds: list[Entry],
               removes: list[Entry], members: list[Entry], dest=None) -> Entry:
    """Write the merged files of one group after removing `removes` and adding `adds` to the state of
    its merged entry `old` (None: from nothing), and return the new merged entry.  `members` are the
    group's data entries afterwards.  The files are read from `root` and written to `dest` (default:
    the same warehouse)."""
    st = checked(root, [old, *adds, *removes, *members])  # every input verified before it is folded
    step, d = members[0]["step"], members[0]["hidden_size"]
    key = {"model": model, "checkpoint": checkpoint, "step": step, "source": group}
    out = _Writers(open_storage(dest) if dest is not None else st.inner, key, store.new_run_id())
    try:
        types = fold_token_state(st, key, old, adds, removes, members, d, out)
        layers = _fold_layers(st, old, adds, removes)
        _window_scalars(st, layers, old, adds, removes, members)
        if layers:
            cols = [f.name for f in schema.LAYER_TOTALS if f.name not in key]
            out.rows("layer_totals", {c: [(layers[l][c].tolist() if isinstance(layers[l][c], np.ndarray)
                                           else layers[l][c]) for l in sorted(layers)] for c in cols})
        buckets = sorted(types.buckets.items())
        if buckets:
            out.rows("frequency_buckets", {
                "layer": [l for (l, _), _ in buckets], "bucket": [b for (_, b), _ in buckets],
                "types": [v[0] for _, v in buckets], "n": [v[1] for _, v in buckets],
                "sum_sq": [float(v[2] @ v[2]) for _, v in buckets]})
        n_layers = max((r["n_layers"] for r in layers.values()), default=0)
        derived = _fold_derived(st, old, adds, removes, members, n_layers, out)
        _fold_sequences(st, old, adds, removes, members, n_layers, out)
        _merge_massive(st, old, adds, removes, members, out)
        fold_attention(st, old, adds, removes, members, out)
        metrics = defaultdict(list)
        for layer in sorted(set(layers) | set(derived["n"])):
            metrics["layer"].append(layer)
            metrics["n"].append(int(derived["n"].get(layer, layers[layer]["n"] if layer in layers else 0)))
            lin = derived["linearity"].get(layer, (None,) * 4)
            for c, v in zip(("linearity", "linearity_centered", "cka", "procrustes_orthogonal"), lin):
                metrics[c].append(v)
            tw = derived["twonn"].get(layer, (None,) * 3)
            for c, v in zip(("sample_size", "twonn", "twonn_skdim"), tw):
                metrics[c].append(v)
            unit = types.unit.get(layer)
            metrics["types"].append(types.types.get(layer) if unit is not None else None)
            metrics["types_sum_sq"].append(float(unit @ unit) if unit is not None else None)
            intra = types.intra.get(layer, [0, 0.0])
            metrics["intra_types"].append(intra[0])
            metrics["intra_sim_sum"].append(intra[1])
        if metrics:
            out.rows("layer_metrics", dict(metrics))
        files = out.close()
    except BaseException:
        out.abort()
        raise
    return {
        "key": group_key(model, checkpoint, group), "kind": "merged", "model": model, "checkpoint": checkpoint,
        "step": step, "source": group, "shard": None, "run_id": out.run_id,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "hidden_size": d, "files": files,
        "inputs": inputs_of(members), "stats": {"partials": len(members)},
        "settings": {"sample": derived["sample_k"]}, "provenance": {},
    }


def relabel_group(root, entry: Entry, group: str) -> Entry:
    """A copy of merged entry `entry` as the merged entry of `group`, which has the same partials
    (in practice 'all' of a one-source checkpoint), so the same merged tables:
    every file copied row group by row group with its source column set to `group`."""
    st = checked(root, [entry])
    key = {"model": entry["model"], "checkpoint": entry["checkpoint"], "step": entry["step"], "source": group}
    out = _Writers(st.inner, key, store.new_run_id())
    try:
        for table, rel in entry["files"].items():
            pf = st.parquet_file(rel, pre_buffer=False)
            for i in range(pf.num_row_groups):
                t = pf.read_row_group(i)
                out[table].write({c: (pa.array([group] * t.num_rows, pa.string()) if c == "source" else t.column(c))
                                  for c in t.column_names})
        files = out.close()
    except BaseException:
        out.abort()
        raise
    return {**{k: v for k, v in entry.items() if k != "checksums"},
            "key": group_key(entry["model"], entry["checkpoint"], group), "source": group,
            "run_id": out.run_id, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": files}


def _fold_derived(st: Storage, old: Entry | None, adds: list[Entry], removes: list[Entry], members: list[Entry],
                  n_layers: int, out: _Writers) -> dict:
    """Merged moments and sample, and what the peers' measures make of them, layer by layer."""
    res = {"n": {}, "linearity": {}, "twonn": {}, "sample_k": None}
    # moments: the old merged ones plus the new partials' when nothing is removed; else from the members
    if all("moments" in e["files"] for e in members):
        if old is not None and "moments_merged" in old["files"] and not removes:
            sources = [(old, "moments_merged")] + [(e, "moments") for e in adds]
        else:
            sources = [(e, "moments") for e in members]
        prev = None  # (layer, merged moments, covariance, its eigendecomposition) of the layer before
        for layer in range(n_layers):
            m = _moments_layer(st, layer, sources)
            if m is None:
                prev = None
                continue
            last = m["s_cross"] is None
            out.rows("moments_merged", {"layer": [layer], "n": [m["n"]], "s1": [m["s1"]],
                                        "s2": [m["s2"]], "n_pair": [None if last else m["n_pair"]],
                                        "s_cross": [None if last else m["s_cross"]]})
            res["n"][layer] = m["n"]
            C = eig = None
            if m["n"] >= 2:
                d = len(m["s1"])
                C = covariance(m["n"], m["s1"], m["s2"].reshape(d, d))
                eig = np.linalg.eigh(C)  # eigenvalues for the spectrum, vectors for the next pair's linearity
                evals = eig[0][::-1]
                out.rows("spectrum", {"layer": [layer] * d, "n": [m["n"]] * d, "k": list(range(1, d + 1)),
                                      "eigenvalue": evals.tolist()})
                out.rows("dim_variance", {"layer": [layer] * d, "dim": list(range(d)),
                                          "mean": (m["s1"] / m["n"]).tolist(), "variance": np.diag(C).tolist()})
            if prev is not None and C is not None:
                pl, pm, pc, peig = prev
                if (pl == layer - 1 and pm["s_cross"] is not None and pm["n_pair"] == pm["n"] == m["n"]
                        and pc is not None):  # exact only when both layers counted the same tokens
                    d = len(m["s1"])
                    cxy = cross_covariance(m["n"], pm["s1"], m["s1"], pm["s_cross"].reshape(d, d))
                    c_dd = C - cxy - cxy.T + pc  # Y − X
                    c_xd = cxy - pc
                    res["linearity"][pl] = (linearity_from_cov(pc, C, cxy, peig),
                                            linearity_from_cov(pc, c_dd, c_xd, peig),
                                            *similarities_from_cov(pc, C, cxy))
            prev = (layer, m, C, eig)
    # bottom-k sample: merged with the new partials' samples, or re-merged from the members
    ks = {e["settings"].get("sample") or 0 for e in members}
    k = min(ks) if ks else 0
    if k and all("samples" in e["files"] for e in members):
        res["sample_k"] = k
        if (old is not None and "samples_merged" in old["files"] and not removes
                and old.get("settings", {}).get("sample") == k):
            sources = [(old, "samples_merged")] + [(e, "samples") for e in adds]
        else:
            sources = [(e, "samples") for e in members]
        for layer in range(n_layers):
            t = _sample_layer(st, layer, sources, k)
            if t is None:
                continue
            out.rows("samples_merged", {"layer": np.full(t.num_rows, layer, np.int16),
                                        **{c: t.column(c) for c in t.column_names}})
            X = np.asarray(t.column("vec").to_pylist(), dtype=np.float64)
            X = X[np.isfinite(X).all(1)]
            if len(X) >= 10:
                res["twonn"][layer] = (len(X), twonn_microscope(X), twonn_skdim(X))
    return res
