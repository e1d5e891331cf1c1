"""Benchmark: gram.py's Triton kernel (a GPU's bf16 moments) under several tiles, launches and flush
intervals — per layer and batch, the Gram matrix's upper triangle and a cross moment's full product,
on raw rows and on centred-and-split ones, each with its covariance error against float64 products of
the same rows — beside torch's products (moments.py's path elsewhere), so that gram.py's constants are
chosen from measurements.

    python bench/bench_gram.py --d 2048 --rows 16384                      # on a GPU
    python bench/bench_gram.py --configs 128x64x32:8:3:256,128x64x64:8:3:256
    TRITON_INTERPRET=1 python bench/bench_gram.py --device cpu --d 64 --rows 512 --configs 32x32x16:4:1:64
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_lean_moments import float64_covariance, rows, timed  # noqa: E402
from bench.moments_variants import TorchMoments  # noqa: E402
from extract.accumulate import gram  # noqa: E402
from extract.accumulate.moments import Moments  # noqa: E402

DEFAULT = f"{gram.BM}x{gram.BN}x{gram.BK}:{gram.WARPS}:{gram.STAGES}:{gram.FLUSH}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--configs", default=f"{DEFAULT},128x64x64:8:3:256,128x128x32:8:3:256,64x64x32:4:3:256,"
                                         f"128x64x32:8:4:256,128x64x32:8:3:512,128x64x32:8:3:1024",
                    help="comma-separated BMxBNxBK:WARPS:STAGES:FLUSH")
    args = ap.parse_args()
    dev, M, d = args.device, args.rows, args.d
    cuda = dev.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    ok = torch.ones(M, dtype=torch.bool, device=dev)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if cuda else 'CPU (interpreter)'}, {M} rows × d {d} "
          f"per layer and batch, mean of {args.repeats} (wall ms); torch: moments.py's products "
          f"({Moments.CHUNK_BF16} rows, {Moments.PANELS} panels)")
    print(f"{'rows':14} {'config':18} {'gram ms':>8} {'cross ms':>9} {'cov err/max|C|':>15}")
    for kind in ("random", "mean", "massive"):
        h = rows(kind, M, d, dev)
        n, mean, C64 = float64_covariance(h, ok)
        for config in ["torch", *args.configs.split(",")]:
            if config != "torch":
                tile, warps, stages, flush = config.split(":")
                gram.BM, gram.BN, gram.BK = (int(x) for x in tile.split("x"))
                gram.WARPS, gram.STAGES, gram.FLUSH = int(warps), int(stages), int(flush)
            cls = TorchMoments if config == "torch" else functools.partial(Moments, triton=True)
            m = cls(2, d, dev, cross=True, precision="bfloat16", background=False)
            try:
                m.add(0, h, ok)  # decides raw or split; compiles
                t_gram = timed(lambda: m.add(0, h, ok), sync, args.repeats)
                m.add(1, h, ok)
                t_pair = timed(lambda: (m.add(0, h, ok), m.add(1, h, ok)), sync, args.repeats)
            except Exception as e:  # a launch that does not fit (registers, shared memory)
                print(f"{kind:14} {config:18} failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}", flush=True)
                continue
            check = cls(1, d, dev, cross=False, precision="bfloat16", background=False)
            check.add(0, h, ok)
            err = np.abs(check.s2(0) / n - np.outer(mean, mean) - C64).max() / np.abs(C64).max()
            path = "split" if m._split[0] else "raw"
            print(f"{kind + ' ' + path:14} {config:18} {t_gram:8.2f} {t_pair - 2 * t_gram:9.2f} {err:15.2e}", flush=True)


if __name__ == "__main__":
    main()
