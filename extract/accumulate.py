"""Per-(layer, token) sums of unit vectors, accumulated without drift, in memory that grows with
what the corpus touches and stays under a budget.

**Sparse.** A token type gets a *slot* the first time a batch counts it; every layer keeps a
float64 row per slot (`sums[layer]`: (slots, d)) and an int64 count.  The map token → slot is a
numpy array on the host (8 bytes per vocabulary entry), updated from the batch's token ids,
which the host already has: the device never has to report which tokens are new, so the hot
path has no host sync on a GPU.  Memory: (L + 2) · U · (8d + 8) bytes for U token types seen
(a dense table would need (L + 2) · V · 8d whatever the corpus).

**Budget and tiers.** With `budget` bytes, the slot tables grow (×1.25, one layer at a time) only
while they fit.  When the next batch's new token types would not, the table *evicts* the least-counted
quarter (`_SlotTable.EVICT`) of its resident types — counted over the whole stream so far (`freq`,
(V,) int64 on the host); the batch's own types never — and reuses their slots: the frequent types
stay resident and are never written.  Evicted rows go to the next tier: the accumulator's device
table → (when it is a GPU) a host-RAM table (`host`, a `_SlotTable` in host memory under its own
budget, by default half the host's free memory; rows gathered on the device and copied through two
pinned buffers asynchronously, the copy of one chunk overlapping the host's add of the previous) →
disk runs (`_Spill`: token-sorted float64 rows of every layer, exact).  Runs are merged as they
accumulate: when the runs after the first (the base) hold ≥ RATIO (2) × its rows, all are merged
into a new base in one k-way pass by token range; so few runs are left, and `layer_rows` reads every
spilled byte once, merging runs, host tier and device table per token-id range in bounded memory.

**The spill bound.** W, the bytes written to disk (`spill_bytes`), and E, those of the eviction runs
(`_Spill.bytes_evicted`): a merge writes ≤ base + the runs it consumes ≤ (1 + 1/RATIO) × the latter,
and each eviction run is consumed by one merge, so **W ≤ (2 + 1/RATIO) E = 2.5 E**.  E depends on the
stream, not only on the types seen: a type evicted and seen again is evicted again, and no fixed
budget below the stream's working set avoids that (a stream cycling through 2K types with room for
K must write a row per re-entry), so "W ≤ 2 × the final table" cannot hold for every stream.
Evicting by frequency keeps E to the re-entries of the tail; measured on Zipf streams in
docs/performance.md (bench/bench_spill.py) and tested on a short one (tests/test_spill.py).

**Exactness.** Sums are split, never rounded: a type's final sum is its partial sums added in float64,
oldest tier first (disk runs in the order written and merged, then the host tier, then the device
table); a type never evicted is bit-identical to the unbudgeted run, others equal it up to the order
of float64 additions (~1e-16 relative per addition).

**Precision.** The norm is computed in float64 from the activations as they are (`dtype=`
upcasts inside the kernel) and û = h · (1/‖h‖) is formed in float64 by type promotion, so
‖û‖² = 1 to ~1e-16 and identical vectors give an Intra-Sim of 1 to ~1e-12.  Vectors with a
NaN/inf component or zero norm are counted per layer and excluded, never summed.  When the
accumulator lives on another device than the model (`--accumulator-device cpu`), a per-batch
partial over the batch's distinct tokens is summed on the model's device first and folded in.
On a CPU the same arithmetic runs CHUNK rows at a time on one float64 copy of the chunk
(`_add_chunked`: same sums, bit for bit, at ~1/3 of the memory traffic).
"""

from __future__ import annotations

import functools
import os
import platform
import queue
import shutil
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from common import faults
from common.errors import UserError

from .sequences import chunk_terms, row_terms

try:
    import fcntl
except ImportError:  # not POSIX: orphaned spill directories are not swept
    fcntl = None

PRECISIONS = ("float32", "float64", "bfloat16")  # of the moments' per-batch products
SCATTERS = ("atomic", "segment")  # how the per-token sums are added (TokenSums)


