"""Merging: fold every committed partial into the merged tables of its groups, at commit time.

A partial is one (model, checkpoint, source, shard) run's sums.  Its groups are its source (that
source's shards merged) and 'all' (every partial of the checkpoint).  `commit` publishes partials
together with the new merged files of every group they touch, in one manifest write, so the views
(which read only merged tables) answer in the same time whether a checkpoint has 1 partial or 100,
and always see all of a commit or none of it.

Folding partial p into a group (float64 throughout; S = the group's merged Σû of one token type
or layer):

    sum_sq' = sum_sq + sum_sq_p + 2⟨S, s_p⟩,    S' = S + s_p,    n' = n + n_p

which is the pairwise definition Σ_p sum_sq_p + 2 Σ_{p<q} ⟨s_p, s_q⟩, computed once.  Replacing a
partial (a re-run of its key) first un-folds the old one — S' = S − s_r, sum_sq' = sum_sq −
sum_sq_r − 2⟨S', s_r⟩, n' = n − n_r — so nothing is ever counted twice.

Cost of one commit, per touched group (the partial's source and 'all'): token rows stream in chunks
of token ids (memory O(chunk_rows · d) whatever V, L and the number of partials are); the group's
merged vectors and the partial are read once and the new merged files written once: time and I/O
O((rows of the merged state + rows of the partial) · d), independent of how many partials came
before.  Moments fold one layer at a time (memory O(d²)), the bottom-k sample one layer at a time
(O(k·d)).  Replacing a partial un-folds its token and layer sums; its groups' moments and samples are
re-merged from their partials (a bottom-k sample cannot be un-merged; a replacement is rare, and the
moments then cost one read of the group's partials' d×d tables).

Storage per group: token_stats ~12–20 B per (layer, token type) compressed; token_vectors 8·d B per
(layer, token type), written only for a group of two or more partials (one partial's state is its
own token_sums), and moments_merged 16·d² B per layer, until `compact` drops them.
"""

from __future__ import annotations

import contextlib
import json
import math
import tempfile
import time
from collections import defaultdict
from typing import Iterable, Iterator

import numpy as np
import pyarrow as pa

from isotropy_warehouse import faults
from isotropy_warehouse.errors import UserError

from . import schema, store
from .storage import Checked, Storage, open_storage
from .measures import (covariance, cross_covariance, linearity_from_cov, similarities_from_cov, twonn_microscope,
                       twonn_skdim)

ALL = "all"
CHUNK_BYTES = 8 << 20  # float64 rows of one token chunk per stream
STATS_ROWS = 1 << 20  # token_stats rows per row group
_MASK = (1 << 32) - 1


def group_key(model: str, checkpoint: str, group: str) -> str:
    return store.entry_key("merged", model, checkpoint, group)


def _in_group(entry: dict, group: str) -> bool:
    return group == ALL or entry["source"] == group


def _data_by_pair(manifest: dict) -> dict[tuple[str, str], list[dict]]:
    out = defaultdict(list)
    for e in manifest["entries"].values():
        if e["kind"] == "data":
            out[(e["model"], e["checkpoint"])].append(e)
    return out


def _inputs(entries: Iterable[dict]) -> list[str]:
    return sorted(e["run_id"] + ":" + e["key"] for e in entries)


def repair_hint(entry: dict) -> str:
    """What to do about a damaged or lost file of `entry`."""
    where = f"{entry['model']}@{entry['checkpoint']}"
    if entry["kind"] == "merged":
        return "`python cli.py validate --fix` rebuilds it from its partials"
    if entry["kind"] == "data":
        shard = f" --shard {entry['shard'].replace('-of-', '/')}" if entry.get("shard") not in (None, "1-of-1") else ""
        return (f"it cannot be rebuilt: re-extract {where} --source {entry['source']}{shard} "
                f"(python cli.py extract …), which replaces it")
    return f"it cannot be rebuilt: re-extract {where} (its parameter tables)"


def checked(root, entries: Iterable[dict | None]) -> Checked:
    """`root` whose reads of the entries' files verify them against their commit records' checksums
    first (each file once per fold): a fold never reads a byte its record did not write."""
    st = open_storage(root)
    expected = {}
    for e in entries:
        if e is None:
            continue
        sums = e.get("checksums") or {}
        for rel in e["files"].values():  # (a partial not yet committed: as this process wrote it)
            expected[rel] = (sums.get(rel) or store.written_checksum(st, rel), repair_hint(e))
    return Checked(st, expected)


def is_compacted(manifest: dict, model: str, checkpoint: str) -> bool:
    return bool(manifest["entries"].get(group_key(model, checkpoint, ALL), {}).get("compacted"))


def check_open(manifest: dict, model: str, checkpoint: str) -> None:
    """A compacted checkpoint takes no new partial: its per-token vectors are gone."""
    if is_compacted(manifest, model, checkpoint):
        raise UserError(
            f"{model}@{checkpoint} was compacted (its per-token vectors were dropped), so a new or re-run "
            f"partial cannot be merged exactly; extract into another --warehouse")


# ---------------------------------------------------------------- streaming sorted token tables


def _keys(table) -> np.ndarray:
    layer = table.column("layer").to_numpy().astype(np.int64)
    return (layer << 32) | table.column("token_id").to_numpy().astype(np.int64)


