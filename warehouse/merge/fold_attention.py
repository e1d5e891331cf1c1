"""The fold of the per-head attention sums of one group: attention_totals (the sums of its
partials' attention_sums, per layer, role and head) and, where the queries' second moments were
measured, attention_direction (the top eigenvector of each query head's Σqqᵀ/n and the query and
key means along it: numpy's eigh, as the other spectra are computed at fold time).

A group holds attention rows only when every one of its partials has them (a partial run with
--no-attention, or of a model the capture does not cover, leaves the group without: never a sum
over part of it).  Within the rows, the optional columns (second moments, sinks) are NULL where any
partial lacks them.  The old merged rows plus the added partials' when nothing is removed, else the
sums over the members (a few rows per head; the d² second moments only with --attention-moments).
"""

from __future__ import annotations

import numpy as np

from ..storage import Storage
from ..store import Entry

_KEY = ("layer", "role", "head")
_INTS = ("n", "excluded")
_VECS = ("sum", "sum_unit")
_OPTIONAL_SUMS = ("pair_cos", "s2", "sink_n", "sink_sum", "sink_windows")
COLUMNS = ("layer", "role", "head", "kv_head", "n", "excluded", "sum", "sum_unit", "sum_sq", "pair_cos", "s2",
           "sink_n", "sink_sum", "sink_windows", "sink_max_window")


def _add(tot: dict | None, r: dict) -> dict:
    """`tot` plus one row `r` (a NULL optional column stays NULL)."""
    if tot is None:
        return {**r, **{k: np.asarray(r[k], np.float64) for k in _VECS},
                "s2": None if r["s2"] is None else np.asarray(r["s2"], np.float64)}
    out = dict(tot)
    for k in _INTS:
        out[k] = tot[k] + r[k]
    for k in _VECS:
        out[k] = tot[k] + np.asarray(r[k], np.float64)
    out["sum_sq"] = tot["sum_sq"] + r["sum_sq"]
    for k in _OPTIONAL_SUMS:
        if tot[k] is None or r[k] is None:
            out[k] = None
        else:
            out[k] = tot[k] + (np.asarray(r[k], np.float64) if k == "s2" else r[k])
    a, b = tot["sink_max_window"], r["sink_max_window"]
    out["sink_max_window"] = None if a is None or b is None else max(a, b)
    return out


def _read(st: Storage, rel: str) -> list[dict]:
    return st.read_table(rel, columns=list(COLUMNS)).to_pylist()


def fold_attention(st: Storage, old: Entry | None, adds: list[Entry], removes: list[Entry], members: list[Entry],
                   out) -> None:
    """Write the group's attention_totals (and attention_direction) through `out` (fold._Writers)."""
    if not members or not all("attention_sums" in e["files"] for e in members):
        return
    if old is not None and "attention_totals" in old["files"] and not removes:
        parts = [(old, "attention_totals")] + [(e, "attention_sums") for e in adds]
    else:
        parts = [(e, "attention_sums") for e in members]
    totals: dict[tuple, dict] = {}
    seen_in: list[set] = []
    for e, table in parts:
        keys = set()
        for r in _read(st, e["files"][table]):
            key = tuple(r[k] for k in _KEY)
            keys.add(key)
            totals[key] = _add(totals.get(key), r)
        seen_in.append(keys)
    common = set.intersection(*seen_in) if seen_in else set()
    rows = [totals[k] for k in sorted(common, key=lambda k: (k[0], k[1], k[2]))]  # heads every part has
    if not rows:
        return
    out.rows("attention_totals", {c: [(r[c].tolist() if isinstance(r[c], np.ndarray) else r[c]) for r in rows]
                                  for c in COLUMNS})
    _directions(rows, out)


def _directions(rows: list[dict], out) -> None:
    """attention_direction from the query rows' second moments (where measured)."""
    keys = {(r["layer"], r["head"]): r for r in rows if r["role"] == "key"}
    got = {c: [] for c in ("layer", "head", "kv_head", "n", "eigenvalue", "trace", "q_mean_along", "k_mean_along")}
    for r in rows:
        k = keys.get((r["layer"], r["kv_head"]))
        if r["role"] != "query" or r["s2"] is None or r["n"] < 1 or k is None:
            continue
        hd = len(r["sum"])
        lam, vec = np.linalg.eigh(r["s2"].reshape(hd, hd) / r["n"])
        v = vec[:, -1]  # the largest eigenvalue's eigenvector
        q_along = float(r["sum"] @ v) / r["n"]
        if q_along < 0:  # oriented along the query mean
            v, q_along = -v, -q_along
        for c, x in (("layer", r["layer"]), ("head", r["head"]), ("kv_head", r["kv_head"]), ("n", r["n"]),
                     ("eigenvalue", float(lam[-1])), ("trace", r["sum_sq"] / r["n"]), ("q_mean_along", q_along),
                     ("k_mean_along", float(k["sum"] @ v) / r["n"])):
            got[c].append(x)
    if got["layer"]:
        out.rows("attention_direction", got)