class TokenSums:
    """sums[layer][slot] = Σ û (float64), counts[layer, slot] = n, for the token types seen."""

    def __init__(self, n_layers: int, vocab: int, d: int, device: torch.device | str,
                 master_device: torch.device | str | None = None, fold_partials: bool | None = None,
                 budget: int | None = None, spill_dir: str | Path | None = None, fused: bool | None = None,
                 scatter: str = "atomic", host_budget: int | str | None = "auto"):
        if scatter not in SCATTERS:
            raise UserError(f"--scatter {scatter!r}: expected one of {', '.join(SCATTERS)}")
        self.L, self.V, self.d = n_layers, vocab, d
        self.segment = scatter == "segment"
        self.device = torch.device(device)
        self.master = torch.device(master_device or device)
        self.fold_partials = self.master != self.device if fold_partials is None else fold_partials
        self.host_sync_free = self.device.type == "cpu"  # a sync costs nothing on the CPU
        self.slot_bytes = n_layers * (8 * d + 8) + 8  # per token type: L float64 rows, L counts, its id
        _check_budget(budget, self.slot_bytes, "--memory-budget")
        self.freq = np.zeros(vocab, dtype=np.int64)  # (V,) occurrences seen so far per type: who stays resident
        self.table = _SlotTable(n_layers, vocab, d, self.master, budget, self.freq)
        if host_budget == "auto":  # a GPU table: the host's RAM before the disk
            host_budget = default_host_budget() if self.master.type == "cuda" else None
        _check_budget(host_budget, self.slot_bytes, "the host tier's budget")
        self.host = None if host_budget is None else _SlotTable(n_layers, vocab, d, "cpu", host_budget, self.freq)
        self.disk = _Spill(n_layers, d, spill_dir)
        self._staging = None  # pinned (when CUDA) buffers for device → host copies
        self.nonfinite = torch.zeros(n_layers, dtype=torch.int64, device=self.device)
        self.zero = torch.zeros(n_layers, dtype=torch.int64, device=self.device)
        # Per layer, over every counted vector (float64, on the device: no sync):
        self.sum_h = torch.zeros(n_layers, d, dtype=torch.float64, device=self.device)  # Σh (raw)
        self.sum_u2 = torch.zeros(n_layers, d, dtype=torch.float64, device=self.device)  # Σ û_i² per dim
        self.windows = torch.zeros(n_layers, dtype=torch.int64, device=self.device)  # windows with ≥ 2 vectors
        self.window_cos = torch.zeros(n_layers, dtype=torch.float64, device=self.device)  # Σ_w mean cos(h, m_w)
        self._batch = None
        self._nxt = None  # (B·T,) the positions' next counted positions (`set_batch`, compiled step with `extra`)
        # On a GPU, a few compiled kernels per layer (norm; scale + scatter-add; per-window
        # reductions) instead of ~15 eager ones, the float64 û never written to memory: `layer_step`.
        use = self.device.type == "cuda" and not self.fold_partials and not self.segment if fused is None else fused
        self._fused = _compiled_layer_step() if use else None
        self._compiled_once = False
        # the code paths this run takes (recorded with the run; a slower one also warns once, one line)
        self.paths: dict[str, str] = {"layer_step": "compiled" if use else "eager", "scatter": scatter}
        self.moments: Moments | None = None  # optional consumers of the raw (unnormalised) vectors
        self.sample: Sample | None = None
        self.extra = None  # optional WindowMeasures (extract/sequences.py)

    # ------------------------------------------------------------ slots (the table and its tiers)

    # the table's state, read by the hot path (`add`) and by callers
    sums = property(lambda self: self.table.sums)  # [layer] (capacity, d) float64
    counts = property(lambda self: self.table.counts)  # [layer] (capacity,) int64
    slot_of = property(lambda self: self.table.slot_of)  # (V,) token → slot, host
    tokens = property(lambda self: self.table.tokens)  # (capacity,) slot → token (−1: free), host
    used = property(lambda self: self.table.resident)  # token types resident in the device table
    peak_bytes = property(lambda self: self.table.peak_bytes)  # the most the table held at once (growth included)
    capacity = property(lambda self: self.table.capacity)
    spills = property(lambda self: [r.path for r in self.disk.runs])  # the disk runs now (merged ones replace theirs)
    spill_count = property(lambda self: self.disk.evictions)  # eviction runs written to disk (merges not counted)
    spill_bytes = property(lambda self: self.disk.bytes_written)  # bytes written to spill files (merges included)
    spill_read_bytes = property(lambda self: self.disk.bytes_read)

    @property
    def budget(self) -> int | None:
        return self.table.budget

    @budget.setter
    def budget(self, value: int | None) -> None:
        self.table.budget = value

    def table_bytes(self) -> int:
        return self.table.table_bytes()

    def spill(self) -> None:
        """Evict every resident type to the next tier and release the table's memory (it grows again
        within `budget`, which the caller may have lowered)."""
        occupied = self.table.occupied()
        if len(occupied):
            self._evict_device(occupied[np.argsort(self.table.tokens[occupied])])
            self.table.release(occupied)
        self.table.reset()

    def close(self) -> None:
        """Remove the spill directory and stop the moments' thread (always call; the sums must have
        been read first)."""
        if self.moments is not None:
            self.moments.close()
        self.disk.close()

    def _assign(self, ids: np.ndarray) -> np.ndarray:
        """Slots of the batch's token ids (M,), giving new token types a slot (evicting if needed)."""
        uniq, n = np.unique(ids, return_counts=True)
        self.freq[uniq] += n
        if not self.table.admit(uniq, self._evict_device):
            raise UserError(
                f"--memory-budget {self.budget} bytes cannot hold one batch: it counts {len(uniq)} token "
                f"types × {self.slot_bytes} bytes; raise the budget or lower --batch-size")
        return self.table.slot_of[ids]

    def _evict_device(self, slots: np.ndarray) -> None:
        """The device table's rows at `slots` (token-ascending) → the host tier, else a disk run."""
        ids = self.table.tokens[slots]
        if self.host is None or not self.host.admit(ids, self._evict_host):
            self.disk.write(ids, self.table.fetcher(slots))
            return
        # host tier: rows gathered on the device, copied into pinned buffers asynchronously (the
        # copy of one chunk overlaps the host's add of the previous), added into the host rows
        host, chunk = self.host, self.disk.chunk
        pin = self.master.type == "cuda"
        if self._staging is None:
            self._staging = [(torch.empty(chunk, self.d, dtype=torch.float64, pin_memory=pin),
                              torch.empty(chunk, dtype=torch.int64, pin_memory=pin),
                              torch.cuda.Event() if pin else None) for _ in range(2)]
        src = torch.from_numpy(slots).to(self.master)
        dst = torch.from_numpy(host.slot_of[ids])

        def fold(layer, k, a, b):
            rows, cnt, event = self._staging[k]
            if event is not None:
                event.synchronize()
            host.sums[layer].index_add_(0, dst[a:b], rows[: b - a])
            host.counts[layer].index_add_(0, dst[a:b], cnt[: b - a])

        for layer in range(self.L):
            pending = None
            for i, a in enumerate(range(0, len(slots), chunk)):
                b = min(a + chunk, len(slots))
                rows, cnt, event = self._staging[i % 2]
                rows[: b - a].copy_(self.table.sums[layer].index_select(0, src[a:b]), non_blocking=pin)
                cnt[: b - a].copy_(self.table.counts[layer].index_select(0, src[a:b]), non_blocking=pin)
                if event is not None:
                    event.record()
                if pending is not None:
                    fold(layer, *pending)
                pending = (i % 2, a, b)
            if pending is not None:
                fold(layer, *pending)

    def _evict_host(self, slots: np.ndarray) -> None:
        """The host tier's rows at `slots` (token-ascending) → a disk run."""
        self.disk.write(self.host.tokens[slots], self.host.fetcher(slots))

    # ------------------------------------------------------------ the hot path

    def _h2d(self, a) -> torch.Tensor:
        """A host array or tensor on the device; to a GPU through pinned memory, so the copy is
        asynchronous (from pageable memory a `non_blocking` copy makes the host wait)."""
        t = torch.from_numpy(a) if isinstance(a, np.ndarray) else a
        if self.device.type != "cuda":
            return t.to(self.device)
        return (t if t.is_pinned() else t.pin_memory()).to(self.device, non_blocking=True)

    def set_batch(self, input_ids: torch.Tensor, counted: torch.Tensor, where: torch.Tensor | None = None) -> int:
        """input_ids, counted: (B, T) on the host; counted marks the positions that enter the
        statistics; where: (B, T, 2) each position's document and position in it (for `extra`).
        Returns their number M.  Nothing here waits for the device."""
        counted_np = counted.reshape(-1).numpy()
        sel_np = np.flatnonzero(counted_np)  # (M,)
        ids = input_ids.reshape(-1).numpy()[sel_np].astype(np.int64)  # (M,)
        slots = self._assign(ids)
        sel = self._h2d(sel_np)
        B, T = input_ids.shape
        win_np = sel_np // T  # (M,) each counted row's window
        if self.extra is not None:
            meta = None if where is None else np.concatenate(
                [where.reshape(-1, 2).numpy()[sel_np], ids[:, None]], 1)  # (M, 3) document, position, token
            self.extra.set_batch(win_np, B, meta)
        # per batch, for every layer's window sums: row windows, column indices, vectors per window
        self._windows = (self._h2d(win_np), B,
                         torch.arange(len(sel_np), device=self.device),
                         self._h2d(np.bincount(win_np, minlength=B)))
        self._counted = self._h2d(counted) if self._fused is not None else None
        self._nxt = None  # for the per-window measures' terms in the compiled step: each counted
        if self._fused is not None and self.extra is not None:  # position's next one (else itself)
            nxt = np.arange(B * T)  # (B·T,)
            nxt[sel_np[:-1]] = sel_np[1:]
            self._nxt = self._h2d(nxt)
        if self.segment:  # the batch's rows sorted by slot once; per layer, segment sums over the runs
            order = np.argsort(slots, kind="stable")  # (M,)
            uniq, lengths = np.unique(slots[order], return_counts=True)  # (U,), (U,)
            to = self._h2d
            self._segments = (to(order), to(lengths), to(uniq).to(self.master))
        if not self.fold_partials:
            self._batch = (sel, self._h2d(slots), None)
        else:  # fold a per-batch partial over the batch's distinct tokens into the remote master
            uniq, inv = np.unique(slots, return_inverse=True)  # (U,), (M,)
            self._batch = (sel, self._h2d(inv.reshape(-1)),
                           torch.from_numpy(uniq).to(self.master))
        self._ones = torch.ones(len(ids), dtype=torch.int64, device=self.device)
        self._rows_counted = len(ids)
        return len(ids)

    def add(self, layer: int, hidden: torch.Tensor) -> None:
        """hidden: (B, T, d) in any float dtype."""
        sel, index, uniq = self._batch
        d = hidden.shape[-1]
        if self._rows_counted == 0:  # a batch with no counted position (only special tokens): nothing to add
            return
        if self._fused is not None and self.sample is None and uniq is None:
            try:
                stats = _run_compiled(self._fused, self.sums[layer], self.counts[layer], index, hidden, sel,
                                      self._counted, self._nxt)
            except Exception as e:  # no Triton / compiler here, or a recompile failed or hit the limit:
                # the eager path from here on, same sums (a compile fails before the step writes anything)
                why = "recompile" if self._compiled_once else "compile"
                slow_path(self.paths, "layer_step", f"eager ({why} failed: {type(e).__name__})",
                          f"torch.compile of the accumulation step: {why} failed ({type(e).__name__}: "
                          f"{_first_line(e)}); using the eager path (slower, same sums)")
                self._fused = None
            else:
                self._compiled_once = True
                nonfinite, zero, ok_bt, *windows = stats
                windows, terms = windows[:4], windows[4:]  # terms: `row_terms` (with `extra`)
                self.nonfinite[layer] += nonfinite
                self.zero[layer] += zero
                self._window_stats(layer, *windows)
                if self.moments is not None or self.extra is not None:
                    ok = ok_bt.reshape(-1).index_select(0, sel)  # (M,) the step's own finite & non-zero test
                    flat = hidden.reshape(-1, d)  # (B·T, d)
                    h = None
                    if self.moments is not None:  # the raw rows, NaN/inf/zero ones zeroed; n and Σh from
                        h = flat.index_select(0, sel).masked_fill(~ok.unsqueeze(1), 0)  # the step: not read again
                        self.moments.add(layer, h, ok, s=windows[0].sum(0), n=windows[2].sum())
                    if self.extra is not None:  # its row terms from the step: only a few rows are read again
                        if h is None:
                            self.extra.add(layer, flat, ok, windows[0], windows[2], terms=tuple(terms), sel=sel)
                        else:
                            self.extra.add(layer, h, ok, windows[0], windows[2], terms=tuple(terms))
                return
        h = hidden.reshape(-1, d).index_select(0, sel)  # (M, d) compute dtype
        if self.sample is not None:
            self.sample.add(layer, h)
        if self.host_sync_free and not self.segment and uniq is None:
            return self._add_chunked(layer, h, index)
        norm = torch.linalg.vector_norm(h, dim=1, dtype=torch.float64)  # (M,) float64
        finite = torch.isfinite(norm)
        ok = finite & (norm > 0)  # (M,)
        all_ok = bool(ok.all()) if self.host_sync_free else False  # no sync on a GPU
        counts = self._ones
        inv = norm.reciprocal()  # (M,)
        win, n_win, cols, n_w = self._windows
        if not all_ok:  # NaN/inf or zero vectors are counted, then zeroed out
            counts, n_w = self._exclude(layer, finite, ok, win, n_win)
            h = h.masked_fill(~ok.unsqueeze(1), 0)
            inv = torch.where(ok, inv, 0.0)
            norm = torch.where(ok, norm, 0.0)
        if self.moments is not None:
            self.moments.add(layer, h, ok)
        x = h * inv.unsqueeze(1)  # (M, d) float64 û (type promotion: exact upcast, float64 product)
        if self.segment:
            m = self._segment_add(layer, h, x, counts, n_w)
        else:
            m, u = window_sums(h, norm, x, counts, win, n_win, cols)
            self._window_stats(layer, m, u, n_w, (x * x).sum(0))
            if uniq is None:
                self.sums[layer].index_add_(0, index, x)
                self.counts[layer].index_add_(0, index, counts)
            else:
                partial = torch.zeros(len(uniq), d, dtype=torch.float64, device=x.device)
                partial.index_add_(0, index, x)  # (U, d)
                count = torch.zeros(len(uniq), dtype=torch.int64, device=x.device).index_add_(0, index, counts)
                self.sums[layer].index_add_(0, uniq, partial.to(self.master))
                self.counts[layer].index_add_(0, uniq, count.to(self.master))
        if self.extra is not None:
            self.extra.add(layer, h, ok, m, n_w)

    def _exclude(self, layer: int, finite: torch.Tensor, ok: torch.Tensor, win: torch.Tensor, n_win: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch with NaN/inf or zero vectors (finite, ok: (M,)): counts them per layer and returns
        the rows' counts (1 where ok, else 0) and the vectors counted per window (n_win,)."""
        self.nonfinite[layer] += (~finite).sum()
        self.zero[layer] += (finite & ~ok).sum()
        counts = ok.long()
        return counts, torch.zeros(n_win, dtype=torch.int64, device=ok.device).index_add_(0, win, counts)

    # The CPU path: the per-window measures' `row_terms` from its chunks (True), or in WindowMeasures'
    # own chunked pass (False); None: from the chunks unless WindowMeasures runs on the moments'
    # background thread, where its own pass is off the forward's thread (docs/performance.md, session 17)
    WINDOW_TERMS: bool | None = None
    CHUNK = 512  # rows per step of the CPU path: its float64 temporaries (2 MiB at d 512) stay in cache

    def _add_chunked(self, layer: int, h: torch.Tensor, index: torch.Tensor) -> None:
        """The CPU path of `add`: the same float64 arithmetic as the general path (the norm of the
        exact upcast, û = h · (1/‖h‖), the same index-adds in the same row order, so Σû, Σh and the
        counts are bit-identical to it), done CHUNK rows at a time in place on one float64 copy of
        the chunk: one upcast per row instead of three (the norm's, the product's and Σh's type
        promotions each upcast all M rows) and no (M, d) float64 temporary, so each pass reads
        cache instead of memory.  Measured (M 4,096, d 512, 2-core Zen 2): 4.7 ms against 17.2 ms
        per layer and batch.  With `extra` (--sequences) the per-window measures' `row_terms` are
        taken from the same chunks (each chunk upcast with the previous chunk's last two rows, for
        the velocities across the boundary), so WindowMeasures does not read the rows again — unless
        it runs on the moments' background thread (`WINDOW_TERMS`; docs/performance.md, session 17).
        h: (M, d) the counted rows, index: (M,) their slots."""
        M, d = h.shape
        win, n_win, _, n_w = self._windows
        f64 = torch.float64
        m = torch.zeros(n_win, d, dtype=f64)  # Σh per window
        u = torch.zeros(n_win, d, dtype=f64)  # Σû per window
        u2 = torch.zeros(d, dtype=f64)  # Σû² per dimension
        S = self.sums[layer]
        finites, oks, excluded = [], [], False  # per chunk: its finite rows, its finite non-zero rows (c,)
        fuse = self.extra is not None and (self.WINDOW_TERMS if self.WINDOW_TERMS is not None
                                           else self.extra._worker is None)
        terms = [] if fuse else None  # per chunk: `row_terms` of its rows
        for a in range(0, M, self.CHUNK):
            b = min(a + self.CHUNK, M)
            o = 2 if terms is not None and a > 0 else 0  # the per-window terms: 2 rows of the previous chunk
            xe = h[a - o:b].to(f64, copy=True)  # (o + c, d) exact upcast, never h itself (moments read h later)
            x = xe[o:]  # (c, d) this chunk's rows
            norm = torch.linalg.vector_norm(x, dim=1)  # (c,) float64
            inv = norm.reciprocal()
            finite = torch.isfinite(norm)
            ok = finite & (norm > 0)  # (c,)
            finites.append(finite)
            oks.append(ok)
            if not bool(ok.all()):  # NaN/inf or zero vectors are zeroed out, counted below (the CPU: no sync to fear)
                excluded = True
                x.masked_fill_(~ok.unsqueeze(1), 0)
                inv = torch.where(ok, inv, 0.0)
            if terms is not None:  # the per-window measures' terms from the rows in cache (before û)
                terms.append(chunk_terms(xe, o, b == M))
            m.index_add_(0, win[a:b], x)
            x.mul_(inv.unsqueeze(1))  # û
            u.index_add_(0, win[a:b], x)
            S.index_add_(0, index[a:b], x)
            u2 += x.mul_(x).sum(0)
        ok = torch.cat(oks)  # (M,)
        counts = self._ones
        if excluded:
            counts, n_w = self._exclude(layer, torch.cat(finites), ok, win, n_win)
            h = h.masked_fill(~ok.unsqueeze(1), 0)
        self.counts[layer].index_add_(0, index, counts)
        self._window_stats(layer, m, u, n_w, u2)
        if self.moments is not None:
            self.moments.add(layer, h, ok)
        if self.extra is not None:
            if terms is not None:  # (M,) each, the chunks' pieces joined
                terms = tuple(torch.cat(t) for t in zip(*terms))
            self.extra.add(layer, h, ok, m, n_w, terms=terms)

    def _segment_add(self, layer: int, h: torch.Tensor, x: torch.Tensor, counts: torch.Tensor,
                     n_w: torch.Tensor) -> torch.Tensor:
        """The token and window sums without atomic adds (`scatter="segment"`): the rows sorted by
        slot (the order `set_batch` computed once per batch), summed per run of equal slots
        (`segment_reduce`: one pass, no two threads adding into one row), then one read-modify-write
        of each distinct slot's float64 row; the per-window sums are segment sums too (a window's
        rows are contiguous).  h (M, d) raw, x (M, d) float64 û, counts (M,) 0/1 (excluded rows zero)."""
        order, lengths, uniq = self._segments
        rows_w = self._windows[3]  # (B,) rows per window (a window's rows are contiguous)
        seg = lambda a, n: torch.segment_reduce(a, "sum", lengths=n, unsafe=True)  # noqa: E731
        part = seg(x.index_select(0, order), lengths)  # (U, d) float64
        n = seg(counts.index_select(0, order).to(torch.float64), lengths).round_().long()  # (U,) exact ints
        if self.master != x.device:
            part, n = part.to(self.master), n.to(self.master)
        S, C = self.sums[layer], self.counts[layer]
        S.index_copy_(0, uniq, S.index_select(0, uniq) + part)  # slots distinct: no two writes collide
        C.index_copy_(0, uniq, C.index_select(0, uniq) + n)
        m = seg(h.to(torch.float64), rows_w)  # (B, d)
        self._window_stats(layer, m, seg(x, rows_w), n_w, (x * x).sum(0))
        return m

    def _window_stats(self, layer, m, u, n_w, u2) -> None:
        """Fold one batch's per-window sums m = Σh (B, d), u = Σû (B, d), n_w (B,) and Σû² (d,)."""
        self.sum_h[layer] += m.sum(0)
        self.sum_u2[layer] += u2
        norm = torch.linalg.vector_norm(m, dim=1)  # (B,)
        valid = (n_w >= 2) & (norm > 0)
        # mean over the window's vectors of cos(h_i, m_w) = ⟨Σ_i û_i, m_w⟩ / (‖m_w‖ n_w)
        self.window_cos[layer] += torch.where(valid, (u * m).sum(1) / (norm * n_w).clamp_min(1e-300), 0.0).sum()
        self.windows[layer] += valid.sum()

    # ------------------------------------------------------------ reading the sums

    def layer_rows(self, layer: int, chunk_rows: int | None = None
                   ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """(token ids ascending (m,), counts (m,), Σû (m, d) float64) of one layer, in chunks of at
        most `chunk_rows` rows; token types whose count is 0 at this layer are left out.  The disk
        runs (oldest first), the host tier and the device table are merged per token-id range: each
        spilled byte is read once, in bounded memory."""
        chunk_rows = chunk_rows or self.disk.chunk
        sources = [*self.disk.runs, *(t.source() for t in (self.host, self.table) if t is not None)]
        union = _union([s.ids for s in sources])
        try:
            for a in range(0, len(union), chunk_rows):
                ids = union[a: a + chunk_rows]
                n, S = _merge_chunk(sources, layer, ids, self.d)
                keep = n > 0
                yield ids[keep], n[keep], S[keep]
        finally:
            for s in sources:
                s.close()


    def dense(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(counts (V,), Σû (V, d)) of one layer as dense tables: for tests and small vocabularies."""
        counts = torch.zeros(self.V, dtype=torch.int64)
        sums = torch.zeros(self.V, self.d, dtype=torch.float64)
        for ids, n, S in self.layer_rows(layer):
            counts[ids] = torch.from_numpy(n)
            sums[ids] = torch.from_numpy(np.ascontiguousarray(S))
        return counts, sums


def window_sums(h: torch.Tensor, norm: torch.Tensor, x: torch.Tensor, ok: torch.Tensor, win: torch.Tensor,
                n_win: int, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per window (B of them): Σh (B, d) and Σû (B, d) of the eager path.

    h: (M, d) the raw rows (excluded ones zero), norm: (M,) float64 ‖h‖ (0 where excluded), x:
    (M, d) float64 û (excluded rows zero), ok: (M,) 0/1, win: (M,) each row's window, cols =
    arange(M).  On the CPU both are scatter-adds onto B rows, O(M·d) whatever B is (with token
    batching B reaches hundreds of sentences; a (B, M) matrix product would grow with B·M·d: 17 ms
    against 2.9 ms per layer at B 240, M 4,000, d 512); Σh adds h upcast exactly to float64.  On a
    GPU, where float64 atomics onto a handful of rows serialise, one float64 GEMM of a (2B, M)
    matrix of norms and 0/1 with x (the eager GPU path: --accumulator-device cpu or --sample; the
    compiled `layer_step` reduces over T instead)."""
    M, d = x.shape
    if x.device.type == "cpu":
        zeros = lambda: torch.zeros(n_win, d, dtype=torch.float64)  # noqa: E731
        return zeros().index_add_(0, win, h.to(torch.float64)), zeros().index_add_(0, win, x)
    E = torch.zeros(2 * n_win, M, dtype=torch.float64, device=x.device)  # rows: Σh, then Σû
    E[win, cols] = norm
    E[win + n_win, cols] = ok.to(torch.float64)
    mu = E @ x  # (2B, d)
    return mu[:n_win], mu[n_win:]


def slow_path(paths: dict, key: str, value: str, message: str) -> None:
    """Record that `key` takes the slower path `value` (kept with the run's stats) and say so once, in one
    line (a RuntimeWarning: the CLI prints it, a test can catch it)."""
    if paths.get(key) == value:
        return
    paths[key] = value
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else ""


@functools.cache
def _compiled_layer_step():
    """`layer_step` under torch.compile, one compiled function per process.  Shapes: the sizes that
    change between batches (B, T, the counted rows M, the table's slots U) are marked *unbacked* on
    every call (`_run_compiled`): the graph is compiled once for any size — no 0/1 specialisation (a
    source's last batch with B = 1, a one-token window T = 1) and no duck sizing (T equal to d in
    the first batch would tie T to d) — and d, the same in every call, stays static.  With
    `dynamic=True` each of those cost a recompile (20–60 s on a GPU) and, after 8, torch ran the
    step eagerly without a word."""
    return torch.compile(layer_step, dynamic=None)


def _run_compiled(fn, sums, counts, index, hidden, sel, counted, nxt=None):
    """Call the compiled `layer_step`, its changing sizes marked unbacked (see `_compiled_layer_step`),
    and with torch's recompile limit made an error (caught by `add`: the eager path, with a warning)
    instead of a silent fallback to eager inside torch."""
    import torch._dynamo.decorators  # loaded by torch.compile already; named here for the linters

    mark = torch._dynamo.decorators.mark_unbacked
    for t in (sums, counts, index, sel) if nxt is None else (sums, counts, index, sel, nxt):
        mark(t, 0)
    for t in (hidden, counted):
        mark(t, 0)
        mark(t, 1)
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        if nxt is None:
            return fn(sums, counts, index, hidden, sel, counted)
        return fn(sums, counts, index, hidden, sel, counted, nxt)


def layer_step(sums: torch.Tensor, counts: torch.Tensor, index: torch.Tensor, hidden: torch.Tensor,
               sel: torch.Tensor, counted: torch.Tensor, nxt: torch.Tensor | None = None):
    """One layer of one batch, written for `torch.compile` (the GPU path): sums (U, d) float64 +=
    û of the counted positions of hidden (B, T, d) (flat positions `sel` (M,), slots `index`
    (M,)), counts += 1 per finite non-zero vector; plus the per-window sums the eager path gets
    from `window_sums`, here as plain reductions over T (no atomics on B rows).  Returns (vectors with NaN/inf, with zero norm,
    the counted finite non-zero positions (B, T) (for the moments),
    Σh per window (B, d), Σû per window (B, d), vectors per window (B,), Σû² (d,)) as device
    tensors: no sync.  Compiled, the upcast, scaling and masking fuse into the reductions and the
    scatter-add, so no (B, T, d) float64 tensor is materialised; eager, it is the same arithmetic.
    With `nxt` (B·T,) (each counted position's next counted position, `--sequences`): also the
    per-window measures' `row_terms` of the counted rows (float64, masked; (M,) each).

    The reductions are written in two shapes, so that a compiler that makes one kernel per shape
    (Triton: per (outputs, reduction length)) reads h in as few kernels as it can: per position, over
    d — the norm and the row terms (the successor rows by index: neighbouring rows) — and per
    window, over T — Σh, Σû and Σû² (taken per window, then over the B windows: a reduction over
    all B·T rows at once would be a third shape, another pass over h)."""
    d = hidden.shape[-1]
    norm = torch.linalg.vector_norm(hidden, dim=-1, dtype=torch.float64)  # (B, T)
    finite = norm.isfinite()
    ok = counted & finite & (norm > 0)  # (B, T)
    inv = torch.where(ok, norm.reciprocal(), 0.0)  # (B, T)
    hm = torch.where(ok.unsqueeze(-1), hidden.to(torch.float64), 0.0)  # (B, T, d)
    x = hm * inv.unsqueeze(-1)  # (B, T, d) û, zero where not counted
    sums.index_add_(0, index, x.reshape(-1, d).index_select(0, sel))
    counts.index_add_(0, index, ok.reshape(-1).index_select(0, sel).long())
    out = ((counted & ~finite).sum(), (counted & finite & (norm == 0)).sum(), ok,
           hm.sum(1), x.sum(1), ok.sum(1), (x * x).sum(1).sum(0))
    if nxt is None:
        return out
    return out + tuple(t.index_select(0, sel) for t in row_terms(hm.reshape(-1, d), nxt))


def _add_gram_upper(S: torch.Tensor, block, panels: int) -> None:
    """S (d, d) float64 += the upper triangle of xᵀx, by row panels: rows a:b of xᵀx from column a
    on, `block(a, b)` (b − a, d − a) in the products' dtype, each added into the float64 sums —
    (panels + 1)/(2 · panels) of a full product's multiply-adds (3/4 for 2, 5/8 for 4; a symmetric
    rank-k update, which torch lacks, would be 1/2).  Entries below the diagonal inside a panel are
    added too and never read (`Moments.s2` takes the upper triangle).  Measured at M = 4000, d = 512
    in float32 on 2 cores: 8.1–8.5 ms for 4 panels against 11.5 ms for x.T @ x."""
    d = S.shape[0]
    k = max(1, min(panels, d))
    edges = [round(i * d / k) for i in range(k + 1)]
    for a, b in zip(edges, edges[1:]):
        S[a:b, a:] += block(a, b)


def _onednn_nt():
    """a bᵀ for contiguous float32 CPU tensors a (i, M), b (j, M), through oneDNN (the op torch's
    own compiler uses for float32 linear layers), or None where it is missing or not x86-64.  Why:
    on AMD CPUs torch's MKL runs its AVX2 kernels even where the CPU has AVX-512; oneDNN picks its
    kernels by instruction set.  Measured on the 2-core Zen 5 CI machine, M 4096, d 512, float32:
    hᵀh' 4.5 ms from the transposed rows against 11.0 for MKL's `h.T @ h'`.  Only contiguous
    operands are fed to it: other layouts cost a copy inside, column slices a generic path (seconds)."""
    if platform.machine().lower() not in ("x86_64", "amd64") or not torch.backends.mkldnn.is_available():
        return None
    try:
        op = torch.ops.mkldnn._linear_pointwise
        a = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        b = a[:2].contiguous()
        if not torch.equal(op(a, b, None, "none", [], ""), a @ b.T):  # small integers: exact
            return None
    except (AttributeError, RuntimeError):
        return None
    return lambda a, b: op(a, b, None, "none", [], "")  # linear(a, weight b) = a bᵀ


_ONEDNN = _onednn_nt()


@functools.cache
def _avx512() -> bool:
    """Whether torch's CPU kernels run at AVX-512 here.  Why it matters: on an AVX2-only CPU oneDNN
    and MKL multiply equally fast, and MKL reads the rows transposed in place, so the transposed copy
    oneDNN's path needs (2.9 of 17 ms per layer of 4,096 × 512 rows, 2-core Zen 2) is saved: 15.3 ms."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def _mm_bf16(a: torch.Tensor, b: torch.Tensor, out_dtype: bool = False) -> torch.Tensor:
    """a b in float32 for bfloat16 a (i, k), b (k, j): every product exact (8-bit significands),
    accumulated in float32.  `out_dtype` (a GPU where `_mm_out_dtype` said yes): one tensor-core GEMM
    with a float32 output (no rounding of the result to bf16); else the operands upcast exactly to
    float32, the same arithmetic in another summation order (the CPU's path; on a GPU ~10× slower)."""
    if out_dtype:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


@functools.cache
def _mm_out_dtype(device: torch.device) -> bool:
    """Whether this torch has `torch.mm(..., out_dtype=)` (bf16 in, float32 out) on `device` — the
    device of the rows (under torchrun each rank its own GPU; never a default "cuda", which would open
    a context on GPU 0 in every rank); asked once per device, on first use (not at import)."""
    try:
        a = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError):
        return False


class Moments:
    """Per layer: n, Σh (d,), Σhhᵀ (d, d); per consecutive pair (l, l+1): Σ h_l h_{l+1}ᵀ — summed in
    float64 over the raw hidden states.  A vector with NaN/inf or zero norm is left out of its layer
    (the caller zeroes its row, so it adds nothing to any sum), and a pair's cross moment only takes
    tokens counted in both layers (`n_pair`; a zeroed row on either side adds nothing).  Counts stay
    on the device: no host sync.

    precision "float64": each batch's d×d products in float64 (products of float32/bf16 values are
    exact in float64; only the float64 sums round).  "float32" (the default): each batch's products
    in float32 — about half the time on a CPU — added into the float64 sums, so rounding never
    accumulates across batches.  So that float32 products do not lose the covariance to cancellation
    against a large mean, every row of a layer is shifted by a fixed centre c (the layer's first-batch
    mean, in float32) before the product and the shift is undone in float64 at the end: with R the rows
    fed (zeroed ones included) and s = Σh over them (zeroed rows add nothing),

        Σ_rows (h−c)(h−c)ᵀ = Σhhᵀ − c sᵀ − s cᵀ + R ccᵀ,   Σ (h_l−c_l)(h_m−c_m)ᵀ = Σ h_l h_mᵀ − s_l c_mᵀ − c_l s_mᵀ + R c_l c_mᵀ

    so the stored sums mean the same whatever the precision.  Measured error against float64: docs/views-guide.md.
    On a CPU the float32 products are taken over chunks of ≤ CHUNK rows, each chunk's products folded
    into the float64 sums: on an AVX-512 x86-64 CPU through oneDNN (`_onednn_nt`) on the rows
    transposed ((d, rows) each; a chunk's row sums give Σh cheaper than column sums), on others
    through torch (MKL) on the rows as they are; elsewhere through torch, one product per batch.

    On a CPU (`background`, the default there) all of a batch's work — counts, Σh, the shift, the
    products — is queued to one low-priority thread (`_Worker`) and done in the same order as
    inline: bit-identical sums, overlapped with the forward.  The shifted rows go to two reused
    buffers (a fresh (M, d) tensor per layer costs page faults: 2.4 ms against 0.2 for 8 MB).  The
    sums (`n`, `s1`, `n_pair`, `s2()`, `cross()`) wait for the queue when read."""

    QUEUE_BYTES = 256 << 20  # rows waiting for the background thread, at most (one call's always fits)
    CHUNK = 512  # rows per float32 product on oneDNN's path: shorter float32 sums (docs/views-guide.md: precision)

    CHUNK_BF16 = 4096  # rows per bf16 product (float32 accumulation inside it): docs/views-guide.md, precision

    def __init__(self, n_layers: int, d: int, device: torch.device | str, cross: bool = True,
                 precision: str = "float32", background: bool | None = None):
        if precision not in PRECISIONS:
            raise ValueError(f"moments precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
        dev = torch.device(device)
        self._bf16 = precision == "bfloat16"
        self._n = torch.zeros(n_layers, dtype=torch.int64, device=dev)
        self._s1 = torch.zeros(n_layers, d, dtype=torch.float64, device=dev)
        self._s2 = torch.zeros(n_layers, d, d, dtype=torch.float64, device=dev)  # Σ(h−c)(h−c)ᵀ, upper triangle
        self._cross = torch.zeros(n_layers - 1, d, d, dtype=torch.float64, device=dev) if cross else None
        self._n_pair = torch.zeros(n_layers - 1, dtype=torch.int64, device=dev)
        self._shifted = precision == "float32"
        self._c = torch.zeros(n_layers, d, dtype=torch.float32, device=dev)  # centres (0: not shifted)
        self._c_set = [not self._shifted] * n_layers
        self._rows = [0] * n_layers  # R: rows fed per layer (host ints: shapes, no sync)
        self._pair_rows = [0] * max(n_layers - 1, 0)
        self._pair_s = torch.zeros(max(n_layers - 1, 0), 2, d, dtype=torch.float64, device=dev)  # s_l, s_m over pair batches
        self._prev: tuple[int, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._dtype = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}[precision]
        # float32 on a CPU: products of ≤ CHUNK-row chunks, through oneDNN on transposed rows where
        # the CPU has AVX-512 (MKL runs only its AVX2 kernels on AMD), else MKL on the rows as they are
        self._nt = _ONEDNN if self._shifted and dev.type == "cpu" and _avx512() else None
        self._chunked = self._shifted and dev.type == "cpu"
        self._bufs = [torch.empty(0, dtype=self._dtype, device=dev) for _ in range(2)]  # layers alternate
        self._pair = torch.empty(0, dtype=torch.bfloat16, device=dev)  # bfloat16: (M, 2d), layers alternate halves
        self._split: list[bool | None] = [None] * n_layers  # bf16: centred hi+lo rows (decided at the first batch)
        self._ratio: list[float | None] = [None] * n_layers  # bf16: the first batch's ‖μ‖²/tr C per layer
        self._pair_rows_of: list = [None, None]  # bf16: which (layer, rows) each half of the pair buffer holds
        self._pair_ok = False
        self._tensor_cores = dev.type == "cuda"  # bf16 products with a float32 output, where torch has them
        self._out_dtype: bool | None = None  # decided at the first bf16 rows (`add`)
        self.paths: dict[str, str] = {"moments": {
            "float64": "float64", "bfloat16": "bfloat16 (tensor cores, float32 out)" if self._tensor_cores else
            "bfloat16 (float32 products of the upcast rows)",
            "float32": "float32 (centred" + (", oneDNN)" if self._nt is not None else ")")}[precision]}
        if self._bf16:
            self.paths["moments_rows"] = "raw"
        if background is None:  # on a CPU: the moments' work fills the cores the forward leaves idle
            background = dev.type == "cpu"
        if not background:
            self._worker = None
        elif dev.type == "cuda":  # a side stream: the products overlap the forward's kernels, no host sync
            self._worker = _SideStream(dev)
        else:
            self._worker = _Worker(max_bytes=self.QUEUE_BYTES)

    @property
    def has_cross(self) -> bool:
        return self._cross is not None

    @property
    def n(self) -> torch.Tensor:
        """(L,) vectors counted per layer."""
        self.finish()
        return self._n

    @property
    def s1(self) -> torch.Tensor:
        """(L, d) float64 Σh per layer."""
        self.finish()
        return self._s1

    @property
    def n_pair(self) -> torch.Tensor:
        """(L − 1,) tokens counted in both layers of each pair."""
        self.finish()
        return self._n_pair

    def add(self, layer: int, h: torch.Tensor, ok: torch.Tensor, s: torch.Tensor | None = None,
            n: torch.Tensor | None = None) -> None:
        """h: (M, d) raw vectors of the batch's counted positions, rows that are not ok zeroed;
        ok: (M,) bool.  The caller must not modify h or ok afterwards (a thread may read them later).
        s: (d,) float64 Σh and n: () ok.sum() of these rows where the caller has them already (the
        compiled token-sum step): the bf16 path then does not read the rows again for them (float64
        sums of bf16 values: the same numbers wherever float64 holds them exactly, i.e. unless the
        rows' exponents span more than ~40 bits)."""
        if self._bf16 and h.dtype != torch.bfloat16:
            raise UserError(f"--moments-precision bfloat16 needs bfloat16 hidden states; layer {layer}'s are "
                            f"{str(h.dtype).removeprefix('torch.')}: use --moments-precision float32")
        dev = self._s1.device
        h, ok = h.to(dev), ok.to(dev)
        if self._bf16 and self._out_dtype is None:  # decided once, on the caller's thread (warnings)
            self._out_dtype = self._tensor_cores and _mm_out_dtype(h.device)
            if self._tensor_cores and not self._out_dtype:
                slow_path(self.paths, "moments", "bfloat16 (float32 products: no mm out_dtype)",
                          f"--moments-precision bfloat16: this torch {torch.__version__} has no torch.mm(..., "
                          f"out_dtype=float32) on {h.device}; the products run in float32 (~10x slower)")
        given = (s.to(dev), n.to(dev)) if s is not None and n is not None and self._bf16 else None
        if self._worker is None:
            self._add(layer, h, ok, given)
        else:  # h and ok are this batch's own tensors: nothing else writes them
            self._worker.submit(self._add, layer, h, ok, given, nbytes=h.numel() * h.element_size())

    def _add(self, layer: int, h: torch.Tensor, ok: torch.Tensor, given=None) -> None:
        if self._bf16:
            return self._add_bf16(layer, h, ok, given)
        n = ok.sum()
        self._n[layer] += n
        M, d = h.shape
        self._rows[layer] += M
        buf = self._bufs[layer % 2]
        if buf.numel() < M * d:
            buf = self._bufs[layer % 2] = torch.empty(M * d, dtype=self._dtype, device=h.device)
        # x: the rows in chunks, each contiguous in `buf` — oneDNN's: ≤ CHUNK rows transposed,
        # (d, rows); MKL's on a CPU: ≤ CHUNK rows as they are, (rows, d); elsewhere all M rows, (M, d)
        T = self._nt is not None
        step = self.CHUNK if self._chunked else max(M, 1)
        x = []
        s = torch.zeros(d, dtype=torch.float64, device=h.device)
        for a in range(0, M, step):
            b = min(a + step, M)
            xc = buf[a * d: b * d].view((d, b - a) if T else (b - a, d))
            xc.copy_(h[a:b].T if T else h[a:b])  # exact (float32/bf16 into float32, anything into float64)
            s += xc.sum(1 if T else 0, dtype=torch.float64)  # Σh, float64 accumulation
            x.append(xc)
        self._s1[layer] += s
        if self._shifted:
            if not self._c_set[layer]:  # the first batch's mean, on the device (no sync)
                self._c[layer] = (s / n.clamp(min=1)).float()
                self._c_set[layer] = True
            c = self._c[layer].unsqueeze(1) if T else self._c[layer]
            for xc in x:
                xc.sub_(c)  # h − c in float32
        px = None
        if self._cross is not None and self._prev is not None and self._prev[0] == layer - 1:
            _, px, pok, ps = self._prev  # the previous layer's chunks: the other buffer, the same rows
            self._n_pair[layer - 1] += (pok & ok).sum()
            self._pair_rows[layer - 1] += M
            if self._shifted:
                self._pair_s[layer - 1, 0] += ps
                self._pair_s[layer - 1, 1] += s
        if self._cross is not None:
            self._prev = (layer, x, ok, s)
        S = self._s2[layer]
        for i, xc in enumerate(x):  # each chunk's products folded into the float64 sums
            if T:  # oneDNN on the transposed rows (d, rows)
                block = lambda a, b, xc=xc: self._nt(xc[a:b], xc[a:])  # noqa: E731
            else:  # torch on the rows as they are (rows, d); MKL reads them transposed in place
                block = lambda a, b, xc=xc: xc[:, a:b].T @ xc[:, a:]  # noqa: E731
            # a CPU's chunks: 2 panels (smaller products run slower there); one product per batch: 4
            _add_gram_upper(S, block, 2 if self._chunked else 4)
            if px is not None:  # Σ (h_l − c_l)(h_{l+1} − c_{l+1})ᵀ
                self._cross[layer - 1] += self._nt(px[i], xc) if T else (px[i].T @ xc).to(torch.float64)

    def _add_bf16(self, layer: int, h: torch.Tensor, ok: torch.Tensor, given=None) -> None:
        """precision "bfloat16": products of bf16 rows, every one exact in float32; float32
        accumulation over ≤ CHUNK_BF16 rows per product (tensor cores on a GPU), each product added
        into the float64 sums.  How the rows go in is decided per layer at its first batch, from
        that batch's ‖μ‖²/tr C (one host read per layer, once):

        * ≤ SPLIT_RATIO: the raw rows as they are.  With cross moments, a layer's rows go to one half
          of an (M, 2d) buffer, the halves alternating by layer, so that its Gram matrix and the
          cross moment with the previous layer (the other half, the same rows) are one product:
          [h_prev | h]ᵀ h, (2d, d) — full, not the upper triangle; without, hᵀh of the rows.
        * above (a large mean: float32 sums of raw products lose the covariance, the error growing
          like ‖μ‖²/tr C): the rows centred on a bf16 centre c (the first batch's mean, rounded),
          x = h − c in float32 (exact: both have 8-bit significands), split into bf16 parts
          x = hi + lo (+ 2⁻¹⁸|x| at most), and Σ x xᵀ = Σ hiᵀhi + hiᵀlo + loᵀhi + loᵀlo as one
          product of 4× the rows; rows that are not ok are zeroed after centring, and the shift is
          undone in float64 when the sums are read (`s2`, `cross`).  Four times the multiply-adds,
          for that layer only; the error no longer grows with the mean."""
        M, d = h.shape
        s, n = given if given is not None else (h.sum(0, dtype=torch.float64), ok.sum())  # (d,) Σh, () rows ok
        self._n[layer] += n
        self._s1[layer] += s
        self._rows[layer] += M
        if self._split[layer] is None:
            self._decide(layer, h, s, n)
        parts = self._parts(layer, h, ok)  # bf16 (M, d) each: (h,) or (hi, lo)
        prev = self._prev if self._cross is not None else None
        paired = prev is not None and prev[0] == layer - 1 and prev[1] == M
        if paired:
            self._n_pair[layer - 1] += (prev[2] & ok).sum()
        raw = not self._split[layer] and (not paired or not self._split[layer - 1])
        if self._cross is None or not raw:
            if self._cross is not None:  # the previous layer's parts are kept for the cross moment
                if paired and raw is False:
                    both = (prev[2] & ok).unsqueeze(1)  # (M, 1) rows counted in both layers
                    self._pair_s[layer - 1, 0] += torch.where(both, prev[4], 0).sum(0, dtype=torch.float64)
                    self._pair_s[layer - 1, 1] += torch.where(both, h, 0).sum(0, dtype=torch.float64)
                self._prev = (layer, M, ok, parts, h)
            for a in range(0, M, self.CHUNK_BF16):
                P = [x[a: a + self.CHUNK_BF16] for x in parts]  # (k, d) each
                self._s2[layer] += self._gram(P, P)
                if paired:
                    self._cross[layer - 1] += self._gram([x[a: a + self.CHUNK_BF16] for x in prev[3]], P)
            if self._cross is not None:  # a later raw layer pairs with this one through the buffer
                self._pair_fill(layer, h)
            return
        # raw rows (this layer and the previous one): the pair buffer, one product per chunk
        buf, cur, half = self._pair_fill(layer, h)
        paired = paired and self._pair_ok
        self._prev = (layer, M, ok, parts, h)
        for a in range(0, M, self.CHUNK_BF16):
            rows = buf[a: a + self.CHUNK_BF16]  # (k, 2d)
            if paired:  # rows of [Σ h_prev hᵀ ; Σ h hᵀ] or the reverse, by which half is which
                P = _mm_bf16(rows.T, rows[:, cur], self._out_dtype)  # (2d, d) float32
                self._s2[layer] += P[cur]
                self._cross[layer - 1] += P[(1 - half) * d: (2 - half) * d]
            else:
                x = rows[:, cur]
                self._s2[layer] += _mm_bf16(x.T, x, self._out_dtype)  # (d, d)

    SPLIT_RATIO = 1.0  # ‖μ‖²/tr C above which a layer's bf16 rows are centred and split (see _add_bf16)

    def _decide(self, layer: int, h: torch.Tensor, s: torch.Tensor, n: torch.Tensor) -> None:
        """A layer's first batch: raw or centred-and-split rows, from its ‖μ‖²/tr C (one host read)."""
        k = n.clamp(min=1).double()
        mu = s / k  # (d,)
        q = h.double().square().sum() / k  # mean ‖h‖² over the counted rows (zeroed rows add nothing)
        mu2 = mu.square().sum()
        ratio = float(mu2 / (q - mu2).clamp_min(1e-300))
        self._ratio[layer] = ratio
        self._split[layer] = ratio > self.SPLIT_RATIO
        if self._split[layer]:
            self._c[layer] = mu.to(torch.bfloat16).float()  # a bf16 value: h − c is exact in float32
            split = [i for i, x in enumerate(self._split) if x]
            self.paths["moments_rows"] = f"centred hi+lo in layers {split} (|mu|^2/tr C > {self.SPLIT_RATIO:g}), raw elsewhere"

    def _parts(self, layer: int, h: torch.Tensor, ok: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if not self._split[layer]:
            return (h,)
        x = torch.where(ok.unsqueeze(1), h.float() - self._c[layer], 0.0)  # (M, d) float32, exact
        hi = x.to(torch.bfloat16)
        lo = (x - hi.float()).to(torch.bfloat16)  # x − hi exact in float32; |lo| ≤ 2⁻⁹|x|
        return hi, lo

    def _gram(self, A: list[torch.Tensor], B: list[torch.Tensor]) -> torch.Tensor:
        """Σ_{p, q} A_pᵀ B_q, (d, d) float32, as one product over the parts stacked along the rows."""
        if len(A) == 1 and len(B) == 1:
            return _mm_bf16(A[0].T, B[0], self._out_dtype)
        left = torch.cat([a for a in A for _ in B])  # (|A||B| k, d)
        right = torch.cat([b for _ in A for b in B])
        return _mm_bf16(left.T, right, self._out_dtype)

    def _pair_fill(self, layer: int, h: torch.Tensor):
        """The layer's raw rows into its half of the pair buffer; returns (buffer rows, its half's
        columns, the half).  `_pair_ok`: whether the other half holds the previous layer's rows."""
        M, d = h.shape
        if self._pair.shape[0] < M or self._pair.shape[1] != 2 * d:
            self._pair = torch.empty(M, 2 * d, dtype=torch.bfloat16, device=h.device)
            self._pair_rows_of = [None, None]  # the previous layer's rows were not kept
        half = layer % 2
        cur = slice(half * d, (half + 1) * d)
        buf = self._pair[:M]
        buf[:, cur] = h  # exact copy
        self._pair_ok = self._pair_rows_of[1 - half] == (layer - 1, M)
        self._pair_rows_of[half] = (layer, M)
        return buf, cur, half

    def finish(self) -> None:
        """Wait for the queued work (re-raising its error); the sums are complete after."""
        if self._worker is not None:
            self._worker.wait()

    def close(self) -> None:
        """Stop the background thread (always call; idempotent)."""
        if self._worker is not None:
            self._worker.close()

    def s2(self, layer: int) -> np.ndarray:
        """Σhhᵀ of a layer, (d, d) float64."""
        self.finish()
        S = self._s2[layer].triu()
        S = S + S.triu(1).T
        if self._shifted:
            c, s = self._c[layer].double(), self._s1[layer]
            S = S + torch.outer(c, s) + torch.outer(s, c) - self._rows[layer] * torch.outer(c, c)
        elif self._bf16 and self._split[layer]:  # centred rows, zeroed where not ok: n rows of −c fewer
            c, s = self._c[layer].double(), self._s1[layer]
            S = S + torch.outer(c, s) + torch.outer(s, c) - self._n[layer].double() * torch.outer(c, c)
        return S.cpu().numpy()

    def cross(self, layer: int) -> np.ndarray:
        """Σ h_l h_{l+1}ᵀ over the tokens counted in layers `layer` and `layer` + 1, (d, d) float64."""
        self.finish()
        C = self._cross[layer]
        if self._shifted:
            a, b = self._c[layer].double(), self._c[layer + 1].double()
            sa, sb = self._pair_s[layer, 0], self._pair_s[layer, 1]
            C = C + torch.outer(sa, b) + torch.outer(a, sb) - self._pair_rows[layer] * torch.outer(a, b)
        elif self._bf16 and (self._split[layer] or self._split[layer + 1]):  # over the rows counted in both
            a, b = self._c[layer].double(), self._c[layer + 1].double()  # 0 for a raw layer
            sa, sb = self._pair_s[layer, 0], self._pair_s[layer, 1]
            C = C + torch.outer(sa, b) + torch.outer(a, sb) - self._n_pair[layer].double() * torch.outer(a, b)
        return C.cpu().numpy()


class _SideStream:
    """The `_Worker` interface on a CUDA side stream: each call is queued on the side stream after
    the work the current stream has queued so far (so it sees the layer's hidden states), and runs
    while the forward's next kernels run — no host synchronisation; `wait` makes the current stream
    wait for it.  The inputs are marked as used by the side stream (`record_stream`), so the
    caching allocator does not hand their memory out before the side stream is done with them."""

    def __init__(self, device: torch.device):
        self._stream = torch.cuda.Stream(device)
        self.peak_bytes = 0

    def submit(self, fn, *args, nbytes: int = 0) -> None:
        main = torch.cuda.current_stream(self._stream.device)
        self._stream.wait_stream(main)
        with torch.cuda.stream(self._stream):
            fn(*args)
        for a in args:  # tensors given directly or in a tuple (a batch's indices)
            for t in (a if isinstance(a, tuple) else (a,)):
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    t.record_stream(self._stream)

    def wait(self) -> None:
        torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)

    def close(self) -> None:
        self.wait()


class _Worker:
    """One background thread that runs submitted calls in order, so the sums are added in the same
    order as inline (bit-identical results).  The queued calls' tensors (`nbytes` each) stay under
    `max_bytes` — the caller blocks beyond, but a call always fits into an empty queue: memory
    stays bounded whatever the batch and model; the first error is re-raised by the next `submit`
    or `wait`.  torch releases the GIL inside its kernels, so the products run while
    the main thread drives the model.  The thread (and the OpenMP threads it starts, which inherit
    it) runs at the lowest priority, nice 19: on a CPU the forward keeps its cores and the products
    take what it leaves idle (Python between kernels, tokenising, single-threaded ops) — until the
    queue is full and the main thread waits for them.  Measured: docs/views-guide.md, "Moments by default"."""

    NICE = 19

    def __init__(self, max_bytes: int):
        self._q: queue.Queue = queue.Queue()  # bounded by bytes, below
        self._max_bytes = max_bytes
        self._pending = 0  # bytes of the queued calls' tensors
        self.peak_bytes = 0
        self._room = threading.Condition()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def _loop(self) -> None:
        try:  # Linux: niceness is per thread (elsewhere this may fail: then the normal priority)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.NICE)
        except (AttributeError, OSError):
            pass
        with torch.inference_mode():
            while True:
                item = self._q.get()
                if item is None:
                    self._q.task_done()
                    return
                fn, args, nbytes = item
                item = None
                try:
                    if self._error is None:
                        fn(*args)
                except BaseException as e:  # noqa: BLE001 — handed to the submitting thread
                    self._error = e
                finally:
                    args = None  # the rows are freed before room is made for more
                    with self._room:
                        self._pending -= nbytes
                        self._room.notify_all()
                    self._q.task_done()

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def submit(self, fn, *args, nbytes: int = 0) -> None:
        self._check()
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="moments", daemon=True)
            self._thread.start()
        with self._room:
            while self._pending > 0 and self._pending + nbytes > self._max_bytes:
                self._room.wait()
            self._pending += nbytes
            self.peak_bytes = max(self.peak_bytes, self._pending)
        self._q.put((fn, args, nbytes))

    def wait(self) -> None:
        if self._thread is not None:
            self._q.join()
        self._check()

    def close(self) -> None:
        if self._thread is not None:
            self._q.put(None)
            self._thread.join()
            self._thread = None


class Sample:
    """A bottom-k sample of K token vectors per layer: the K counted positions with the smallest
    position keys (a hash of source, document and position).  The union of two samples' bottom-k
    is the bottom-k of the union, so shards and sources merge into the sample one run would draw."""

    def __init__(self, n_layers: int, k: int, d: int):
        self.k = k
        self.keys = torch.empty(0, dtype=torch.int64)  # (S,) kept keys, ascending
        self.meta = torch.empty(0, 3, dtype=torch.int64)  # (S, 3): document, position, token id
        self.vecs = [torch.empty(0, d, dtype=torch.float32) for _ in range(n_layers)]
        self._plan = None

    def set_batch(self, keys: torch.Tensor, meta: torch.Tensor) -> None:
        """keys: (M,) int64 position keys of the batch's counted positions; meta: (M, 3)."""
        keys, meta = keys.cpu(), meta.cpu()
        allk = torch.cat([self.keys, keys])
        order = torch.argsort(allk)[: self.k]  # bottom-k of old ∪ new
        order = order[torch.argsort(allk[order])]
        old = order[order < len(self.keys)]
        new = order[order >= len(self.keys)] - len(self.keys)
        self.keys = torch.cat([self.keys[old], keys[new]])
        self.meta = torch.cat([self.meta[old], meta[new]])
        resort = torch.argsort(self.keys)
        self.keys, self.meta = self.keys[resort], self.meta[resort]
        self._plan = (old, new, resort)

    def add(self, layer: int, x: torch.Tensor) -> None:
        """x: (M, d) raw vectors, rows in the order of the keys given to set_batch."""
        old, new, resort = self._plan
        self.vecs[layer] = torch.cat([self.vecs[layer][old], x[new.to(x.device)].float().cpu()])[resort]


# ---------------------------------------------------------------- the token sums' tiers


def _check_budget(budget, slot_bytes: int, what: str) -> None:
    if budget is None:
        return
    if not isinstance(budget, int) or isinstance(budget, bool):
        raise UserError(f"{what} {budget!r}: expected a number of bytes")
    if budget < slot_bytes:
        raise UserError(f"{what} {budget} bytes is below one token type's {slot_bytes} bytes")


def default_host_budget() -> int:
    """The host tier's default budget: half of the host memory free now."""
    from .memory import available_memory
    return available_memory(torch.device("cpu")) // 2


class _SlotTable:
    """A float64 slot table of token sums on one device: sums[layer] (capacity, d), counts[layer]
    (capacity,), the maps token → slot (V,) and slot → token (capacity,) on the host, and the free
    slots (evicted, reused first).  It grows ×1.25 within `budget`; when full, `admit` evicts the
    least-counted EVICT of the resident types (by `freq`, the occurrences seen over the stream)."""

    EVICT = 0.25  # share of the resident types evicted when the table is full

    def __init__(self, n_layers: int, vocab: int, d: int, device, budget: int | None, freq: np.ndarray):
        self.L, self.V, self.d = n_layers, vocab, d
        self.device = torch.device(device)
        self.budget = budget
        self.freq = freq
        self.slot_of = np.full(vocab, -1, dtype=np.int64)  # (V,) token → slot
        self.peak_bytes = 0
        self.reset()

    def reset(self) -> None:
        """Empty and release the table (nothing may be resident)."""
        self.tokens = np.empty(0, dtype=np.int64)  # (capacity,) slot → token, −1 where free
        self.used = 0  # slots handed out so far (high-water mark); free ones below it are in `free`
        self.free = np.empty(0, dtype=np.int64)
        self.sums = [torch.zeros(0, self.d, dtype=torch.float64, device=self.device) for _ in range(self.L)]
        self.counts = [torch.zeros(0, dtype=torch.int64, device=self.device) for _ in range(self.L)]

    @property
    def capacity(self) -> int:
        return len(self.tokens)

    @property
    def resident(self) -> int:
        return self.used - len(self.free)

    def table_bytes(self) -> int:
        return self.capacity * (self.L * (8 * self.d + 8) + 8)

    def occupied(self) -> np.ndarray:
        return np.flatnonzero(self.tokens[: self.used] >= 0)

    def grow(self, need: int) -> bool:
        """Make room for `need` slots (as far as the budget allows); whether they fit."""
        cap = self.capacity
        if need <= cap:
            return True
        new = min(max(cap + cap // 4, need, 1024), self.V)
        row = 8 * self.d + 8
        if self.budget is not None:
            # growing one layer at a time: the old and the new copy of the last layer coexist
            new = min(new, (self.budget - cap * row) // (self.L * row + 8))
        if new > cap:
            self.peak_bytes = max(self.peak_bytes, self.L * new * row + cap * row + 8 * new)  # ≥ table_bytes()
            for layer in range(self.L):
                grown = torch.zeros(new, self.d, dtype=torch.float64, device=self.device)
                grown[:cap] = self.sums[layer]
                self.sums[layer] = grown
                counts = torch.zeros(new, dtype=torch.int64, device=self.device)
                counts[:cap] = self.counts[layer]
                self.counts[layer] = counts
            self.tokens = np.concatenate([self.tokens, np.full(new - cap, -1, dtype=np.int64)])
        return new >= need

    def admit(self, ids: np.ndarray, evict) -> bool:
        """Give every token of `ids` (distinct) a slot; when the table is full, the least-counted
        half of the other resident types (at least as many as needed) is passed to `evict(slots)`
        (token-ascending) and released.  False (nothing changed) when `ids` alone do not fit."""
        new = ids[self.slot_of[ids] < 0]
        if not len(new):
            return True
        short = len(new) - len(self.free)
        if short > 0 and not self.grow(self.used + short):
            room = self.capacity - self.resident
            occupied = self.occupied()
            cand = occupied[~np.isin(self.tokens[occupied], ids)]
            need = len(new) - room
            if need > len(cand):
                return False
            k = min(max(need, int(self.EVICT * len(occupied))), len(cand))
            if k < len(cand):  # the k least counted (ties: the lower slot, deterministic)
                order = np.lexsort((cand, self.freq[self.tokens[cand]]))
                cand = cand[order[:k]]
            victims = cand[np.argsort(self.tokens[cand])]
            evict(victims)
            self.release(victims)
        k = min(len(new), len(self.free))
        slots = np.concatenate([self.free[:k], np.arange(self.used, self.used + len(new) - k)])
        self.free = self.free[k:]
        self.used += len(new) - k
        self.slot_of[new] = slots
        self.tokens[slots] = new
        return True

    def release(self, slots: np.ndarray) -> None:
        """Zero the rows at `slots` and make them free."""
        idx = torch.from_numpy(slots).to(self.device)
        for layer in range(self.L):
            self.sums[layer].index_fill_(0, idx, 0)
            self.counts[layer].index_fill_(0, idx, 0)
        self.slot_of[self.tokens[slots]] = -1
        self.tokens[slots] = -1
        self.free = np.concatenate([self.free, slots])

    def fetcher(self, slots: np.ndarray):
        """fetch(layer, a, b) → (counts (b−a,), rows (b−a, d)) of slots[a:b], on the host."""
        idx = torch.from_numpy(slots).to(self.device)

        def fetch(layer: int, a: int, b: int):
            return (self.counts[layer].index_select(0, idx[a:b]).cpu().numpy(),
                    self.sums[layer].index_select(0, idx[a:b]).cpu().numpy())
        return fetch

    def source(self) -> "_TableSource":
        occupied = self.occupied()
        order = np.argsort(self.tokens[occupied], kind="stable")
        return _TableSource(self.tokens[occupied][order], self.fetcher(occupied[order]))


class _TableSource:
    """A slot table's rows in token order, for merging: ids (n,) ascending, read(layer, i, j)."""

    def __init__(self, ids: np.ndarray, fetch):
        self.ids, self.read = ids, fetch

    def close(self) -> None:
        pass


class _Run:
    """One run on disk: tokens.npy (n,) ascending; per layer counts{l}.npy (n,) and sums{l}.f64,
    (n, d) float64 raw rows, read by explicit ranges (no memory map: RSS stays bounded)."""

    def __init__(self, path: Path, ids: np.ndarray, spill: "_Spill"):
        self.path, self.ids, self._spill = path, ids, spill
        self._layer, self._f, self._counts = None, None, None

    def read(self, layer: int, i: int, j: int) -> tuple[np.ndarray, np.ndarray]:
        if self._layer != layer:
            self.close()
            self._counts = np.load(self.path / f"counts{layer}.npy")
            self._f = open(self.path / f"sums{layer}.f64", "rb")
            self._layer = layer
        d = self._spill.d
        self._f.seek(i * 8 * d)
        rows = np.fromfile(self._f, dtype=np.float64, count=(j - i) * d).reshape(j - i, d)
        self._spill.bytes_read += rows.nbytes + 8 * (j - i)
        return self._counts[i:j], rows

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
        self._layer, self._f, self._counts = None, None, None


def _union(ids: list[np.ndarray]) -> np.ndarray:
    return np.unique(np.concatenate(ids)) if ids else np.empty(0, dtype=np.int64)


def _merge_chunk(sources: list, layer: int, ids: np.ndarray, d: int) -> tuple[np.ndarray, np.ndarray]:
    """Counts (m,) and Σû (m, d) float64 of the sorted token ids `ids` (a contiguous piece of the
    sources' union), the sources' rows added in the order given."""
    S = np.zeros((len(ids), d), dtype=np.float64)
    n = np.zeros(len(ids), dtype=np.int64)
    if not len(ids):
        return n, S
    for src in sources:
        i, j = np.searchsorted(src.ids, [ids[0], ids[-1] + 1])
        if j > i:
            pos = np.searchsorted(ids, src.ids[i:j])
            c, rows = src.read(layer, i, j)
            S[pos] += rows
            n[pos] += c
    return n, S


class _Spill:
    """The disk tier: runs of token-sorted float64 rows in a private directory under `root` (the
    system's temp dir by default), merged as they accumulate: when the runs after the first (the
    base) hold ≥ RATIO × its rows, all are merged into a new base in one k-way pass (the rows of a
    token added in run order, oldest first), so a merge writes ≤ (1 + 1/RATIO) × the rows it
    consumes beyond the base, and bytes written ≤ (2 + 1/RATIO) × bytes evicted.

    Interrupted runs leave no garbage for long: a run is written under a temporary name and renamed
    (fault point `spill` between its layers); the directory holds a `lock` file the process keeps
    flock'ed, and the next accumulator that spills under the same root removes the directories whose
    lock nobody holds (their process is dead: the kernel drops a flock with its holder)."""

    PREFIX = "isotropy-spill-"
    RATIO = 2  # merge when the runs after the base hold RATIO × its rows

    def __init__(self, n_layers: int, d: int, root: str | Path | None):
        self.L, self.d = n_layers, d
        self.root = root
        self.chunk = max(256, (16 << 20) // (8 * d))  # rows per read/write: 16 MiB
        self.dir: Path | None = None
        self._lock = None
        self.runs: list[_Run] = []
        self.evictions = 0
        self.bytes_written = 0  # all runs: evicted and merged
        self.bytes_evicted = 0  # the eviction runs alone (E)
        self.bytes_read = 0
        self._seq = 0

    def _directory(self) -> Path:
        if self.dir is None:
            root = Path(self.root) if self.root is not None else Path(tempfile.gettempdir())
            try:
                root.mkdir(parents=True, exist_ok=True)
                remove_orphans(root)
                new = Path(tempfile.mkdtemp(prefix="." + self.PREFIX, dir=root))
            except OSError as e:  # a file, a read-only or full disk: one line, not "[Errno 17] File exists"
                raise UserError(f"spilling token sums: --spill-dir {root}: {e.strerror or e}; choose another "
                                f"--spill-dir or raise --memory-budget") from e
            self._lock = open(new / "lock", "w")
            if fcntl is not None:
                fcntl.flock(self._lock, fcntl.LOCK_EX)
            self.dir = new.rename(root / new.name[1:])  # visible to the sweep only once locked
        return self.dir

    def write(self, ids: np.ndarray, fetch, evicted: bool = True) -> None:
        """A run of the token ids (n,) ascending and their rows, fetch(layer, a, b) → (counts, rows)."""
        path = self._directory() / f"{self._seq:05d}"
        self._seq += 1
        tmp = path.with_name(path.name + ".tmp")
        try:
            tmp.mkdir()
            np.save(tmp / "tokens.npy", ids)
            for layer in range(self.L):
                counts = []
                with open(tmp / f"sums{layer}.f64", "wb") as f:
                    for a in range(0, len(ids), self.chunk):
                        c, rows = fetch(layer, a, min(a + self.chunk, len(ids)))
                        f.write(np.ascontiguousarray(rows, dtype=np.float64).tobytes())
                        counts.append(c)
                np.save(tmp / f"counts{layer}.npy", np.concatenate(counts) if counts else np.empty(0, np.int64))
                faults.hit("spill")
        except OSError as e:  # a full or unwritable disk: one line (the directory goes at close)
            raise UserError(f"spilling token sums to {self.dir}: {e.strerror or e}; free space there, "
                            f"choose another --spill-dir or raise --memory-budget") from e
        written = sum(p.stat().st_size for p in tmp.iterdir())
        self.bytes_written += written
        tmp.rename(path)
        self.runs.append(_Run(path, ids, self))
        if evicted:
            self.evictions += 1
            self.bytes_evicted += written
            self._merge()

    def _merge(self) -> None:
        if len(self.runs) < 2 or sum(len(r.ids) for r in self.runs[1:]) < self.RATIO * len(self.runs[0].ids):
            return
        runs, self.runs = self.runs, []
        union = _union([r.ids for r in runs])
        try:
            self.write(union, lambda layer, a, b: _merge_chunk(runs, layer, union[a:b], self.d), evicted=False)
        finally:
            for r in runs:
                r.close()
        for r in runs:
            shutil.rmtree(r.path)

    def close(self) -> None:
        for r in self.runs:
            r.close()
        self.runs = []
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
        if self._lock is not None:
            self._lock.close()
            self._lock = None


HIDDEN_GRACE_S = 600  # a hidden spill directory this old whose lock nobody holds (or has none) is garbage


def remove_orphans(root: Path, now: float | None = None) -> list[Path]:
    """Remove the spill directories under `root` whose lock no process holds (left by a killed
    run); returns them.  A directory whose lock file cannot be opened is kept (not provably garbage) —
    except a hidden one (`.isotropy-spill-*`: a run killed between creating it and locking it, a few
    microseconds) older than HIDDEN_GRACE_S: no live run leaves one unlocked that long."""
    removed = []
    if fcntl is None:
        return removed
    now = time.time() if now is None else now
    for d in [*root.glob(_Spill.PREFIX + "*"), *root.glob("." + _Spill.PREFIX + "*")]:
        hidden = d.name.startswith(".")
        try:
            if hidden and now - d.stat().st_mtime < HIDDEN_GRACE_S:
                continue
            if hidden and not (d / "lock").exists():
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d)
                continue
            with open(d / "lock", "r+") as f:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d)
        except OSError:  # held by a live process, or no lock file
            continue
    return removed
