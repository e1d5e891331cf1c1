"""The token sums: per (layer, token type) Σû of the unit vectors and their count, in float64, in
memory that grows with what the corpus touches and stays under a budget — plus the per-layer sums
of the same pass (Σh, Σû², the window sums) and the hook for the optional consumers of the rows
(the moments, the per-window measures, the sample).

**Sparse.**  A token type gets a slot the first time a batch counts it (tables.py); memory is
(L + 2) · U · (8d + 8) bytes for U token types seen (a dense table would need (L + 2) · V · 8d
whatever the corpus).  The map token → slot lives on the host, so the hot path has no host sync on
a GPU.  Under a budget, rows are evicted down the tiers device table → host table → disk runs
(tables.py, spill.py); `layer_rows` merges them back per token-id range, reading each spilled byte
once.

**The hot path** (`add`, per layer and batch) takes one of four forms, the same sums: on a GPU
fused.py's Triton kernels (every per-layer sum of the default pass), else (--sequences, $ISO_TRITON
off, or where Triton fails) the compiled `layer_step` (kernels.py); on a CPU `_add_chunked`: float32
rows in one compiled pass (cpu_kernels.py, Numba; the same float64 sums to ~1e-16 per addition),
others CHUNK rows at a time on one float64 copy of each chunk (chunk_sums.py: bit-identical to the
general path, less memory traffic); else the general eager path (a GPU without the compiler,
`--sample`, or an accumulator on another device than the model, where a per-batch partial over the
batch's distinct tokens is summed on the model's device first and folded in).

**Exactness.**  Sums are split, never rounded: a type's final sum is its partial sums added in
float64, oldest tier first (disk runs in the order written and merged, then the host tier, then the
device table); a type never evicted is bit-identical to the unbudgeted run, others equal it up to
the order of float64 additions (~1e-16 relative per addition).  Identical vectors give an
Intra-Sim of 1 to ~1e-12.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from common.errors import UserError

from . import cpu_kernels, fused as fused_kernels
from .kernels import change_norms, change_sums, compiled_layer_step, reused, run_compiled, unit_means, window_sums
from .chunk_sums import chunk_sums
from .crew import Task
from .by_type import EmbeddingRows
from .moments import Moments
from .paths import first_line, slow_path
from .sample import Sample
from .spill import Spill, merge_chunk, union_ids
from .tables import SlotTable, check_budget, default_host_budget


class TokenSums:
    """sums[layer][slot] = Σ û (float64), counts[layer, slot] = n, for the token types seen."""

    def __init__(self, n_layers: int, vocab: int, d: int, device: torch.device | str,
                 master_device: torch.device | str | None = None, fold_partials: bool | None = None,
                 budget: int | None = None, spill_dir: str | Path | None = None, fused: bool | None = None,
                 host_budget: int | str | None = "auto", triton: bool | None = None):
        self.L, self.V, self.d = n_layers, vocab, d
        self.device = torch.device(device)
        self.master = torch.device(master_device or device)
        self.fold_partials = self.master != self.device if fold_partials is None else fold_partials
        self.host_sync_free = self.device.type == "cpu"  # a sync costs nothing on the CPU
        self.slot_bytes = n_layers * (8 * d + 8) + 8  # per token type: L float64 rows, L counts, its id
        check_budget(budget, self.slot_bytes, "--memory-budget")
        self.freq = np.zeros(vocab, dtype=np.int64)  # (V,) occurrences seen so far per type: who stays resident
        self.table = SlotTable(n_layers, vocab, d, self.master, budget, self.freq)
        if host_budget == "auto":  # a GPU table: the host's RAM before the disk
            host_budget = default_host_budget() if self.master.type == "cuda" else None
        check_budget(host_budget, self.slot_bytes, "the host tier's budget")
        self.host = None if host_budget is None else SlotTable(n_layers, vocab, d, "cpu", host_budget, self.freq)
        self.disk = Spill(n_layers, d, spill_dir)
        self._staging = None  # pinned (when CUDA) buffers for device → host copies
        self.nonfinite = torch.zeros(n_layers, dtype=torch.int64, device=self.device)
        self.zero = torch.zeros(n_layers, dtype=torch.int64, device=self.device)
        # Per layer, over every counted vector (float64, on the device: no sync):
        self.sum_h = torch.zeros(n_layers, d, dtype=torch.float64, device=self.device)  # Σh (raw)
        self.sum_u2 = torch.zeros(n_layers, d, dtype=torch.float64, device=self.device)  # Σ û_i² per dim
        self.windows = torch.zeros(n_layers, dtype=torch.int64, device=self.device)  # windows with ≥ 2 vectors
        self.window_cos = torch.zeros(n_layers, dtype=torch.float64, device=self.device)  # Σ_w mean cos(h, m_w)
        # windows with ≥ 1 vector, Σ_w ū_w and Σ_w ‖ū_w‖² of their mean unit vectors ū_w (`unit_means`)
        self.unit_windows = torch.zeros(n_layers, dtype=torch.int64, device=self.device)
        self.sum_ubar = torch.zeros(n_layers, d, dtype=torch.float64, device=self.device)
        self.sum_ubar_sq = torch.zeros(n_layers, dtype=torch.float64, device=self.device)
        # at index l, from layer l to l + 1 over the vectors counted at both (`change_sums`): their number,
        # Σ cos and Σ angle/π (the last index stays 0: no layer after it)
        self.change_n = torch.zeros(n_layers, dtype=torch.int64, device=self.device)
        self.change_cos = torch.zeros(n_layers, dtype=torch.float64, device=self.device)
        self.change_angle = torch.zeros(n_layers, dtype=torch.float64, device=self.device)
        self._prev = None  # (layer, its rows, their 1/‖h‖) of the batch's last layer added (`_prev_rows`)
        self._chunk_bufs = [None, None]  # the eager CPU path's float64 chunk buffers (`chunk_sums`)
        self._rows_kernel = None  # the compiled token sums (`_compiled_rows`)
        self._row_bufs = [None, None]  # the CPU path's gathered rows, layers alternating (`_gather`)
        self._batch = None
        self._ids = None  # (M,) int64 the batch's counted token ids (`set_batch`), for layer 0 by type
        self._nxt = None  # (B·T,) the positions' next counted positions (`set_batch`, compiled step with `extra`)
        # On a GPU, a few compiled kernels per layer (norm; scale + scatter-add; per-window
        # reductions) instead of ~15 eager ones, the float64 û never written to memory: `layer_step`.
        use = self.device.type == "cuda" and not self.fold_partials if fused is None else fused
        self._fused = compiled_layer_step() if use else None
        self._compiled_once = False
        # On a GPU, without --sequences or --sample: the Triton kernels of fused.py before the compiled
        # step (`triton=True` on a CPU: the same kernels in Triton's interpreter, for tests)
        if triton is None:
            triton = use and self.device.type == "cuda" and fused_kernels.enabled()
        self._triton = bool(triton) and fused_kernels.available()
        self._triton_once = False
        self._plan = None
        # the code paths this run takes (recorded with the run; a slower one also warns once, one line);
        # the token sums are added by atomic scatter-adds on every path
        self.paths: dict[str, str] = {"layer_step": "triton" if self._triton else "compiled" if use else "eager",
                                      "scatter": "segmented" if self._triton else "atomic"}
        self.moments: Moments | None = None  # optional consumers of the raw (unnormalised) vectors
        self.sample: Sample | None = None
        self.extra = None  # optional WindowMeasures (extract/sequences.py)
        self.attention = None  # optional AttentionSums (attention.py), fed by the attention capture
        self.layer0: EmbeddingRows | None = None  # the input embedding's rows: layer 0's moments by type (by_type.py)

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

    def layer_sums(self) -> list[str]:
        """The names of the per-layer sums this accumulator adds to besides the token table: its public
        tensors with one entry per layer (`nonfinite`, `sum_h`, …)."""
        return sorted(k for k, v in vars(self).items() if not k.startswith("_") and isinstance(v, torch.Tensor)
                      and v.dim() >= 1 and v.shape[0] == self.L)

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
        self._ids = torch.from_numpy(ids)
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
        if not self.fold_partials:
            self._batch = (sel, self._h2d(slots), None)
        else:  # fold a per-batch partial over the batch's distinct tokens into the remote master
            uniq, inv = np.unique(slots, return_inverse=True)  # (U,), (M,)
            self._batch = (sel, self._h2d(inv.reshape(-1)),
                           torch.from_numpy(uniq).to(self.master))
        self._ones = torch.ones(len(ids), dtype=torch.int64, device=self.device)
        self._rows_counted = len(ids)
        if self._triton and (lacking := sorted(set(self.layer_sums()) - fused_kernels.FILLS)):
            # sums the kernels do not add: the compiled step (else eager), which adds every one (recorded,
            # no warning: it is the path such an accumulator always takes)
            step = "compiled" if self._fused is not None else "eager"
            self.paths.update(layer_step=f"{step} (triton kernels lack {', '.join(lacking)})", scatter="atomic")
            self._triton = False
        self._plan = (fused_kernels.plan(sel_np, slots, B, T, self.L, self._h2d)
                      if self._triton and not self.fold_partials else None)
        self._prev = None
        return len(ids)

    def add(self, layer: int, hidden: torch.Tensor) -> None:
        """hidden: (B, T, d) in any float dtype."""
        sel, index, uniq = self._batch
        d = hidden.shape[-1]
        if self._rows_counted == 0:  # a batch with no counted position (only special tokens): nothing to add
            return
        if self._plan is not None and self.sample is None and self.extra is None:
            return self._add_triton(layer, hidden)
        if self._fused is not None and self.sample is None and uniq is None:
            prev = self._prev if self._prev is not None and self._prev[0] == layer - 1 else None
            if prev is not None and prev[1].dim() == 2:  # the eager path's rows (M, d): not the step's input
                prev = None
            try:
                stats = run_compiled(self._fused, self.sums[layer], self.counts[layer], index, hidden, sel,
                                      self._counted, self._nxt, *(prev[1:] if prev is not None else (None, None)))
            except Exception as e:  # no Triton / compiler here, or a recompile failed or hit the limit:
                # the eager path from here on, same sums (a compile fails before the step writes anything)
                why = "recompile" if self._compiled_once else "compile"
                slow_path(self.paths, "layer_step", f"eager ({why} failed: {type(e).__name__})",
                          f"torch.compile of the accumulation step: {why} failed ({type(e).__name__}: "
                          f"{first_line(e)}); using the eager path (slower, same sums)")
                self._fused = None
            else:
                self._compiled_once = True
                nonfinite, zero, ok_bt, *windows = stats
                windows, inv, change, terms = windows[:4], windows[4], windows[5:8], windows[8:]  # terms: `row_terms`
                self._keep(layer, hidden, inv)  # (B, T, d), (B, T): the next layer's `prev`
                if prev is not None:
                    self._add_change(layer - 1, *change)
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
        chunked = self.host_sync_free and uniq is None  # the CPU path
        h = self._gather(layer, hidden.reshape(-1, d), sel, chunked)  # (M, d) compute dtype
        if self.sample is not None:
            self.sample.add(layer, h)
        if chunked:
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
        x = h * inv.unsqueeze(1)  # (M, d) float64 û (type promotion: exact upcast, float64 product)
        prev = self._prev_rows(layer, sel)
        if prev is not None:
            self._add_change(layer - 1, *change_sums(*change_norms(prev[0], prev[1], x), ok & (prev[1] > 0)))
        self._keep(layer, h, inv)
        m, u = window_sums(h, norm, x, counts, win, n_win, cols)
        if self.moments is not None:  # Σh from the window sums, as on the CPU path
            self.moments.add(layer, h, ok, s=m.sum(0), n=ok.sum())
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

    def _add_triton(self, layer: int, hidden: torch.Tensor) -> None:
        """The GPU path of `add` without --sequences or --sample: fused.py's kernels add the token sums,
        the layer's sums, window terms, the windows' mean unit vectors and the change from the previous
        layer in place, and hand the moments their rows, n and Σh."""
        one = slice(layer, layer + 1)
        prev = self._prev if self._prev is not None and self._prev[0] == layer - 1 else None
        change = None if prev is None else (prev[1], prev[2], *(t[layer - 1: layer] for t in (
            self.change_n, self.change_cos, self.change_angle)))
        try:
            out = fused_kernels.layer(self._plan, layer, hidden, self.sums[layer], self.counts[layer],
                                      self.sum_h[layer], self.sum_u2[layer], self.nonfinite[one], self.zero[one],
                                      self.windows[one], self.window_cos[one],
                                      (self.unit_windows[one], self.sum_ubar[layer], self.sum_ubar_sq[one]),
                                      rows=self.moments is not None, change=change)
        except Exception as e:  # noqa: BLE001 — a kernel that fails to compile fails before it writes
            if self._triton_once:
                raise
            slow_path(self.paths, "layer_step", f"compiled (triton kernels failed: {type(e).__name__})",
                      f"the Triton kernels of the accumulation step failed ({type(e).__name__}: {first_line(e)}); "
                      "using the compiled step (slower, same sums)")
            self.paths["scatter"] = "atomic"
            self._triton = False
            self._plan = None
            return self.add(layer, hidden)
        self._triton_once = True
        self._keep(layer, hidden, out.inv)  # (B, T, d) by reference, (B, T): the next layer's `change`
        if self.moments is not None:
            self.moments.add(layer, out.rows, out.ok, s=out.s, n=out.n)

    def _prev_rows(self, layer: int, sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The previous layer's counted rows (M, d) (excluded ones zero) and their 1/‖h‖ (M,) float64 (0
        where excluded) for the layer change to `layer`, or None (the batch's first layer).  Taken from
        the compiled step's (B, T, d) input where that step ran the previous layer (its fallback to
        the eager path in the middle of a batch)."""
        if self._prev is None or self._prev[0] != layer - 1:
            return None
        _, rows, inv = self._prev
        if rows.dim() == 3:  # the compiled step's hidden (B, T, d) and 1/‖h‖ (B, T)
            inv = inv.reshape(-1).index_select(0, sel)
            rows = rows.reshape(-1, rows.shape[-1]).index_select(0, sel).masked_fill(~(inv > 0).unsqueeze(1), 0)
        return rows, inv

    def _keep(self, layer: int, rows: torch.Tensor, inv: torch.Tensor) -> None:
        """Keep a layer's rows and their 1/‖h‖ for the next layer's change (nothing after the last layer:
        the rows are not held until the next batch).  The eager paths keep the rows they gathered (a
        copy); the compiled step keeps the model's own hidden states (B, T, d) by reference, which is
        right as long as the next layer does not write into its input in place (the residual additions
        of the families tested here are out of place; inference tensors carry no version counter that
        could check it)."""
        self._prev = (layer, rows, inv) if layer + 1 < self.L else None

    def _add_change(self, at: int, n: torch.Tensor, cos: torch.Tensor, angle: torch.Tensor) -> None:
        """Fold one batch's `change_sums` from layer `at` to `at` + 1 into index `at`."""
        self.change_n[at] += n
        self.change_cos[at] += cos
        self.change_angle[at] += angle

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
    # background thread, where its own pass is off the forward's thread
    WINDOW_TERMS: bool | None = None
    CHUNK = 512  # rows per step of the CPU path: its float64 temporaries (2 MiB at d 512) stay in cache

    def _gather(self, layer: int, flat: torch.Tensor, sel: torch.Tensor, reuse: bool) -> torch.Tensor:
        """The counted rows flat[sel], (M, d).  With `reuse` (the CPU path), where nothing queued on a
        background thread reads them later, into one of two reused buffers, layers alternating (the
        rows are read until the next layer's change, `_keep`): a fresh (M, d) tensor per layer is a
        fresh mapping of memory whose first writes fault page by page."""
        if not reuse or any(x is not None and x.worker is not None for x in (self.moments, self.extra)):
            return flat.index_select(0, sel)
        out = reused(self._row_bufs, layer % 2, (len(sel), flat.shape[1]), flat.dtype, flat.device)
        return torch.index_select(flat, 0, sel, out=out)

    def _add_chunked(self, layer: int, h: torch.Tensor, index: torch.Tensor) -> None:
        """The CPU path of `add`: the token sums (`_sums_rows`), then the moments and the per-window
        measures of the same rows, each given Σh and n from the token sums' window sums.  Where the
        moments have a crew (crew.py) the token sums run on it beside the moments' chunk copies and
        products (`Moments.begin`), while the forward waits.  h: (M, d) the counted rows, index: (M,)
        their slots."""
        moments = self.moments
        by_type = layer == 0 and self.layer0 is not None and moments is not None and moments.by_type and \
            self.layer0.match(h, self._ids)
        job = moments.begin(layer, h) if moments is not None and not by_type else None  # None: no crew, or not yet
        if job is None:
            h, ok, m, n_w, terms = self._sums_rows(layer, h, index)
            if by_type:  # the embedding's rows: counted by type, their products when the sums are read
                moments.add_by_type(layer, self.layer0.weight, self._ids, ok, s=m.sum(0), n=ok.sum())
            elif moments is not None:  # Σh from the window sums: the moments need not sum the rows again
                moments.add(layer, h, ok, s=m.sum(0), n=ok.sum())
        else:  # on the crew's threads: the same one-thread arithmetic whichever thread runs it
            out = []

            def token_sums():
                r = self._sums_rows(layer, h, index)
                out.append((*r, r[2].sum(0), r[1].sum()))  # ... and the moments' Σh and n

            # the copies first (every product waits for them), then the token sums beside the first products;
            # a crew with more helpers than the moments' tasks gives the rest to the token sums
            first = [t for t in job.tasks if not t.after]
            moments.crew.run([*first, Task(token_sums, threads=max(1, moments.crew.size - len(job.tasks))),
                              *(t for t in job.tasks if t.after)])
            h, ok, m, n_w, terms, s, n = out[0]
            moments.end(job, h, ok, s, n)
        if self.extra is not None:
            self.extra.add(layer, h, ok, m, n_w, terms=terms)

    def _sums_rows(self, layer: int, h: torch.Tensor, index: torch.Tensor) -> tuple:
        """The token sums of `_add_chunked`: the rows' sums (cpu_kernels.py's compiled pass over float32 rows,
        else chunk_sums.py's eager chunks), then the rest: rows left out counted and zeroed, the layer change,
        the rows kept for the next layer, the counts, the window statistics.  Returns the rows (zeroed where
        not ok), ok (M,), the window sums Σh (B, d) and counts (B,), and the per-window measures' row
        terms (or None)."""
        win, n_win, _, n_w = self._windows
        prev = self._prev_rows(layer, self._batch[0])
        if self._compiled_rows(h):
            m, u, u2, inv, ok, finite, change, terms = cpu_kernels.layer_sums(self._rows_kernel, h, index, win, n_win,
                                                                             self.sums[layer], prev)
        else:  # the eager chunks; with --sequences its `row_terms` from them (unless on the moments' background thread)
            fuse = self.extra is not None and (self.WINDOW_TERMS if self.WINDOW_TERMS is not None
                                               else self.extra.worker is None)
            m, u, u2, inv, ok, finite, change, terms = chunk_sums(h, index, win, n_win, self.sums[layer], prev,
                                                                  self.CHUNK, self._chunk_bufs, fuse)
        counts = self._ones
        if finite is not None:  # rows left out: counted, zeroed
            counts, n_w = self._exclude(layer, finite, ok, win, n_win)
            h = h.masked_fill(~ok.unsqueeze(1), 0)
        if change is not None:
            self._add_change(layer - 1, *change_sums(*change, ok & (prev[1] > 0)))
        self._keep(layer, h, inv)
        self.counts[layer].index_add_(0, index, counts)
        self._window_stats(layer, m, u, n_w, u2)
        return h, ok, m, n_w, terms

    def _compiled_rows(self, h: torch.Tensor) -> bool:
        """Whether these rows' token sums take cpu_kernels.py's compiled pass: float32 rows, no per-window
        terms to take from them (--sequences), the kernel there — decided once (recorded; its absence,
        unless $ISO_CPU_KERNELS=off asked for it, also said once in a warning)."""
        if h.dtype != torch.float32 or self.extra is not None:
            return False
        if "cpu_rows" not in self.paths:
            self._rows_kernel = cpu_kernels.kernel()
            why = cpu_kernels.uncached() if self._rows_kernel is not None else cpu_kernels.error()
            if self._rows_kernel is not None:
                self.paths["cpu_rows"] = "numba" if why is None else f"numba (compiled for this run: {why})"
            elif cpu_kernels.wanted():
                slow_path(self.paths, "cpu_rows", f"eager ({why})", f"the CPU's compiled token sums are not "
                          f"available ({why}); using the eager path (slower, same sums)")
            else:
                self.paths["cpu_rows"] = f"eager ({why})"
        return self._rows_kernel is not None

    def _window_stats(self, layer, m, u, n_w, u2) -> None:
        """Fold one batch's per-window sums m = Σh (B, d), u = Σû (B, d), n_w (B,) and Σû² (d,)."""
        self.sum_h[layer] += m.sum(0)
        self.sum_u2[layer] += u2
        windows, ubar, ubar_sq = unit_means(u, n_w)
        self.unit_windows[layer] += windows
        self.sum_ubar[layer] += ubar
        self.sum_ubar_sq[layer] += ubar_sq
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
        union = union_ids([s.ids for s in sources])
        try:
            for a in range(0, len(union), chunk_rows):
                ids = union[a: a + chunk_rows]
                n, S = merge_chunk(sources, layer, ids, self.d)
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
