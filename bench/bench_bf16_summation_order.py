"""Benchmark: how far the bf16 moments' covariance can be off whatever float32 GEMM a machine has.
The rows of tests/test_triton.py's massive-dimension layer (d 512, 4,096 rows = one product of
`Moments.CHUNK_BF16`; the massive dimension's Σ h₀² halfway between two float32 numbers), raw and
centred-and-split (forced either way), through this machine's GEMM (the code's own path) and through a
float32 sum taken one row after another (the worst usual order: no blocking), each against float64
products of the same bf16 rows; errors relative to the largest covariance entry.

    python bench/bench_bf16_summation_order.py
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from extract.accumulate.moments import Moments  # noqa: E402


def row_by_row(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Σ_r a_rᵀ b_r in float32, one row after another: (k, i), (k, j) → (i, j)."""
    acc = torch.zeros(a.shape[1], b.shape[1])
    for r in range(a.shape[0]):
        acc += torch.outer(a[r], b[r])
    return acc


def main() -> None:
    d, rows = 512, 4096
    g = torch.Generator().manual_seed(7)
    sig = torch.logspace(0, -0.12, d, dtype=torch.float64)
    k = 136 + torch.arange(rows) % 27 - 13  # the massive dimension's values k/8 (mean 17), as in the test
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, d {d}, {rows} rows per product")
    for big in (17.0, 0.0):
        mu = torch.randn(d, generator=g, dtype=torch.float64) * 0.1 * sig
        mu[0] = 0.0
        h = (mu + torch.randn(rows, d, generator=g, dtype=torch.float64) * sig).bfloat16()  # (rows, d)
        if big:
            h[:, 0] = k / 8
        ok = torch.ones(rows, dtype=torch.bool)
        exact = Moments(1, d, "cpu", cross=False, precision="float64", background=False)
        exact.add(0, h, ok)
        n = float(exact.n[0])
        s1 = exact.s1[0].numpy()
        mean = s1 / n
        C64 = exact.s2(0) / n - np.outer(mean, mean)

        def error(S: np.ndarray) -> float:  # the upper triangle (all that `s2` reads)
            return float(np.abs(np.triu(S / n - np.outer(mean, mean) - C64)).max() / np.abs(C64).max())

        gemm = {}
        for name, cut in (("split", 0.0), ("raw", float("inf"))):  # forced either way
            m = Moments(1, d, "cpu", cross=False, precision="bfloat16", background=False)
            m.SPLIT_RATIO = m.SPLIT_DIM_RATIO = cut
            m.add(0, h, ok)
            gemm[name] = error(m.s2(0))
        c = torch.tensor(mean).to(torch.bfloat16).float()  # the centre, as `Moments._decide` rounds it
        x = h.float() - c  # (rows, d), exact
        hi = x.bfloat16().float()
        lo = (x - hi).bfloat16().float()
        cross = row_by_row(hi, lo)
        S = (row_by_row(hi, hi) + row_by_row(lo, lo) + cross + cross.T).double().numpy()
        cc = c.double().numpy()
        S += np.outer(cc, s1) + np.outer(s1, cc) - n * np.outer(cc, cc)  # the shift undone in float64
        hf = h.float()
        seq = {"split": error(S), "raw": error(row_by_row(hf, hf).double().numpy())}
        print(f"mu_0 = {big:g} (max mu_i^2/max C_ii ~ {big ** 2:.0f}): "
              + ", ".join(f"{k} rows {gemm[k]:.2e} through this GEMM, {seq[k]:.2e} row by row" for k in gemm))


if __name__ == "__main__":
    main()
