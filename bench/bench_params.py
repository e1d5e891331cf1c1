"""Benchmark: what the parameter tables cost per matrix — `extract.params.partition_rows`, the
partition function of one (un)embedding matrix W (V, d): the float64 Gram matrix WᵀW (V·d²
multiply-adds), its eigendecompositions, the float64 projections onto both eigenbases (2·V·d²),
their log-sum-exps, and the authors' float32 convention (2·V·d² in float32).

    python bench/bench_params.py                           # 50,304 × 512 (a Pythia-70m-sized matrix)
    python bench/bench_params.py --vocab 128256 --d 4096   # a Llama-3-8B-sized matrix
    python bench/bench_params.py --device cuda --dtype bfloat16 --vocab 128256 --d 4096

Prints seconds and the float64 multiply-add rate (the part that dominates on a CPU).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from extract.params import partition_rows  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--runs", type=int, default=2)
    a = ap.parse_args()
    torch.manual_seed(0)
    W = (torch.randn(a.vocab, a.d, device=a.device) * 0.02 + 0.002).to(getattr(torch, a.dtype))  # (V, d)
    best = float("inf")
    for _ in range(a.runs):
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        partition_rows(W)
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    f64 = 3 * a.vocab * a.d ** 2
    print(f"{time.strftime('%Y-%m-%d')}: W {a.vocab} × {a.d} {a.dtype} on {a.device}: {best:.2f} s (best of {a.runs}); "
          f"{f64 / 1e9:.1f} G float64 multiply-adds → {f64 / best / 1e9:.1f} G/s overall")


if __name__ == "__main__":
    main()
