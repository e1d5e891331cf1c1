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

# The tile, the rows per step and per float32 sum, and the launch (bench/gpu_check.sh's `gram` step
# times and checks other choices)
BM, BN, BK, FLUSH, WARPS, STAGES = 128, 128, 64, 256, 8, 3


def wanted(device: torch.device) -> bool:
    """Whether a GPU's bf16 moments take this kernel: Triton is there and $ISO_MOMENTS_GRAM is not `torch`."""
    return device.type == "cuda" and os.environ.get(ENV, "").strip().lower() != "torch" and fused.available()


@functools.lru_cache(maxsize=None)
def _tiles(d: int, bm: int, bn: int, upper: bool, device: str) -> torch.Tensor:
    """The output's tiles as (i, j) pairs, flat int32 — those on or above the diagonal where `upper`."""
    nm, nn = -(-d // bm), -(-d // bn)
    pairs = [(i, j) for i in range(nm) for j in range(nn) if not upper or (j + 1) * bn > i * bm]
    return torch.tensor(pairs, dtype=torch.int32, device=device).flatten()


def add(out: torch.Tensor, a: tuple, b: tuple | None = None) -> None:
    """out (d, d) float64 += Σ_rows x_aᵀ x_b — its upper triangle (and the diagonal tiles' lower
    part) where b is None (x_b = x_a), else in full.  a, b: (h, ok, c, split) per side: h (M, d)
    bf16 rows, ok (M,) bool, c (d,) float32 centre (zeros for raw rows), split: centred and split
    rows (x = where(ok, h − c, 0) as hi + lo) or raw ones (x = where(ok, h, 0))."""
    upper = b is None
    b = a if b is None else b
    (ha, oka, ca, sa), (hb, okb, cb, sb) = a, b
    M, d = ha.shape
    if M == 0:
        return
    ha, hb = (h if h.stride(1) == 1 else h.contiguous() for h in (ha, hb))
    interpret = ha.device.type != "cuda"
    kernel = fused.triton_module(interpret).gram_kernel
    tiles = _tiles(d, BM, BN, upper, str(ha.device))
    launch = {} if interpret else {"num_warps": WARPS, "num_stages": STAGES}
    kernel[(tiles.numel() // 2,)](ha, ha.stride(0), oka.view(torch.uint8), ca, hb, hb.stride(0), okb.view(torch.uint8),
                                  cb, tiles, M, out, d, bool(sa), bool(sb), BM, BN, BK, FLUSH, not interpret, **launch)
