"""Benchmark: the bf16 moments' cost per layer and batch (`Moments.add`, precision "bfloat16"), the
lean path (the Gram matrix's upper triangle by panels; centred hi + lo rows as products of views)
against the full products it replaced (hᵀh over d²; the four part pairs stacked into one product of
4× the rows), on three kinds of rows: random (a small mean: raw rows), mean-dominated (‖μ‖²/tr C ≫ 1,
a trained model's typical layer: centred and split) and a few massive dimensions (split by
max μ_i²/max C_ii).  Also each kind's covariance error against float64 products of the same rows.

    python bench/bench_lean_moments.py                          # CPU: d 512, 4,096 rows
    python bench/bench_lean_moments.py --device cuda --d 2048 --rows 16384
    # the error's dependence on the rows per float32 product, and on cuBLAS's reduced-precision reductions
    python bench/bench_lean_moments.py --device cuda --d 2048 --rows 16384 --chunks 4096,1024,256 --reduced on,off
    python bench/bench_lean_moments.py --device cuda --d 2048 --rows 16384 --chunks 4096,1024 --panels 4,1
    python bench/bench_lean_moments.py --device cuda --d 2048 --rows 16384 --variants lean,grouped
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from extract.accumulate.matmul import mm_bf16, mm_out_dtype  # noqa: E402
from extract.accumulate.moments import Moments  # noqa: E402
from bench.moments_variants import VARIANTS  # noqa: E402


def rows(kind: str, M: int, d: int, device: str, seed: int = 0) -> torch.Tensor:
    """(M, d) bf16 rows: "random" (mean 0.3 σ), "mean" (every dimension's mean 4 σ), "massive"
    (one dimension with mean 9, σ 1 — max μ_i²/max C_ii ≈ 81 while ‖μ‖²/tr C < 1 —; elsewhere as
    "random")."""
    g = torch.Generator().manual_seed(seed)
    sig = torch.logspace(0, -1, d)
    mu = torch.randn(d, generator=g) * 0.3 * sig
    if kind == "mean":
        mu = 4 * sig
    elif kind == "massive":
        mu[0] = 9.0
    return (mu + torch.randn(M, d, generator=g) * sig).bfloat16().to(device)


def full_products(h: torch.Tensor, S: torch.Tensor, split: bool, c: torch.Tensor, out: bool) -> None:
    """The replaced arithmetic: the full d² product (raw), or the four part pairs stacked along the
    rows into one product (split), folded into S whole."""
    if not split:
        S += mm_bf16(h.T, h, out)
        return
    x = h.float() - c
    hi = x.bfloat16()
    lo = (x - hi.float()).bfloat16()
    left = torch.cat([hi, hi, lo, lo])
    right = torch.cat([hi, lo, hi, lo])
    S += mm_bf16(left.T, right, out)


def float64_covariance(h: torch.Tensor, ok: torch.Tensor) -> tuple[float, np.ndarray, np.ndarray]:
    """n, the mean (d,) and the covariance (d, d) of the rows h, from float64 moments: the reference."""
    exact = Moments(1, h.shape[1], "cpu", cross=False, precision="float64", background=False)
    exact.add(0, h.cpu(), ok.cpu())
    n = float(exact.n[0])
    mean = exact.s1[0].numpy() / n
    return n, mean, exact.s2(0) / n - np.outer(mean, mean)


def timed(fn, sync, repeats: int, clock=time.perf_counter) -> float:
    fn()
    sync()
    t0 = clock()
    for _ in range(repeats):
        fn()
    sync()
    return (clock() - t0) / repeats * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chunks", default=str(Moments.CHUNK_BF16),
                    help="comma-separated rows per bf16 product (Moments.CHUNK_BF16) to compare")
    ap.add_argument("--variants", default="lean", help="comma-separated of " + ", ".join(VARIANTS)
                    + " (lean: the default path, on a GPU gram.py's kernel; the others: bench/moments_variants.py)")
    ap.add_argument("--panels", default=str(Moments.PANELS),
                    help="comma-separated row panels of the upper triangle (Moments.PANELS; 1: full products)")
    ap.add_argument("--reduced", default="on", help="comma-separated on/off: torch.backends.cuda.matmul."
                                                   "allow_bf16_reduced_precision_reduction")
    args = ap.parse_args()
    dev = args.device
    cuda = dev.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    clock = time.perf_counter if cuda else time.process_time  # a CPU's: CPU seconds (a loaded machine)
    out = cuda and mm_out_dtype(torch.device(dev))
    M, d = args.rows, args.d
    ok = torch.ones(M, dtype=torch.bool, device=dev)
    print(f"torch {torch.__version__}, {dev} ({torch.cuda.get_device_name() if cuda else 'CPU'}), threads "
          f"{torch.get_num_threads()}, {M} rows × d {d} per layer and batch, mean of {args.repeats} ({'wall' if cuda else 'CPU'} ms); load "
          f"{' '.join(open('/proc/loadavg').read().split()[:3]) if Path('/proc/loadavg').exists() else '?'}")
    print(f"{'rows':8} {'variant':8} {'chunk':>6} {'panels':>6} {'reduced':>7} {'path':36} {'lean ms':>8} {'full ms':>8} {'ratio':>6} "
          f"{'cov err/max|C|':>15}")
    for kind in ("random", "mean", "massive"):
        h = rows(kind, M, d, dev)
        n, mean, C64 = float64_covariance(h, ok)
        panel_counts = [int(p) for p in args.panels.split(",")]
        for variant, chunk, panels, reduced in ((v, int(c), p, r) for v in args.variants.split(",")
                                                for c in args.chunks.split(",")
                                                for p in (panel_counts if v != "grouped" else panel_counts[:1])
                                                for r in args.reduced.split(",")):  # panels: the lean path's alone
            Moments.CHUNK_BF16, Moments.PANELS = chunk, panels
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = reduced == "on"
            cls = VARIANTS[variant]
            m = cls(1, d, dev, cross=False, precision="bfloat16", background=False)
            m.add(0, h, ok)  # decides raw or split
            split = bool(m._split[0])
            c = m._c[0]
            t_lean = timed(lambda: m.add(0, h, ok), sync, args.repeats, clock)
            S = torch.zeros(d, d, dtype=torch.float64, device=dev)
            t_full = timed(lambda: full_products(h, S, split, c, out), sync, args.repeats, clock)
            check = cls(1, d, dev, cross=False, precision="bfloat16", background=False)
            check.add(0, h, ok)
            err = np.abs(check.s2(0) / n - np.outer(mean, mean) - C64).max() / np.abs(C64).max()
            path = (f"split (ratio {m._ratio[0]:.3g}, dim {m._dim_ratio[0]:.3g})" if split else
                    f"raw (ratio {m._ratio[0]:.3g}, dim {m._dim_ratio[0]:.3g})")
            print(f"{kind:8} {variant:8} {chunk:6} {panels:6} {reduced:>7} {path:36} {t_lean:8.2f} {t_full:8.2f} {t_lean / t_full:6.2f} "
                  f"{err:15.2e}", flush=True)


if __name__ == "__main__":
    main()
