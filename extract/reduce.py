"""Reduce before commit: the ranks of one torchrun job add their float64 sums with
torch.distributed collectives, and rank 0 alone writes and commits one partial per
(checkpoint, source) — the job's whole share — instead of one partial (and one fold) per rank.

What is reduced (every rank calls `Reducer.reduce` for every source, in the same order):

* per-token sums, at the level of the rows a rank would write (`TokenSums.layer_rows`: token ids
  ascending, counts, Σû float64), one token-id range of `chunk_rows` ids at a time: the ranks
  all-gather the ids they hold in the range (ranks see different token types), each fills a dense
  float64 block over the union, and the blocks are summed on rank 0 (`reduce`), which appends the
  block to a private temporary file; memory O(ranks × chunk) per rank, whatever V is;
* the per-layer tensors (non-finite/zero counts, Σh, Σû², windows, Σ window cos), the moments
  (n, Σh, Σhhᵀ and Σ h_l h_{l+1}ᵀ as the writer reads them: float64, centres already removed),
  the per-window measures (pooled moments, curvature and prompt-entropy sums, Σ|h|) — sums;
* the massive activations: every rank's top-k candidates gathered, the top k kept in the same total
  order one process uses (`sequences.top_order`);
* the bottom-k sample: every rank's k keys gathered, the k smallest kept with their vectors;
* the per-head attention sums (extract/accumulate/attention.py): sums (the longest window: the maximum);
* the run statistics (tokens, documents, windows, …): sums (seconds, peak bytes: the maximum).

The order of float64 additions differs from one process (a sum of per-rank sums): the views agree
to float64 rounding (~1e-16 relative; a float32-stored vector may differ by one float32 ulp).  The
same code runs on NCCL (the tensors go through `cuda:LOCAL_RANK`) and gloo (CPU).

A rank that dies before or during the reduce makes torchrun stop the others: nothing was written,
nothing committed; the same command again recomputes everything, exactly.
"""

from __future__ import annotations

import datetime as _dt
import os
import shutil
import tempfile
from dataclasses import fields
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from common import faults

DEFAULT_TIMEOUT_S = 24 * 3600.0  # ranks wait for the slowest one's forward passes at the first reduce


