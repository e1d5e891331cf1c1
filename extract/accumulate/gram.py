"""The bf16 moments' products on a GPU in one Triton kernel per layer and batch (`add`): Σ xᵀy over
all of a batch's rows, float64 out, for x and y two layers' rows (the Gram matrix: x = y, only its
upper triangle's tiles; the cross moment: every tile).  Each side's rows go in raw (bf16 values as
they are) or centred and split (x = h − c exact in float32, then hi + lo in bf16, inside the kernel:
no copies), rows that are not ok zeroed.  Each program owns one (BM, BN) tile of the output: its
products go into a float32 sum on the tensor cores, which is added into a float64 sum in registers
every FLUSH rows — a tensor core's float32 sum errs in proportion to its rows, so FLUSH bounds the
error whatever the batch — and the tile is added into the float64 output once, at the end (no
separate fold of a float32 product, no atomics).  On a CPU the same kernel runs in Triton's
interpreter (tests), its bf16 operands multiplied as the same values in float32.
"""

from __future__ import annotations

import functools
import os

import torch

from . import fused

ENV = "ISO_MOMENTS_GRAM"  # torch: the bf16 moments through torch's products (moments.py) on a GPU too

# The tile, the rows per step and per float32 sum (a multiple of BK), and the launch: 128 × 64 tiles and
# 32-row steps keep a program's accumulators and split operands in registers on sm80 and sm90 (64-row
# steps or 128 × 128 tiles spill: bench/gram_registers.py); bench/gpu_check.sh's `gram` step times others
BM, BN, BK, FLUSH, WARPS, STAGES = 128, 64, 32, 256, 8, 3
CAPABILITY = (8, 0)  # older GPUs (sm75 and before) compile tl.dot without tensor cores: torch's products


def wanted(device: torch.device) -> bool:
    """Whether a GPU's bf16 moments take this kernel: an NVIDIA GPU of CAPABILITY or later, Triton there,
    and $ISO_MOMENTS_GRAM not `torch`."""
    return (device.type == "cuda" and os.environ.get(ENV, "").strip().lower() != "torch" and fused.available()
            and torch.cuda.get_device_capability(device) >= CAPABILITY)


def launch_errors() -> tuple[type[BaseException], ...]:
    """What a launch raises when this GPU or Triton cannot compile or fit the kernel (before it runs)."""
    from triton.compiler import errors as compiler
    from triton.runtime import errors as runtime

    return tuple(e for e in (getattr(runtime, "OutOfResources", None), getattr(runtime, "PTXASError", None),
                             getattr(compiler, "CompilationError", None)) if e is not None)


@functools.lru_cache(maxsize=None)
def _tiles(d: int, bm: int, bn: int, upper: bool, device: str) -> torch.Tensor:
    """The output's tiles as (i, j) pairs, flat int32 — those on or above the diagonal where `upper`."""
    nm, nn = -(-d // bm), -(-d // bn)
    pairs = [(i, j) for i in range(nm) for j in range(nn) if not upper or (j + 1) * bn > i * bm]
    return torch.tensor(pairs, dtype=torch.int32, device=device).flatten()


def add(out: torch.Tensor, a: tuple, b: tuple | None = None) -> None:
    """out (d, d) float64, contiguous, += Σ_rows x_aᵀ x_b — its upper triangle (and the diagonal tiles'
    lower part) where b is None (x_b = x_a), else in full.  a, b: (h, ok, c, split) per side: h (M, d)
    bf16 rows, ok (M,) bool, c (d,) float32 centre (zeros for raw rows), split: centred and split rows
    (x = where(ok, h − c, 0) as hi + lo) or raw ones (x = where(ok, h, 0)).  Raises one of
    `launch_errors()` before anything is added where the kernel cannot be compiled or launched."""
    if FLUSH % BK:
        raise ValueError(f"gram.FLUSH ({FLUSH}) must be a multiple of gram.BK ({BK})")
    upper = b is None
    b = a if b is None else b
    (ha, oka, ca, sa), (hb, okb, cb, sb) = a, b
    M, d = ha.shape
    if M == 0:
        return
    ha, hb = (h if h.stride(1) == 1 else h.contiguous() for h in (ha, hb))
    oka, okb, ca, cb = (x.contiguous() for x in (oka, okb, ca, cb))
    import triton.language as tl

    interpret = ha.device.type != "cuda"
    kernel = fused.triton_module(interpret).gram_kernel
    tiles = _tiles(d, BM, BN, upper, str(ha.device))
    launch = {} if interpret else {"num_warps": WARPS, "num_stages": STAGES}
    # the interpreter multiplies bf16 operands' bit patterns: there the same values go in as float32
    dot, precision = (tl.float32, "ieee") if interpret else (tl.bfloat16, "tf32")
    kernel[(tiles.numel() // 2,)](ha, ha.stride(0), oka.view(torch.uint8), ca, hb, hb.stride(0), okb.view(torch.uint8),
                                  cb, tiles, M, out, d, bool(sa), bool(sb), BM, BN, BK, FLUSH, dot, precision, **launch)
