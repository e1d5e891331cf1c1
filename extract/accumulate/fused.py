"""The token-sum pass of one layer on a GPU as four Triton kernels (`layer`), every float64 sum
formed in registers: no (M, d) float64 tensor, no float64 atomics on hot addresses, no eager
kernels between them (after them, for the layer change's angles, one atan2 and one sum over the
batch's positions).  On a CPU the same kernels run in Triton's interpreter (tests).

Per batch, on the host (`plan`): the counted positions sorted by their slot (a stable argsort), so
each token type's rows are one run; each position's row in the batch's counted rows (`dest`).
Per layer, over h (B, T, d) in its own dtype:

1. `norms_kernel` (per position, over d): ‖h‖ in float64 (squares of the stored values, exact), its
   inverse where the position is counted, finite and non-zero (else 0), and the layer's
   NaN/inf and zero vectors counted; from the batch's second layer on, a second loop over d (h's
   rows again, just read: from cache; the previous layer's rows a once) gives the layer change of
   kernels.py's `change_norms` — ‖û − a·(1/‖a‖)‖ and ‖û + a·(1/‖a‖)‖ of the float64 products, the
   latter √(4 − minus²) up to π/2 — and adds the pairs and Σ cos of the positions counted at both
   layers; each position's two norms are written (P,) for Σ θ/π = Σ 2·atan2(minus, plus)/π, one
   torch atan2 and sum after the kernels (Triton's interpreter has no atan2);
2. `windows_kernel` (per window and column block, over T): Σh, Σû, Σû² per window, the vectors counted
   per window, and — for the moments — the counted rows with the excluded ones zeroed, in h's dtype,
   and which are ok;
3. `slots_kernel` (per block of R slot-sorted rows and column block): û of each row, summed per run in
   registers (a segmented scan down the block, float64 adds; a float64 `tl.dot` does not compile for
   sm_90); a run that begins and ends inside the block is added to its slot's float64 sums and int64
   count with one plain read-modify-write (the block owns it); a run that crosses a block's edge (a
   frequent type) with one atomic add per block;
4. `epilogue_kernel` (per column block over windows, per block of windows over d): Σh and Σû² of the
   layer (also Σh and n for the moments), the windows' mean unit vectors ū = Σû / n (windows with
   ≥ 1 vector: their number, Σ_w ū, Σ_w ‖ū‖²), each window's mean cosine to its mean (windows with
   ≥ 2 vectors), and the counts of step 1, added into the layer's sums.

h is read three times from memory (steps 1–3; 3·B·T·d elements in its dtype, all streaming), the
previous layer's rows once (the layer change; h's own rows again from cache), and the moments' rows
written once; the token table is touched once per (distinct type, column) and row block.  The
previous layer's hidden states are kept by reference until the next layer's kernels have run.
The float64 sums are the eager path's to the order of additions (~1e-16 relative): the
float64 reference test is tests/test_gpu_path.py.  Sums of runs that cross blocks and of the window
cosines are atomic adds: their order, and so their last bits, vary from run to run (as the
compiled step's scatter-adds do): measured against the eager path, ≤ 6e-15 relative for Σ cos (a
sum of terms of both signs), ≤ 2e-15 for the others; the tests hold them to 1e-12.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import torch


ENV = "ISO_TRITON"  # off: the compiled step instead of these kernels on a GPU

# The per-layer sums of a `TokenSums` (`layer_sums`) these kernels add to, besides the token table (all
# of the default accumulator's): an accumulator that holds any other takes the compiled step instead
# (`TokenSums.set_batch`, recorded in its `paths`)
FILLS = frozenset({"nonfinite", "zero", "sum_h", "sum_u2", "windows", "window_cos", "unit_windows", "sum_ubar",
                   "sum_ubar_sq", "change_n", "change_cos", "change_angle"})


def enabled() -> bool:
    """Whether these kernels are wanted where they can run ($ISO_TRITON is not `off`) and can run."""
    return os.environ.get(ENV, "").strip().lower() != "off" and available()


def available() -> bool:
    """Whether Triton can be imported here."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class Plan:
    """One batch's layout for the kernels (device tensors, host sizes)."""
    B: int
    T: int
    M: int
    dest: torch.Tensor  # (B·T,) int64: each position's row among the counted rows, −1 if not counted
    order: torch.Tensor  # (M,) int64: the counted positions sorted by slot (stable)
    slots: torch.Tensor  # (M,) int64: their slots, ascending
    scratch: torch.Tensor  # (L, 3) int64 zeros: per layer NaN/inf vectors, zero vectors, vectors counted