class Reducer:
    """The collectives of one torchrun job (`launch.distributed`): the process group is opened at
    the first use, with NCCL where `device` is a GPU, gloo otherwise, and closed by `close`."""

    def __init__(self, rank: int, world_size: int, device: str = "cpu", spill_dir: str | None = None,
                 timeout_s: float | None = None, backend: str | None = None):
        self.rank, self.world = rank, world_size
        cuda = str(device).startswith("cuda") and torch.cuda.is_available()
        self.backend = backend or ("nccl" if cuda else "gloo")
        self.device = torch.device(device) if self.backend == "nccl" else torch.device("cpu")
        self.spill_dir = spill_dir
        self.timeout_s = timeout_s or float(os.environ.get("ISO_REDUCE_TIMEOUT_S", DEFAULT_TIMEOUT_S))
        self._open = False
        self.range_rows: int | None = None  # token ids per reduced range (None: a 16 MB float64 block per rank)

    @property
    def writes(self) -> bool:
        """Whether this rank writes and commits (rank 0)."""
        return self.rank == 0

    # ------------------------------------------------------------ the process group

    def _dist(self):
        import torch.distributed as dist

        if not self._open:
            if self.backend == "nccl":
                torch.cuda.set_device(self.device)
            if not dist.is_initialized():
                dist.init_process_group(self.backend, timeout=_dt.timedelta(seconds=self.timeout_s))
            self._open = True
        return dist

    def barrier(self) -> None:
        self._dist().barrier()

    def close(self) -> None:
        if self._open:
            import torch.distributed as dist

            dist.destroy_process_group()
            self._open = False

    def agree(self, obj):
        """Rank 0's `obj` on every rank (e.g. which sources are still to run)."""
        box = [obj]
        self._dist().broadcast_object_list(box, src=0)
        return box[0]

    def gather_objects(self, obj) -> list:
        out = [None] * self.world
        self._dist().all_gather_object(out, obj)
        return out

    def _sum(self, t: torch.Tensor) -> torch.Tensor:
        """Σ over ranks of a tensor (any device), on the CPU on rank 0 (this rank's own elsewhere)."""
        x = t.detach().to(self.device).clone()
        self._dist().reduce(x, dst=0)
        return x.cpu()

    def _sum_np(self, a: np.ndarray) -> np.ndarray:
        return self._sum(torch.from_numpy(np.ascontiguousarray(a))).numpy()

    def _gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's tensor of the same shape (all-gather), on the CPU."""
        x = t.detach().to(self.device).contiguous()
        out = [torch.empty_like(x) for _ in range(self.world)]
        self._dist().all_gather(out, x)
        return [o.cpu() for o in out]

    # ------------------------------------------------------------ one source

    def reduce(self, parts: list, missing: Callable[[str, str | None], tuple]) -> list:
        """`parts`: this rank's [(source, result, acc)] of one source (a split source: one per value
        this rank met).  Returns rank 0's [(source, result, reduced sums)] over every value any rank
        met (the others: []).  `missing(name, split_value)` makes an empty (source, result, acc) for a
        value this rank did not meet (it takes part in the collectives with zeros).  The accumulators
        given are closed on ranks ≠ 0 (rank 0's are closed with the `Reduced` that wraps them)."""
        faults.hit("reduce")
        mine = {sub.name: (sub, result, acc) for sub, result, acc in parts}
        names = {}
        for theirs in self.gather_objects(sorted((s.name, s.split_value) for s, _, _ in parts)):
            names.update(dict(theirs))
        out = []
        made = []
        try:
            for name in sorted(names):
                if name not in mine:
                    mine[name] = missing(name, names[name])
                    made.append(mine[name][2])
                sub, result, acc = mine[name]
                stats = self.gather_objects({f.name: getattr(result, f.name) for f in fields(result)
                                             if f.name not in ("source", "files", "vector_dtype")})
                reduced = self._reduce_sums(acc)
                if self.writes:
                    for key in stats[0]:
                        vals = [s[key] for s in stats]
                        if isinstance(vals[0], dict):  # the code paths taken: one value where the ranks agree
                            keys = sorted({k for v in vals for k in v})
                            value = {k: "; ".join(sorted({str(v[k]) for v in vals if k in v})) for k in keys}
                        else:
                            value = max(vals) if key in ("seconds", "accumulator_peak_bytes") else sum(vals)
                        setattr(result, key, value)
                    out.append((sub, result, reduced))
        except BaseException:
            for _, _, r in out:
                r.close()
            raise
        finally:
            if not self.writes:
                for _, _, acc in mine.values():
                    acc.close()
            else:
                for acc in made:
                    if all(acc is not r.acc for _, _, r in out):
                        acc.close()
        return out

    def _reduce_sums(self, acc) -> "Reduced | None":
        tmp = Path(tempfile.mkdtemp(prefix="isotropy-reduce-", dir=self.spill_dir)) if self.writes else None
        try:
            chunks = [self._reduce_rows(acc, layer, tmp) for layer in range(acc.L)]
            per_layer = {k: self._sum(getattr(acc, k)) for k in ("nonfinite", "zero", "sum_h", "sum_u2", "windows",
                                                                  "window_cos", "change_n", "change_cos",
                                                                  "change_angle", "unit_windows", "sum_ubar",
                                                                  "sum_ubar_sq")}
            moments = self._reduce_moments(acc.moments, acc.L, tmp, "moments") if acc.moments is not None else None
            if acc.extra is not None:
                self._reduce_window_measures(acc.extra, tmp)
            if acc.sample is not None:
                self._reduce_sample(acc.sample, acc.L)
            if getattr(acc, "attention", None) is not None:
                self._reduce_attention(acc.attention)
        except BaseException:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        if not self.writes:
            return None
        return Reduced(acc, tmp, chunks, per_layer, moments)

    def _reduce_rows(self, acc, layer: int, tmp: Path | None) -> list[int]:
        """The layer's token rows summed over the ranks, one token-id range at a time, appended to
        tmp/rows{layer}.npy (rank 0).  Returns the rows of each chunk written."""
        d, V = acc.d, acc.V
        R = self.range_rows or max(256, (16 << 20) // (8 * d))  # token ids per range: 16 MB float64 per rank
        rows = _Ranged(acc.layer_rows(layer), d)  # the accumulator's own chunks, cut at range ends
        written: list[int] = []
        f = open(tmp / f"rows{layer}.npy", "wb") if tmp is not None else None
        try:
            for lo in range(0, V, R):
                ids, counts, S = rows.below(lo + R)  # (m,), (m,), (m, d): this rank's rows in [lo, lo + R)
                sizes = self._gather(torch.tensor([len(ids)], dtype=torch.int64))
                top = int(max(int(s) for s in sizes))
                if top == 0:
                    continue
                pad = np.full(top, -1, dtype=np.int64)
                pad[: len(ids)] = ids
                union = np.unique(np.concatenate([g.numpy() for g in self._gather(torch.from_numpy(pad))]))
                union = union[union >= 0]  # (u,) ascending: every rank's ids in the range
                at = np.searchsorted(union, ids)
                block = np.zeros((len(union), d), dtype=np.float64)  # (u, d)
                n = np.zeros(len(union), dtype=np.int64)  # (u,)
                block[at] = S
                n[at] = counts
                block, n = self._sum_np(block), self._sum_np(n)
                if f is not None:
                    keep = n > 0
                    for a in (union[keep], n[keep], block[keep]):
                        np.save(f, a)
                    written.append(int(keep.sum()))
        finally:
            if f is not None:
                f.close()
        return written

    def _reduce_moments(self, m, L: int, tmp: Path | None, name: str) -> "_Moments":
        """n, Σh, Σhhᵀ (and the cross moments) as the writer reads them, summed over the ranks;
        the d×d matrices go to a memory-mapped file on rank 0, one layer at a time."""
        n, s1 = self._sum(m.n), self._sum(m.s1)
        s2 = self._matrices(tmp, f"{name}-s2", L, s1.shape[1], m.s2)
        has_cross = bool(getattr(m, "has_cross", False))
        n_pair = cross = None
        if has_cross:
            n_pair = self._sum(m.n_pair)
            cross = self._matrices(tmp, f"{name}-cross", L - 1, s1.shape[1], m.cross)
        return _Moments(n, s1, s2, n_pair, cross)

    def _matrices(self, tmp: Path | None, name: str, count: int, d: int, get) -> np.ndarray | None:
        out = (np.lib.format.open_memmap(tmp / f"{name}.npy", mode="w+", dtype=np.float64, shape=(count, d, d))
               if tmp is not None else None)
        for i in range(count):
            s = self._sum_np(np.asarray(get(i), dtype=np.float64))
            if out is not None:
                out[i] = s
        return out

    def _reduce_window_measures(self, ex, tmp: Path | None) -> None:
        """Rank 0's WindowMeasures becomes the job's: sums in place, pooled moments replaced, top-k
        re-selected from every rank's candidates."""
        from .sequences import top_order

        ex.finish()
        pooled = {p: self._reduce_moments(mo, ex.L, tmp, f"pooled-{p}") for p, mo in ex.pooled.items()}
        sums = {k: self._sum(getattr(ex, k)) for k in ("curv_windows", "curv_sum", "pe_windows", "pe_sum", "sum_abs")}
        val, dim, meta = (torch.cat(self._gather(t), dim=1) for t in (ex.top_val, ex.top_dim, ex.top_meta))
        if not self.writes:
            return
        ex.pooled = pooled
        for k, v in sums.items():
            setattr(ex, k, v)
        tv, td, tm = (torch.empty_like(t).cpu() for t in (ex.top_val, ex.top_dim, ex.top_meta))
        for layer in range(ex.L):  # (world·k,) candidates → the k first in one process's order
            order = top_order(val[layer], meta[layer], dim[layer])[: ex.k]
            tv[layer], td[layer], tm[layer] = val[layer][order], dim[layer][order], meta[layer][order]
        ex.top_val, ex.top_dim, ex.top_meta = tv, td, tm

    def _reduce_attention(self, att) -> None:
        """Rank 0's per-head attention sums become the job's: every tensor summed, the sink counts
        summed, the longest window the largest."""
        for st in att.layers:
            for name in st.TENSORS:
                t = getattr(st, name)
                if t is not None:
                    summed = self._sum(t)
                    if self.writes:
                        setattr(st, name, summed)
            counts = self.gather_objects((st.sink_n, st.windows, st.max_window))
            if self.writes:
                st.sink_n = sum(c[0] for c in counts)
                st.windows = sum(c[1] for c in counts)
                st.max_window = max(c[2] for c in counts)

    def _reduce_sample(self, smp, L: int) -> None:
        """Rank 0's bottom-k sample becomes the bottom k of every rank's."""
        got = self.gather_objects((smp.keys, smp.meta))
        keys = torch.cat([k for k, _ in got])
        meta = torch.cat([m for _, m in got])
        order = torch.argsort(keys)[: smp.k]
        order = order[torch.argsort(keys[order])]
        for layer in range(L):
            vecs = torch.cat(self.gather_objects(smp.vecs[layer]))
            if self.writes:
                smp.vecs[layer] = vecs[order]
        if self.writes:
            smp.keys, smp.meta = keys[order], meta[order]


class _Ranged:
    """A stream of ascending-id row chunks, taken by token-id ranges."""

    def __init__(self, chunks: Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]], d: int):
        self.chunks, self.d = chunks, d
        self.held: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.done = False

    def below(self, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The rows with id < hi (all rows before them were taken already)."""
        while not self.done and (not self.held or self.held[-1][0].size == 0 or self.held[-1][0][-1] < hi):
            nxt = next(self.chunks, None)
            if nxt is None:
                self.done = True
            else:
                self.held.append(nxt)
        take, keep = [], []
        for ids, n, S in self.held:
            j = int(np.searchsorted(ids, hi))
            take.append((ids[:j], n[:j], S[:j]))
            if j < len(ids):
                keep.append((ids[j:], n[j:], S[j:]))
        self.held = keep
        if not take:
            return np.empty(0, np.int64), np.empty(0, np.int64), np.empty((0, self.d))
        return (np.concatenate([t[0] for t in take]), np.concatenate([t[1] for t in take]),
                np.concatenate([t[2] for t in take]))


class _Moments:
    """Reduced moments, read as `Moments` is by the writer."""

    def __init__(self, n, s1, s2, n_pair, cross):
        self.n, self.s1, self.n_pair = n, s1, n_pair
        self._s2, self._cross = s2, cross

    @property
    def has_cross(self) -> bool:
        return self._cross is not None

    def s2(self, layer: int) -> np.ndarray:
        return np.asarray(self._s2[layer])

    def cross(self, layer: int) -> np.ndarray:
        return np.asarray(self._cross[layer])

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass


class Reduced:
    """The job's sums of one source on rank 0, read by the writer as a `TokenSums` is
    (`layer_rows`, the per-layer tensors, `moments`, `extra`, `sample`); the token rows come back
    from the temporary file in the chunks they were reduced in.  `close` removes the file and
    closes rank 0's own accumulator."""

    def __init__(self, acc, tmp: Path, chunks: list[list[int]], per_layer: dict, moments):
        self.acc, self.tmp, self.chunks = acc, tmp, chunks
        self.L, self.V, self.d = acc.L, acc.V, acc.d
        for k, v in per_layer.items():
            setattr(self, k, v)
        self.moments = moments
        self.extra, self.sample = acc.extra, acc.sample
        self.attention = getattr(acc, "attention", None)
        self.spills = []

    def layer_rows(self, layer: int, chunk_rows: int | None = None
                   ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        with open(self.tmp / f"rows{layer}.npy", "rb") as f:
            for _ in self.chunks[layer]:
                yield np.load(f), np.load(f), np.load(f)

    def close(self) -> None:
        if self.tmp is not None:
            self.moments = None
            if self.extra is not None:
                self.extra.pooled = {}
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None
        self.acc.close()

