"""The fold of per-token sums: a group's merged (layer, token type) state and the partials to add or
remove, streamed in chunks of token ids in one k-way pass (memory O(streams · chunk_rows · d), whatever
V, L and the number of partials), into new token_stats and token_vectors files, with the per-layer type
statistics the views need gathered on the way.

Folding partial p into a group (float64 throughout; S = the group's merged Σû of one token type):

    sum_sq' = sum_sq + sum_sq_p + 2⟨S, s_p⟩,    S' = S + s_p,    n' = n + n_p

which is the pairwise definition Σ_p sum_sq_p + 2 Σ_{p<q} ⟨s_p, s_q⟩, computed once.  Removing a
partial (a re-run of its key) un-folds it — S' = S − s_r, sum_sq' = sum_sq − sum_sq_r − 2⟨S', s_r⟩,
n' = n − n_r — so nothing is ever counted twice.  k partials folded at once read the state once.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pyarrow as pa

from common.errors import UserError

from .. import store
from ..storage import Storage
from ..store import Entry


CHUNK_BYTES = 8 << 20  # float64 rows of one token chunk per stream
FOLD_BYTES = 512 << 20  # all streams' chunks together: a fold of many pending partials takes smaller chunks
STATS_ROWS = 1 << 20  # token_stats rows per row group
_MASK = (1 << 32) - 1


# ---------------------------------------------------------------- streaming sorted token tables


def _keys(table) -> np.ndarray:
    layer = table.column("layer").to_numpy().astype(np.int64)
    return (layer << 32) | table.column("token_id").to_numpy().astype(np.int64)


class _Sorted:
    """Rows of a Parquet file sorted by (layer, token_id), handed out by key ranges; reads
    `batch_rows` rows at a time (memory bounded whatever the file's size)."""

    def __init__(self, st: Storage, rel: str, columns: list[str], batch_rows: int):
        # pre_buffer=False: with pre-buffering, iter_batches keeps every row group read so far in
        # Arrow's pool (memory would grow to the whole file)
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


def fold_rows(S: np.ndarray, sq: np.ndarray, pos: np.ndarray, v: np.ndarray, sq_p: np.ndarray, sign: int) -> None:
    """The merge algebra, in place on rows `pos` of S (m, d) and sq (m,), for partial sums v with
    ‖v‖² = sq_p: fold (sign +1) sq += sq_p + 2⟨S, v⟩, S += v; un-fold (−1) S −= v, sq −= sq_p + 2⟨S, v⟩."""
    if sign > 0:
        sq[pos] += sq_p + 2 * _rowdot(S[pos], v)
        S[pos] += v
    else:
        S[pos] -= v
        sq[pos] -= sq_p + 2 * _rowdot(S[pos], v)


class TypeStats:
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
                 old: Entry | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
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
            fold_rows(S, sq, pos, _matrix(t, d), t.column("sum_sq").to_numpy(), sign)
            n[pos] += sign * t.column("n").to_numpy()
    if (n < 0).any():
        raise UserError("merged counts went negative while un-merging a replaced partial: the merged "
                        "tables do not match their partials (run `python cli.py validate --fix`)")
    return ids, n, sq, S


def fold_token_state(st: Storage, key: dict, old: Entry | None, adds: list[Entry], removes: list[Entry],
                     members: list[Entry], d: int, writers: dict) -> TypeStats:
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
    streams_n = 2 * (old is not None) + len(adds) + len(removes)
    chunk_rows = max(64, min(CHUNK_BYTES // (8 * d), FOLD_BYTES // (8 * d * max(streams_n, 1))))
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
        stats = TypeStats(d)
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