class _Sorted:
    """Rows of a Parquet file sorted by (layer, token_id), handed out by key ranges; reads
    `batch_rows` rows at a time (memory bounded whatever the file's size)."""

    def __init__(self, st: Storage, rel: str, columns: list[str], batch_rows: int):
        # pre_buffer=False: with pre-buffering, iter_batches kept every row group read so far in
        # Arrow's pool (measured: RSS grew by the whole file, 2 GB for a 1.7 GB partial)
        self._file = st.parquet_file(rel, pre_buffer=False)
        self._batches = self._file.iter_batches(batch_size=batch_rows, columns=columns)
        self._buf: pa.Table | None = None
        self._keys = np.empty(0, np.int64)
        self._fill()

    def _fill(self) -> None:
        while not len(self._keys):
            batch = next(self._batches, None)
            if batch is None:
                self._buf = None
                return
            if batch.num_rows:
                self._buf = pa.Table.from_batches([batch])
                self._keys = _keys(self._buf)

    def peek(self) -> int | None:
        return int(self._keys[0]) if len(self._keys) else None

    def take(self, hi: int) -> pa.Table | None:
        """The next rows whose key is < hi."""
        parts = []
        while len(self._keys):
            j = int(np.searchsorted(self._keys, hi))
            if j == 0:
                break
            parts.append(self._buf.slice(0, j))
            if j < len(self._keys):
                self._buf, self._keys = self._buf.slice(j), self._keys[j:]
                break
            self._keys = self._keys[:0]
            self._fill()
        return pa.concat_tables(parts) if parts else None

    def close(self) -> None:
        self._file.close()


def _matrix(table: pa.Table, d: int) -> np.ndarray:
    """The `vec` column as a float64 (rows, d) array."""
    flat = table.column("vec").combine_chunks().flatten().to_numpy(zero_copy_only=False)
    if len(flat) != table.num_rows * d:
        raise UserError(f"a vector table holds vectors of {len(flat) // max(table.num_rows, 1)} values, "
                        f"the warehouse's hidden size is {d}")
    return flat.astype(np.float64, copy=False).reshape(table.num_rows, d)


def _rowdot(A: np.ndarray, B: np.ndarray) -> np.ndarray:
    return np.einsum("ij,ij->i", A, B)


def _fold(S: np.ndarray, sq: np.ndarray, pos: np.ndarray, v: np.ndarray, sq_p: np.ndarray, sign: int) -> None:
    """The merge algebra, in place on rows `pos` of S (m, d) and sq (m,), for partial sums v with
    ‖v‖² = sq_p: fold (sign +1) sq += sq_p + 2⟨S, v⟩, S += v; un-fold (−1) S −= v, sq −= sq_p + 2⟨S, v⟩."""
    if sign > 0:
        sq[pos] += sq_p + 2 * _rowdot(S[pos], v)
        S[pos] += v
    else:
        S[pos] -= v
        sq[pos] -= sq_p + 2 * _rowdot(S[pos], v)


class _TypeStats:
    """Per layer: types with ‖S_t‖ > 0 and Σ_t S_t/‖S_t‖; the types with n_t ≥ 2 and the sum of
    their Intra-Sim (‖S_t‖² − n_t)/(n_t² − n_t) (avg_intra_sim, without a pass over every token row
    at query time: 82 M rows in a 63-checkpoint sweep); and per frequency bucket ⌊log₂ n_t⌋ the
    types, Σ n_t and Σ S_t — everything the views need from the merged vectors, gathered while
    they stream past."""

    def __init__(self, d: int):
        self.d = d
        self.types: dict[int, int] = defaultdict(int)
        self.unit: dict[int, np.ndarray] = {}
        self.intra: dict[int, list] = {}  # layer → [types with n ≥ 2, Σ intra_sim]
        self.buckets: dict[tuple[int, int], list] = {}

    def add(self, layer: int, n: np.ndarray, S: np.ndarray, sq: np.ndarray) -> None:
        """n (m,), S (m, d) Σû and sq (m,) ‖Σû‖² of a chunk of merged token types.  S is read twice
        (its row norms, then one product): the unit-vector sum Σ_t S_t/‖S_t‖ and the per-bucket sums
        Σ S_t are the rows of P S, P (1 + buckets, m) holding 1/‖S_t‖ (0 where ‖S_t‖ = 0) and 0/1."""
        two = n >= 2
        nn = n[two].astype(np.float64)
        acc = self.intra.setdefault(layer, [0, 0.0])
        acc[0] += int(two.sum())
        acc[1] += float(((sq[two] - nn) / (nn * nn - nn)).sum())
        norms = np.sqrt(_rowdot(S, S))
        nz = norms > 0
        self.types[layer] += int(nz.sum())
        bucket = np.frexp(n.astype(np.float64))[1] - 1  # ⌊log₂ n⌋, exact for n < 2⁵³
        kinds, which = np.unique(bucket, return_inverse=True)  # (k,), (m,)
        P = np.zeros((1 + len(kinds), len(n)))
        np.divide(1.0, norms, out=P[0], where=nz)
        P[1 + which.reshape(-1), np.arange(len(n))] = 1.0
        sums = P @ S  # (1 + k, d)
        unit = self.unit.setdefault(layer, np.zeros(self.d))
        unit += sums[0]
        for i, b in enumerate(kinds):
            sel = which == i
            acc = self.buckets.setdefault((layer, int(b)), [0, 0, np.zeros(self.d)])
            acc[0] += int(sel.sum())
            acc[1] += int(n[sel].sum())
            acc[2] += sums[1 + i]


