"""Benchmark: the Triton token-sum kernels (extract/accumulate/fused.py) per layer and batch, at one
shape, under several block sizes — each kernel's device time from torch's profiler, the sums of every
configuration checked against the first's.  No model: bf16 rows with a dominant mean (a trained
layer's), token ids from a Zipf law (s = 1.1) over the vocabulary, like text.

    python bench/bench_triton_blocks.py                          # the 1.4B shape: 8 × 2,048, d 2,048
    python bench/bench_triton_blocks.py --configs "ROWS=16 ROWS=32,SLOTS_D=128 NORMS_D=512"

The counted rows are written for the moments as in the default pass (`--no-rows`: not written).

On a CPU it needs TRITON_INTERPRET=1 and a tiny shape (the interpreter is slow): it then only checks
that every configuration gives the same sums.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from extract.accumulate import fused  # noqa: E402
from extract.accumulate.sums import TokenSums  # noqa: E402

DEFAULT_CONFIGS = ("BLOCK_T=64 BLOCK_T=32 BLOCK_T=128 BLOCK_D=32 BLOCK_T=128,BLOCK_D=32 NORMS_D=512 ROWS=32 "
                   "BLOCK_P=32")  # the first: the defaults


class RowsSink:
    """Takes the counted rows in the moments' place and does nothing with them."""

    def add(self, *args, **kwargs) -> None:
        pass

    def close(self) -> None:
        pass


def parse(config: str) -> dict[str, int]:
    out = {}
    for item in config.split(","):
        name, value = item.split("=")
        if not hasattr(fused, name):
            raise SystemExit(f"error: fused.py has no block size {name!r}")
        out[name] = int(value)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--layers", type=int, default=4, help="layers per batch (the layer change from the second)")
    ap.add_argument("--repeats", type=int, default=3, help="batches timed per configuration")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="space-separated NAME=VALUE,... of fused.py")
    ap.add_argument("--no-rows", dest="rows", action="store_false",
                    help="without the counted rows written for the moments (the default pass writes them)")
    args = ap.parse_args()
    dev, B, T, d, V, L = args.device, args.batch, args.seq, args.d, args.vocab, args.layers
    g = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    p = np.arange(1, V + 1) ** -1.1
    ids = torch.from_numpy(rng.permutation(V)[rng.choice(V, size=(B, T), p=p / p.sum())])  # (B, T)
    counted = torch.ones(B, T, dtype=torch.bool)
    counted[:, :8] = False  # a window's first positions are context only
    mean = torch.randn(d, generator=g) * 4  # (d,) a dominant mean
    hidden = [(mean + torch.randn(B, T, d, generator=g)).bfloat16().to(dev) for _ in range(L)]  # (B, T, d) each
    cuda = dev.startswith("cuda")
    print(f"torch {torch.__version__}, {dev} ({torch.cuda.get_device_name() if cuda else 'CPU'}); B {B}, T {T}, "
          f"d {d}, V {V}, {L} layers per batch, {args.repeats} batches timed, counted rows "
          f"{'written' if args.rows else 'not written'}; ms per layer (device time)")
    first = None
    for config in args.configs.split():
        sizes = parse(config)
        saved = {k: getattr(fused, k) for k in sizes}
        for k, v in sizes.items():
            setattr(fused, k, v)
        try:
            acc = TokenSums(L, V, d, dev, triton=True)
            if args.rows:  # the windows kernel also writes the counted rows, as with the moments on
                acc.moments = RowsSink()

            def batch():
                acc.set_batch(ids, counted)
                for layer in range(L):
                    acc.add(layer, hidden[layer])

            batch()  # compiles
            if acc.paths.get("layer_step") != "triton":  # a size that fails falls back to another step
                raise SystemExit(f"error: {config}: the Triton kernels did not run ({acc.paths})")
            if cuda:
                torch.cuda.synchronize()
            times = collections.Counter()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(args.repeats):
                    batch()
                if cuda:
                    torch.cuda.synchronize()
            for e in prof.key_averages():
                if cuda and e.device_time_total > 0 and "kernel" in e.key:  # torch's own kernels: "other"
                    name = e.key.split("_kernel")[0] if "::" not in e.key else "other"
                    times[name] += e.device_time_total / 1e3 / (args.repeats * L)
            tables = [tuple(t.cpu() for t in acc.dense(layer)) for layer in range(L)]
            if first is None:
                first = tables
            same = max(float(((a[1] - b[1]).abs().max() / b[1].abs().max().clamp_min(1e-300))) if
                       torch.equal(a[0], b[0]) else float("inf") for a, b in zip(tables, first))
            acc.close()
        finally:
            for k, v in saved.items():
                setattr(fused, k, v)
        print(f"{config:36} " + " ".join(f"{k} {v:.3f}" for k, v in sorted(times.items()))
              + f"  total {sum(times.values()):.3f}; sums against the first: {same:.1e}", flush=True)


if __name__ == "__main__":
    main()