def plan(sel: np.ndarray, slots: np.ndarray, B: int, T: int, n_layers: int, to_device) -> Plan:
    """The batch's `Plan` from the counted flat positions `sel` (M,) and their `slots` (M,);
    `to_device(array)` copies a host array to the device (asynchronously)."""
    order = np.argsort(slots, kind="stable")
    dest = np.full(B * T, -1, dtype=np.int64)
    dest[sel] = np.arange(len(sel), dtype=np.int64)
    scratch = torch.zeros(n_layers, 3, dtype=torch.int64)
    return Plan(B, T, len(sel), to_device(dest), to_device(np.ascontiguousarray(sel[order], dtype=np.int64)),
                to_device(np.ascontiguousarray(slots[order], dtype=np.int64)), to_device(scratch))


@dataclass
class LayerOut:
    """What a layer's kernels hand on: the moments' inputs (device tensors, no sync)."""
    rows: torch.Tensor | None  # (M, d) the counted rows in h's dtype, excluded ones zeroed (None: not asked)
    ok: torch.Tensor  # (M,) bool: counted, finite and non-zero
    s: torch.Tensor  # (d,) float64 Σh over the counted rows
    n: torch.Tensor  # () int64 vectors counted
    inv: torch.Tensor  # (B, T) float64 1/‖h‖, 0 where not counted, finite and non-zero: the next layer's `change`


def triton_module(interpret: bool):
    """triton_kernels.py, its kernels compiled for the GPU or run by Triton's interpreter on CPU tensors —
    which needs TRITON_INTERPRET=1 in the environment before Triton is first imported (its own library
    functions are built for one or the other then; tests/conftest.py sets it where there is no GPU)."""
    import triton

    if bool(triton.knobs.runtime.interpret) != interpret:
        raise RuntimeError("Triton's interpreter is " + ("off: rows on the CPU need TRITON_INTERPRET=1 before "
                                                          "Triton is imported" if interpret else "on (TRITON_INTERPRET)"))
    from . import triton_kernels

    return triton_kernels


def kernels(interpret: bool):
    """The four kernels of the token-sum pass (`triton_module`)."""
    k = triton_module(interpret)
    return k.norms_kernel, k.windows_kernel, k.slots_kernel, k.epilogue_kernel


# Block sizes: positions per program of the norms kernel and their column block, rows and columns per
# program of the slots kernel, positions and columns per program of the windows kernel, windows per
# program of the epilogue (bench/bench_triton_blocks.py times each kernel under others)
BLOCK_P, NORMS_D, ROWS, SLOTS_D, BLOCK_T, BLOCK_D, BLOCK_B = 16, 256, 16, 256, 64, 64, 32