def _merge_chunk(o_stats: pa.Table | None, o_vecs: pa.Table | None, r_parts: list, a_parts: list, d: int,
                 old: dict | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One chunk of token ids: the merged (ids ascending (m,), n (m,), ‖Σû‖² (m,), Σû (m, d)) from the
    old state's rows, minus the removed partials' rows, plus the added ones' (each None where it has
    no row in the chunk).  A chunk holding one added partial's rows alone (a first commit, a rebuild
    of a one-partial group) takes them as they are: folding them onto zeros gives the same numbers
    (S = 0 + v; sum_sq + 2⟨0, v⟩ = sum_sq), without the zeroed arrays and scattered adds."""
    present = [t for t in [o_stats, *r_parts, *a_parts] if t is not None]
    added = [t for t in a_parts if t is not None]
    if len(present) == 1 and len(added) == 1:
        t = added[0]
        ids = t.column("token_id").to_numpy()
        if len(ids) < 2 or bool((ids[1:] > ids[:-1]).all()):  # a partial's ids are distinct and sorted
            return (ids, t.column("n").to_numpy().astype(np.int64, copy=False),
                    t.column("sum_sq").to_numpy().astype(np.float64, copy=False), _matrix(t, d))
    ids = np.unique(np.concatenate([t.column("token_id").to_numpy() for t in present]))
    m = len(ids)
    S = np.zeros((m, d))  # (m, d) merged Σû
    n = np.zeros(m, np.int64)
    sq = np.zeros(m)
    if o_stats is not None:
        pos = np.searchsorted(ids, o_stats.column("token_id").to_numpy())
        if o_vecs is None or o_vecs.num_rows != o_stats.num_rows:
            raise UserError(f"{old['files']['token_vectors']}: merged vectors do not match token_stats "
                            "(run `python cli.py validate --fix`)")
        S[pos] = _matrix(o_vecs, d)
        n[pos] = o_stats.column("n").to_numpy()
        sq[pos] = o_stats.column("sum_sq").to_numpy()
    for sign, parts in ((-1, r_parts), (1, a_parts)):  # un-fold the replaced, fold the new
        for t in (t for t in parts if t is not None):
            pos = np.searchsorted(ids, t.column("token_id").to_numpy())
            _fold(S, sq, pos, _matrix(t, d), t.column("sum_sq").to_numpy(), sign)
            n[pos] += sign * t.column("n").to_numpy()
    if (n < 0).any():
        raise UserError("merged counts went negative while un-merging a replaced partial: the merged "
                        "tables do not match their partials (run `python cli.py validate --fix`)")
    return ids, n, sq, S


def _fold_tokens(st: Storage, key: dict, old: dict | None, adds: list[dict], removes: list[dict],
                 members: list[dict], d: int, writers: dict) -> _TypeStats:
    """Stream the group's merged token state, the partials to remove and the partials to add, chunk
    by chunk of token ids, into new token_stats and token_vectors files; returns the type statistics.

    The token state (token_vectors, 8·d bytes per layer and type) is written only for a group of two
    or more partials (`members`, the group's partials afterwards): a group of one partial's state is
    that partial's token_sums (the same Σû, exactly: folding starts from zeros), so a first commit
    writes no copy of them.  A fold onto such a group starts from its members — at most one old
    partial read, as bounded as reading the state."""
    if old is not None and "token_vectors" not in old["files"]:
        old, adds, removes = None, members, []
    keep_state = len(members) > 1
    chunk_rows = max(64, CHUNK_BYTES // (8 * d))
    streams: list[_Sorted] = []
    try:
        old_stats = old_vecs = None
        if old is not None:
            old_stats = _Sorted(st, old["files"]["token_stats"], ["layer", "token_id", "n", "sum_sq"], chunk_rows)
            old_vecs = _Sorted(st, old["files"]["token_vectors"], ["layer", "token_id", "vec"], chunk_rows)
            streams += [old_stats, old_vecs]
        cols = ["layer", "token_id", "n", "sum_sq", "vec"]
        rms = [_Sorted(st, e["files"]["token_sums"], cols, chunk_rows) for e in removes]
        ads = [_Sorted(st, e["files"]["token_sums"], cols, chunk_rows) for e in adds]
        streams += rms + ads
        stats = _TypeStats(d)
        pending: dict[str, list] = defaultdict(list)
        pending_rows = 0

        def flush_stats():
            nonlocal pending_rows
            if pending_rows:
                writers["token_stats"].write({k: np.concatenate(v) for k, v in pending.items()} | {
                    k: [val] * pending_rows for k, val in key.items()})
                pending.clear()
                pending_rows = 0

        while True:
            heads = [k for k in (s.peek() for s in streams) if k is not None]
            if not heads:
                break
            start = min(heads)
            layer, lo = start >> 32, start & _MASK
            hi = (layer << 32) + min(lo + chunk_rows, 1 << 32)
            o_stats = old_stats.take(hi) if old_stats else None
            o_vecs = old_vecs.take(hi) if old_vecs else None
            r_parts = [s.take(hi) for s in rms]
            a_parts = [s.take(hi) for s in ads]
            ids, n, sq, S = _merge_chunk(o_stats, o_vecs, r_parts, a_parts, d, old)
            keep = n > 0
            if not keep.all():  # (a copy of S only where a type's count went to zero)
                ids, n, sq, S = ids[keep], n[keep], sq[keep], S[keep]
            if not len(ids):
                continue
            lay = np.full(len(ids), layer, np.int16)
            if keep_state:
                writers["token_vectors"].write({k: [v] * len(ids) for k, v in key.items()} | {
                    "layer": lay, "token_id": ids.astype(np.int32), "vec": store.list_array(S)})
            for k, v in (("layer", lay), ("token_id", ids.astype(np.int32)), ("n", n), ("sum_sq", sq)):
                pending[k].append(v)
            pending_rows += len(ids)
            if pending_rows >= STATS_ROWS:
                flush_stats()
            stats.add(int(layer), n, S, sq)
        flush_stats()
        return stats
    finally:
        for s in streams:
            s.close()


# ---------------------------------------------------------------- layer totals


_LAYER_INTS = ("n", "n_nonfinite", "n_zero", "windows")
_LAYER_VECS = ("sum_h", "sum_u2")


def _fold_layers(st: Storage, old: dict | None, adds: list[dict], removes: list[dict]) -> dict[int, dict]:
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
                        "sum_sq": 0.0, "window_cos": 0.0, "vec": np.zeros_like(v),
                        **{k: 0 for k in _LAYER_INTS}, **{k: np.zeros_like(v) for k in _LAYER_VECS}}
                sq = np.array([tot["sum_sq"]])
                _fold(tot["vec"].reshape(1, -1), sq, np.array([0]), v[None], np.array([r["sum_sq"]]), sign)
                tot["sum_sq"] = float(sq[0])
                for k in _LAYER_INTS:
                    tot[k] += sign * r[k]
                tot["window_cos"] += sign * r["window_cos"]
                for k in _LAYER_VECS:
                    tot[k] = tot[k] + sign * np.asarray(r[k])
    return state


# Per-layer scalars of extract/sequences.py: NULL in a group where any partial lacks them (an older
# run, --no-sequences, no --prompt-entropy), so a group's value never silently covers part of it.
_WINDOW_SCALARS = schema.WINDOW_SCALARS


def _window_scalars(st: Storage, layers: dict[int, dict], old: dict | None, adds: list[dict],
                    removes: list[dict], members: list[dict]) -> None:
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


def _fold_sequences(st: Storage, old: dict | None, adds: list[dict], removes: list[dict], members: list[dict],
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


def _merge_massive(st: Storage, old: dict | None, adds: list[dict], removes: list[dict], members: list[dict],
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


def _moments_layer(st: Storage, layer: int, sources: list[tuple[dict, str]]) -> dict | None:
    """The sum of the given moments tables (entry, table) at one layer (None: no rows)."""
    return _moment_sum(r for e, t in sources for r in _moment_rows(_read_layer(st, e["files"][t], layer)))


def _sample_layer(st: Storage, layer: int, sources: list[tuple[dict, str]], k: int) -> pa.Table | None:
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


def fold_group(root, model: str, checkpoint: str, group: str, old: dict | None, adds: list[dict],
               removes: list[dict], members: list[dict], dest=None) -> dict:
    """Write the merged files of one group after removing `removes` and adding `adds` to the state of
    its merged entry `old` (None: from nothing), and return the new merged entry.  `members` are the
    group's data entries afterwards.  The files are read from `root` and written to `dest` (default:
    the same warehouse)."""
    st = checked(root, [old, *adds, *removes, *members])  # every input verified before it is folded
    step, d = members[0]["step"], members[0]["hidden_size"]
    key = {"model": model, "checkpoint": checkpoint, "step": step, "source": group}
    out = _Writers(open_storage(dest) if dest is not None else st.inner, key, store.new_run_id())
    try:
        types = _fold_tokens(st, key, old, adds, removes, members, d, out)
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
        "inputs": _inputs(members), "stats": {"partials": len(members)},
        "settings": {"sample": derived["sample_k"]}, "provenance": {},
    }


def relabel_group(root, entry: dict, group: str) -> dict:
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


def _fold_derived(st: Storage, old: dict | None, adds: list[dict], removes: list[dict], members: list[dict],
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


# ---------------------------------------------------------------- commit, rebuild, compact


def fold(root, manifest: dict, data: list[dict], dropped: Iterable[dict] = ()) -> list[dict]:
    """New merged entries for every group the data entries `data` touch (they may replace entries of
    the same key in `manifest`) or the data entries `dropped` leave (partials `replacements` found
    covered or conflicting: un-folded like a replaced one); their files are written, not yet
    committed.  A group left without partials gets no entry (`empty_groups` names it for removal)."""
    by_pair = defaultdict(list)
    for e in data:
        by_pair[(e["model"], e["checkpoint"])].append(e)
    gone = defaultdict(list)
    for e in dropped:
        if e["kind"] != "data":
            continue
        gone[(e["model"], e["checkpoint"])].append(e)
        by_pair.setdefault((e["model"], e["checkpoint"]), [])
    current_all = _data_by_pair(manifest)
    out: list[dict] = []
    try:
        for (model, checkpoint), new in sorted(by_pair.items()):
            check_open(manifest, model, checkpoint)
            current = {e["key"]: e for e in current_all.get((model, checkpoint), [])}
            replaced = [current[e["key"]] for e in new if e["key"] in current]
            replaced += [e for e in gone[(model, checkpoint)] if e["key"] in current and e not in replaced]
            after = {k: e for k, e in current.items() if k not in {r["key"] for r in replaced}}
            after.update({e["key"]: e for e in new})
            folded: dict[frozenset, dict] = {}  # the partials of a group folded here → its merged entry
            for group in sorted({e["source"] for e in new + replaced}) + [ALL]:
                inside = [e for e in after.values() if _in_group(e, group)]
                if not inside:  # every partial of the group dropped: its merged entry goes (empty_groups)
                    continue
                members = frozenset(e["key"] for e in inside)
                if members in folded:  # the same partials (one source: 'all'): copied, not folded again
                    out.append(relabel_group(root, folded[members], group))
                    continue
                out.append(fold_group(root, model, checkpoint, group,
                                      manifest["entries"].get(group_key(model, checkpoint, group)),
                                      [e for e in new if _in_group(e, group)],
                                      [e for e in replaced if _in_group(e, group)], inside))
                folded[members] = out[-1]
    except BaseException:
        discard(root, out)
        raise
    return out


# ---------------------------------------------------------------- what a partial covers

# A data partial covers the documents of its source (the file with the fingerprint it records) whose
# index in the source is ≡ I − 1 (mod N) for its shard I of N (extract/sources.py: indexed_documents,
# split_documents), up to --max-tokens; the model's weights are named by `model_identity`.  Two shards
# I/N and J/M of one source: J/M ⊆ I/N iff N divides M and J ≡ I (mod N); they share documents iff
# I ≡ J (mod gcd(N, M)) (Chinese remainder theorem), whatever the number of documents.


def shard_of(entry: dict) -> tuple[int, int]:
    i, _, n = (entry.get("shard") or "1-of-1").partition("-of-")
    return int(i), int(n)


def covers(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Whether shard a = (I, N) holds every document of shard b = (J, M)."""
    (i, n), (j, m) = a, b
    return m % n == 0 and (j - 1) % n == i - 1


def overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Whether shards a and b share a document."""
    (i, n), (j, m) = a, b
    return (i - j) % math.gcd(n, m) == 0


def _identity(entry: dict) -> str | None:
    return entry.get("provenance", {}).get("model_identity")


def replacements(manifest: dict, entries: list[dict]) -> tuple[list[dict], list[tuple[dict, str]]]:
    """(committed entries the new `entries` replace, [(committed entry, why)] they conflict with).

    Replaced: a data partial of the same (model, checkpoint, source) whose documents the new one
    covers, from the same source file.  Conflicts: such a partial that shares documents with the new
    one without being covered (a re-shard: 1/1 then 1/2 — keeping both would count half the
    documents twice); one of another version of the source file (another fingerprint) that the new
    one does not cover (two file versions would be merged into one source); any entry of the same
    (model, checkpoint) made from other weights (another `model_identity`)."""
    keys = {e["key"] for e in entries}
    replaced: dict[str, dict] = {}
    conflicts: dict[str, tuple[dict, str]] = {}
    for new in entries:
        ident = _identity(new)
        for old in manifest["entries"].values():
            if old["kind"] not in ("data", "params") or (old["model"], old["checkpoint"]) != (new["model"], new["checkpoint"]):
                continue
            if ident and _identity(old) and _identity(old) != ident and old["key"] not in conflicts:
                conflicts[old["key"]] = (old, "weights")
                continue
            if new["kind"] != "data" or old["kind"] != "data" or old["source"] != new["source"] or old["key"] in keys:
                continue
            a, b = shard_of(new), shard_of(old)
            fp_new = new.get("provenance", {}).get("source_fingerprint")
            fp_old = old.get("provenance", {}).get("source_fingerprint")
            if covers(a, b):
                replaced[old["key"]] = old
            elif overlaps(a, b):
                conflicts.setdefault(old["key"], (old, "shard"))
            elif fp_new and fp_old and fp_new != fp_old:
                conflicts.setdefault(old["key"], (old, "file"))
    return [e for k, e in replaced.items() if k not in conflicts], list(conflicts.values())


def conflict_line(conflicts: list[tuple[dict, str]]) -> str:
    """One line naming the first conflict (and how many more), and the ways out."""
    old, why = conflicts[0]
    what = f"{old['model']}@{old['checkpoint']}"
    shard = "/".join(map(str, shard_of(old)))
    more = f" (and {len(conflicts) - 1} more)" if len(conflicts) > 1 else ""
    replace = "pass --replace (a sweep file: replace = true) to drop"
    if why == "weights":
        where = old.get("provenance", {}).get("model_location") or "another location"
        return (f"the warehouse holds {what} from other weights ({where}, identity {_identity(old)}){more}; "
                f"give this model another name with --name, or {replace} what holds the other weights")
    if why == "file":
        return (f"source {old['source']} of {what} holds shard {shard} of another version of its file "
                f"(fingerprint {old.get('provenance', {}).get('source_fingerprint')}){more}; re-extract the whole "
                f"source (--shard 1/1), give it another source name, or {replace} the old shards")
    return (f"source {old['source']} of {what} holds shard {shard}, which shares documents with this shard but "
            f"is not covered by it{more}; re-extract with --shard {shard} (or one that covers it), or {replace} "
            "it (then extract the other shards of the new sharding)")


def check_conflicts(manifest: dict, entries: list[dict]) -> None:
    """Before any forward pass: the conflicts `commit` would refuse (without --replace)."""
    _, conflicts = replacements(manifest, entries)
    if conflicts:
        raise UserError(conflict_line(conflicts))


def empty_groups(manifest: dict, entries: list[dict], dropped: list[dict]) -> list[str]:
    """Merged entries left without partials once `dropped` go and `entries` come."""
    keys = {e["key"] for e in dropped} - {e["key"] for e in entries}
    after = [e for e in manifest["entries"].values() if e["kind"] == "data" and e["key"] not in keys] + \
        [e for e in entries if e["kind"] == "data"]
    live = {(e["model"], e["checkpoint"], g) for e in after for g in (e["source"], ALL)}
    out = []
    for e in dropped:
        if e["kind"] != "data":
            continue
        for g in (e["source"], ALL):
            k = group_key(e["model"], e["checkpoint"], g)
            if (e["model"], e["checkpoint"], g) not in live and k in manifest["entries"] and k not in out:
                out.append(k)
    return out


def discard(root, entries: list[dict]) -> None:
    """Remove the entries' files (uncommitted ones); a storage fault leaves them as orphans, which are
    invisible and removed by `validate --fix`."""
    st = open_storage(root)
    for e in entries:
        for rel in e["files"].values():
            with contextlib.suppress(Exception):
                st.delete(rel)
    store.release_leases(st, {store.run_of(rel) for e in entries for rel in e["files"].values()})


def committed_files(root, entries: list[dict]) -> set[str]:
    """The files of those `entries` that the current state lists (their record was created)."""
    try:
        live = store.read_manifest(root)["entries"]
    except Exception:  # unreadable state: treat nothing as committed only if nothing can be read
        return {f for e in entries for f in e["files"].values()}
    return {f for e in entries if live.get(e["key"], {}).get("run_id") == e["run_id"] for f in e["files"].values()}


def _discard_unless_committed(root, entries: list[dict]) -> None:
    """After an exception around publishing: remove the entries' new files unless the record that
    lists them was created (an interrupt while writing the companions comes after it)."""
    keep = committed_files(root, entries)
    discard(root, [{**e, "files": {t: f for t, f in e["files"].items() if f not in keep}} for e in entries])


def _pairs_touched(records: list[dict]) -> set[tuple[str, str]]:
    out = {(e["model"], e["checkpoint"]) for r in records for e in r["put"]}
    return out | {tuple(json.loads(k)[1:3]) for r in records for k in r["remove"]}


def commit(root, entries: list[dict], max_tries: int = 1000, replace: bool = False) -> list[str]:
    """Publish params and data entries together with the merged entries of every group they touch,
    in one commit record; returns the files no entry lists any more (deleted).  Partials the new
    ones cover are replaced (`replacements`); one that conflicts (an overlapping shard, another
    version of the source file, other weights under the model's name) stops the commit with one
    line, or with `replace` is dropped in the same record.  No lock: when
    another writer committed first, the merged files are folded again on top of its state if it
    touched the same (model, checkpoint), else the same files are published on top of it."""
    root = open_storage(root)
    data = [e for e in entries if e["kind"] == "data"]
    pairs = {(e["model"], e["checkpoint"]) for e in entries}
    seq, manifest = store.read_state(root)
    merged: list[dict] | None = None
    for _ in range(max_tries):
        for e in entries:
            store.check_compatible(manifest, e["model"], e["hidden_size"])
        if merged is None:
            try:
                for model, checkpoint in sorted({(e["model"], e["checkpoint"]) for e in data}):
                    check_open(manifest, model, checkpoint)  # a compacted checkpoint: that line first
                dropped, conflicts = replacements(manifest, entries)
                if conflicts and not replace:
                    raise UserError(conflict_line(conflicts))
                dropped += [x for x, _ in conflicts]
                merged = fold(root, manifest, data, dropped)
                remove = sorted({x["key"] for x in dropped} - {e["key"] for e in entries}) + \
                    empty_groups(manifest, entries, dropped)
            except FileNotFoundError as e:  # a writer that committed meanwhile replaced a merged file
                latest, _ = store.changes_since(root, seq)
                if latest == seq:
                    raise UserError(f"{e.filename or e}: listed in the manifest but missing "
                                    "(run `python cli.py validate`)") from None
                seq, manifest = store.read_state(root)
                continue
        try:
            faults.hit("merge")  # merged files written, commit record not yet
            stale = store.publish(root, seq, manifest, entries + merged, remove)
        except BaseException:
            _discard_unless_committed(root, merged)
            raise
        if stale is not None:
            return stale
        _, records = store.changes_since(root, seq)
        seq, manifest = store.read_state(root)
        if _pairs_touched(records) & pairs:
            discard(root, merged)  # folded on a state that is no longer the latest for these pairs
            merged = None
    raise UserError(f"{root}: gave up committing after {max_tries} tries (other writers kept committing first)")


def _publish_retrying(root, make) -> object:
    """Run make(manifest) → (entries, remove, result) and publish it; on a lost race, discard its new
    entries' files and run it again on the newer state."""
    while True:
        seq, manifest = store.read_state(root)
        entries, remove, result = make(manifest)
        if not entries and not remove:
            return result
        new = [e for e in entries if e["kind"] == "merged" and not e.get("compacted")]  # files written by make
        try:
            ok = store.publish(root, seq, manifest, entries, remove)
        except BaseException:
            _discard_unless_committed(root, new)
            raise
        if ok is not None:
            return result
        discard(root, new)


def expected_groups(manifest: dict) -> dict[str, tuple[str, str, str, list[dict]]]:
    """Merged entry key → (model, checkpoint, group, member data entries) the data calls for."""
    out = {}
    for (model, checkpoint), entries in _data_by_pair(manifest).items():
        for group in sorted({e["source"] for e in entries}) + [ALL]:
            out[group_key(model, checkpoint, group)] = (model, checkpoint, group,
                                                        [e for e in entries if _in_group(e, group)])
    return out


def stale_groups(manifest: dict) -> tuple[list[str], list[str]]:
    """(merged keys missing or folded from other partials than the manifest lists, merged keys left over)."""
    want = expected_groups(manifest)
    have = {k: e for k, e in manifest["entries"].items() if e["kind"] == "merged"}
    stale = [k for k, (*_, members) in want.items() if have.get(k, {}).get("inputs") != _inputs(members)]
    return stale, [k for k in have if k not in want]


def rebuild(root, keys: list[str] | None = None) -> int:
    """Re-merge the given groups (default: every stale one) from their partials and commit them;
    returns how many were rebuilt.  Compacted checkpoints cannot be rebuilt (their vectors are gone)."""
    root = open_storage(root)

    def make(manifest):
        stale, extra = stale_groups(manifest)
        want = expected_groups(manifest)
        todo = [k for k in (stale if keys is None else keys) if k in want]
        new: list[dict] = []
        try:
            for k in todo:
                model, checkpoint, group, members = want[k]
                if any(e.get("compacted") for e in members):
                    raise UserError(f"{model}@{checkpoint}: compacted, its merged tables cannot be rebuilt")
                new.append(fold_group(root, model, checkpoint, group, None, members, [], members))
            faults.hit("merge")
        except BaseException:
            discard(root, new)
            raise
        return new, extra, len(new)

    return _publish_retrying(root, make)


def _table(st: Storage, rel: str | None, columns: list[str] | None = None) -> pa.Table | None:
    return st.read_table(rel, columns=columns) if rel else None


# Tolerance of each merged table against a fresh merge of its partials, as (relative to the value,
# relative to the column's largest magnitude): |x − y| ≤ a·|y| + b·max|y|.  Sums (n exact, float
# sums in another order) agree to ~1e-15 relative; 1e-9 leaves room for many partials.  Tables
# derived through an eigendecomposition or a least-squares fit of merged moments (spectrum,
# dim_variance, layer_metrics) inherit the moments' rounding amplified by the conditioning: 1e-6 of
# the value plus 1e-9 of the largest (e.g. the top eigenvalue).  Samples and massive rows are copies:
# exact.  Integer and string columns are always compared exactly.
TOLERANCES = {
    "token_stats": (1e-9, 1e-12), "token_vectors": (1e-9, 1e-12), "layer_totals": (1e-9, 1e-12),
    "frequency_buckets": (1e-9, 1e-12), "moments_merged": (1e-9, 1e-12), "sequence_moments_merged": (1e-9, 1e-12),
    "samples_merged": (0.0, 0.0), "massive_merged": (0.0, 0.0),
    "spectrum": (1e-6, 1e-9), "sequence_eigenvalues": (1e-6, 1e-9), "dim_variance": (1e-6, 1e-9),
    "layer_metrics": (1e-6, 1e-9),
}


def _floats(col: pa.ChunkedArray) -> tuple[np.ndarray, list | None]:
    """A float or list-of-float column as flat float64 values (nulls: NaN) and its list lengths."""
    import pyarrow.compute as pc

    col = col.combine_chunks()
    lengths = None
    while pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
        lengths = (lengths or []) + [pc.list_value_length(col).to_pylist()]
        col = pc.list_flatten(col)
    return col.cast(pa.float64()).to_numpy(zero_copy_only=False).astype(np.float64), lengths


def compare_tables(a: pa.Table, b: pa.Table, table: str) -> str | None:
    """Why `a` (stored) differs from `b` (a fresh merge) beyond the table's tolerance (None: equal)."""
    rel_tol, col_tol = TOLERANCES.get(table, (1e-9, 1e-12))
    if a.column_names != b.column_names:
        return f"columns {a.column_names}, a fresh merge has {b.column_names}"
    if a.num_rows != b.num_rows:
        return f"{a.num_rows} rows, a fresh merge has {b.num_rows}"
    exact = [f.name for f in a.schema if pa.types.is_integer(f.type) or pa.types.is_string(f.type)
             or pa.types.is_boolean(f.type)]
    order = [(c, "ascending") for c in exact]
    if order:
        a, b = a.sort_by(order), b.sort_by(order)
    for f in a.schema:
        x, y = a.column(f.name), b.column(f.name)
        if f.name in exact:
            if not x.equals(y):
                return f"column {f.name} differs"
            continue
        (xv, xl), (yv, yl) = _floats(x), _floats(y)
        if xl != yl or xv.shape != yv.shape:
            return f"column {f.name}: vector lengths differ"
        if not xv.size:
            continue
        scale = float(np.nanmax(np.abs(yv))) if np.isfinite(yv).any() else 0.0
        with np.errstate(invalid="ignore"):
            ok = (np.abs(xv - yv) <= rel_tol * np.abs(yv) + col_tol * scale) | (xv == yv) | (np.isnan(xv) & np.isnan(yv))
        if not ok.all():
            i = int(np.argmin(ok))
            return f"column {f.name}: {xv[i]!r} where a fresh merge has {yv[i]!r} (tolerance {rel_tol:g} relative)"
    return None


def check(root, manifest: dict) -> list[tuple[str, str]]:
    """(merged key, problem) for groups that are stale or left over, or any of whose merged tables
    differs from a fresh merge of their partials beyond TOLERANCES; compacted groups: layer counts
    against the partials' layer_sums.  Inputs are verified against their checksums first (a corrupt
    partial is reported, not merged).  The fresh merges are written to a local temporary directory."""
    root = open_storage(root)
    stale, extra = stale_groups(manifest)
    problems = [(k, f"merged tables of {k} are out of date (--fix re-merges them)") for k in stale]
    problems += [(k, f"merged entry {k} has no partials left (--fix removes it)") for k in extra]
    with tempfile.TemporaryDirectory(prefix="iso-check-") as tmp_dir:
        tmp = open_storage(tmp_dir)
        for k, (model, checkpoint, group, members) in expected_groups(manifest).items():
            if k in stale:
                continue
            have = manifest["entries"][k]
            try:
                if have.get("compacted") or any(e.get("compacted") for e in members):
                    st = checked(root, [have, *members])
                    want_n = defaultdict(int)
                    for e in members:
                        for r in st.read_table(e["files"]["layer_sums"], columns=["layer", "n"]).to_pylist():
                            want_n[r["layer"]] += r["n"]
                    got = {r["layer"]: r["n"] for r in _table(st, have["files"].get("layer_totals"),
                                                                 ["layer", "n"]).to_pylist()}
                    if got != dict(want_n):
                        problems.append((k, f"{k}: layer counts {got} differ from its partials' {dict(want_n)}"))
                    continue
                fresh = fold_group(root, model, checkpoint, group, None, members, [], members, dest=tmp)
            except UserError as e:  # a damaged partial: reported by the file checks, named here too
                problems.append((k, f"{k}: cannot be re-merged: {e}"))
                continue
            try:
                st = checked(root, [have])
                for table in sorted(set(have["files"]) | set(fresh["files"])):
                    if (table in have["files"]) != (table in fresh["files"]):
                        why = "missing" if table in fresh["files"] else "not in a fresh merge"
                        problems.append((k, f"{k}: {table} {why} (--fix re-merges)"))
                        continue
                    try:
                        why = compare_tables(_table(st, have["files"][table]), _table(tmp, fresh["files"][table]),
                                             table)
                    except UserError as e:
                        why = str(e)
                    except Exception as e:  # pyarrow raises several types for a damaged file
                        why = f"unreadable ({str(e)[:200]})"
                    if why:
                        problems.append((k, f"{k}: {table} differs from a fresh merge of its partials: "
                                            f"{why} (--fix re-merges)"))
            finally:
                discard(tmp, [fresh])
    return problems


def compact(root, model: str | None = None, checkpoint: str | None = None) -> dict:
    """Drop the per-partial vectors (token_sums, moments, samples) and the merge state (token_vectors,
    moments_merged, samples_merged) of the matching checkpoints, keeping every table a view reads.
    Afterwards the checkpoint is final: a new partial of it is refused.  Returns bytes before/after."""
    root = open_storage(root)
    drop_data = ("token_sums", "moments", "samples", "sequence_moments")
    sizes = {}

    def make(manifest):
        stale, _ = stale_groups(manifest)
        pairs = sorted(p for p in _data_by_pair(manifest)
                       if (model is None or p[0] == model) and (checkpoint is None or p[1] == checkpoint))
        if not pairs:
            raise UserError(f"no extracted checkpoint matches model={model!r} checkpoint={checkpoint!r}")
        want = expected_groups(manifest)
        if any((want[k][0], want[k][1]) in pairs for k in stale):
            raise UserError("merged tables are out of date; run `python cli.py validate --fix` before compacting")
        sizes["before"] = _token_bytes(root, manifest, pairs)
        sizes["pairs"] = pairs
        updated = []
        for e in manifest["entries"].values():
            if (e["model"], e["checkpoint"]) not in pairs or e["kind"] not in ("data", "merged"):
                continue
            drop = drop_data if e["kind"] == "data" else schema.STATE_TABLES
            updated.append({**e, "files": {t: f for t, f in e["files"].items() if t not in drop}, "compacted": True})
        faults.hit("compact")
        return updated, [], None

    _publish_retrying(root, make)
    after = _token_bytes(root, store.read_manifest(root), sizes["pairs"])
    return {"checkpoints": len(sizes["pairs"]), "before": sizes["before"], "after": after}


def _token_bytes(root: Storage, manifest: dict, pairs: list[tuple[str, str]]) -> dict:
    """Bytes of the token-level files of `pairs` and the (layer, token type) cells they cover."""
    total, cells = 0, 0
    for e in manifest["entries"].values():
        if (e["model"], e["checkpoint"]) not in pairs:
            continue
        for t in ("token_sums", "token_stats", "token_vectors"):
            if t in e["files"]:
                total += root.size(e["files"][t])
        if e["kind"] == "merged" and e["source"] == ALL:
            cells += root.parquet_file(e["files"]["token_stats"]).metadata.num_rows
    return {"bytes": total, "cells": cells, "bytes_per_cell": total / cells if cells else None}
