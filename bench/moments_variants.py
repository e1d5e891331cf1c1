"""Variants of the bf16 moments' products for the benchmarks (bench_extract.py --moments-variant,
bench_lean_moments.py --variants), to measure against the default path before any becomes it.

`TorchMoments`: torch's products (panels of the upper triangle, ≤ CHUNK_BF16 rows each, folded into
float64 per product) where a GPU's default is gram.py's Triton kernel.

`GroupedMoments`: each product of CHUNK_BF16 rows is made as one batched GEMM of PIECE-row pieces, each
piece's Gram matrix summed in float32 by the tensor cores, the pieces summed into the float64 sums by one
reduction — the float32 sums of PIECE rows (the error of shorter products) at two launches per product
(the default: ~8 for raw rows, ~25 for split ones).  Full d² products (the default multiplies the upper
triangle by panels); split rows as one product of their [hi | lo] buffer, (2d)² per piece, the four
quadrants summed in float64.  Memory: (CHUNK_BF16 / PIECE) · d² float32 per raw product, 4× that split.
"""

from __future__ import annotations

import functools

import torch

from extract.accumulate.moments import Moments


@functools.cache
def bmm_out_dtype(device: torch.device) -> bool:
    """Whether this torch has `torch.bmm(..., out_dtype=)` (bf16 in, float32 out) on `device`."""
    try:
        a = torch.ones(1, 2, 2, dtype=torch.bfloat16, device=device)
        return torch.bmm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError):
        return False


class TorchMoments(Moments):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "triton": False})


class GroupedMoments(TorchMoments):
    PIECE = 1024  # rows per float32 sum inside the batched product

    def _add_sym(self, S: torch.Tensor, P: list[torch.Tensor]) -> None:
        x = P[0]
        k, d = x.shape
        if len(P) == 2:  # hi and lo: views of one (M, 2d) buffer, each row [hi | lo]
            hi, lo = P
            if lo.data_ptr() != hi.data_ptr() + d * hi.element_size() or hi.stride() != (2 * d, 1):
                raise RuntimeError("split rows are not views of one [hi | lo] buffer")
            x = hi.as_strided((k, 2 * d), (2 * d, 1))  # (k, 2d)
        n = k // self.PIECE
        for rows, pieces in ((x[: n * self.PIECE], n), (x[n * self.PIECE:], 1)):
            if not len(rows):
                continue
            xs = rows.reshape(pieces, -1, rows.shape[1])  # (pieces, r, d or 2d)
            if bmm_out_dtype(xs.device) and xs.dtype == torch.bfloat16:
                G = torch.bmm(xs.transpose(1, 2), xs, out_dtype=torch.float32)  # (pieces, d', d')
            else:
                xs = xs.float()
                G = torch.bmm(xs.transpose(1, 2), xs)
            if len(P) == 2:  # Σ over pieces and the four quadrants hiᵀhi, hiᵀlo, loᵀhi, loᵀlo, in float64
                S += G.view(pieces, 2, d, 2, d).sum(dim=(0, 1, 3), dtype=torch.float64)
            else:
                S += G.sum(0, dtype=torch.float64)


VARIANTS = {"lean": Moments, "torch": TorchMoments, "grouped": GroupedMoments}