def layer(p: Plan, layer_index: int, hidden: torch.Tensor, sums: torch.Tensor, counts: torch.Tensor,
          sum_h: torch.Tensor, sum_u2: torch.Tensor, nonfinite: torch.Tensor, zero: torch.Tensor,
          windows: torch.Tensor, window_cos: torch.Tensor, unit: tuple, rows: bool,
          change: tuple | None = None) -> LayerOut:
    """One layer of one batch: hidden (B, T, d) in any float dtype; the layer's token table `sums`
    (U, d) float64 and `counts` (U,) int64, its Σh, Σû² (d,) float64, and (1,) each: NaN/inf
    vectors, zero vectors, windows with ≥ 2 vectors (int64) and Σ window cosines (float64); `unit`:
    the windows' mean unit vectors' (windows with ≥ 1 vector (1,) int64, Σ_w ū_w (d,), Σ_w ‖ū_w‖² (1,)
    float64) — all added to in place.  `change`: (the previous layer's hidden (B, T, d), its 1/‖h‖ (B, T)
    as this function returned it, and the change sums from it to this layer: pairs (1,) int64, Σ cos,
    Σ angle/π (1,) float64, added to), or None (the batch's first layer).  `rows`: also the counted rows
    for the moments.  Launches four kernels (and, with `change`, the angles' atan2 and sum), no sync."""
    _norms, _windows, _slots, _epilogue = kernels(hidden.device.type != "cuda")
    B, T, d = hidden.shape
    flat = _rows(hidden)
    dev, P = hidden.device, B * T
    counts3 = p.scratch[layer_index]  # (3,) this layer's NaN/inf, zero and counted vectors
    inv = torch.empty(P, dtype=torch.float64, device=dev)
    m = torch.empty(B, d, dtype=torch.float64, device=dev)
    u = torch.empty(B, d, dtype=torch.float64, device=dev)
    u2 = torch.empty(B, d, dtype=torch.float64, device=dev)
    nw = torch.empty(B, dtype=torch.int64, device=dev)
    s = torch.empty(d, dtype=torch.float64, device=dev)
    out_rows = torch.empty(p.M if rows else 0, d, dtype=hidden.dtype, device=dev)
    ok = torch.empty(p.M if rows else 0, dtype=torch.int8, device=dev)
    ncol = triton_cdiv(d, BLOCK_D)
    t_tiles, b_tiles = pow2(triton_cdiv(T, BLOCK_T)), pow2(triton_cdiv(B, BLOCK_B))  # loop lengths, compiled in

    def norms(with_change):  # the norms kernel's launch, with or without the layer change
        if change is not None:
            prev = _rows(change[0])
            pargs = (prev, prev.stride(0), change[1].reshape(P), minus, plus, change[2], change[3])
        else:  # placeholders of the same types, never read
            pargs = (flat, flat.stride(0), inv, inv, inv, counts3, inv)
        return (_norms, (triton_cdiv(P, BLOCK_P),), (flat, flat.stride(0), p.dest, inv, counts3, P, *pargs, d),
                dict(BLOCK_P=BLOCK_P, BLOCK_D=NORMS_D, CHANGE=with_change))

    minus = plus = None
    if change is not None:
        minus = torch.empty(P, dtype=torch.float64, device=dev)  # (P,) ‖a − û‖, 0 where not paired
        plus = torch.empty(P, dtype=torch.float64, device=dev)  # (P,) ‖a + û‖, 1 where not paired
    launches = (
        norms(change is not None),
        (_windows, (B, ncol), (flat, flat.stride(0), inv, p.dest, out_rows, ok, m, u, u2, nw, T, d),
         dict(WRITE=rows, T_TILES=t_tiles, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D)),
        (_slots, (triton_cdiv(max(p.M, 1), ROWS), triton_cdiv(d, SLOTS_D)),
         (flat, flat.stride(0), inv, p.order, p.slots, sums, counts, p.M, d), dict(R=ROWS, BLOCK_D=SLOTS_D)),
        (_epilogue, (ncol + triton_cdiv(B, BLOCK_B),), (m, u, u2, nw, B, d, s, counts3, sum_h, sum_u2, nonfinite,
                                                        zero, windows, window_cos, *unit),
         dict(N_COLS=ncol, B_TILES=b_tiles, BLOCK_B=BLOCK_B, BLOCK_D=BLOCK_D)),
    )
    key = (dev.type, hidden.dtype, rows, d, t_tiles, b_tiles, BLOCK_P, NORMS_D, ROWS, SLOTS_D, BLOCK_T, BLOCK_D,
           BLOCK_B)  # every compiled variant these launches use
    if key not in _WARM and dev.type == "cuda":  # every kernel compiled before any writes: a compile
        other = norms(change is None)  # that fails leaves the sums untouched (the caller falls back);
        # both variants of the norms kernel, so that the batch's second layer compiles nothing new
        for fn, grid, args, consts in (*launches, other):
            fn.warmup(*args, grid=grid, **consts)
    _WARM.add(key)
    for fn, grid, args, consts in launches:
        if fn is _slots and not p.M:
            continue
        fn[grid](*args, **consts)
    if change is not None:  # Σ θ/π with θ = 2·atan2(‖a − û‖, ‖a + û‖) (Triton's interpreter has no atan2)
        change[4].add_(torch.atan2(minus, plus).sum() * (2.0 / math.pi))
    return LayerOut(out_rows if rows else None, ok.view(torch.bool), s, counts3[2], inv.view(B, T))


def _rows(hidden: torch.Tensor) -> torch.Tensor:
    """hidden (B, T, d) as (B·T, d) rows with unit column stride (a view where it can be)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    return flat if flat.stride(1) == 1 else flat.contiguous()


_WARM: set = set()  # (device type, dtype, rows, d, position and window tiles, block sizes) compiled


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pow2(n: int) -> int:
    """The least power of 2 ≥ n (≥ 1): loop lengths compiled in, a handful of variants in all."""
    return 1 << max(n - 1, 0).bit_length()
