"""Benchmark: the CPU's per-batch accumulation alone — the token sums (`TokenSums.add`, its chunked
CPU path: Σû, Σh per window, the layer change) and the float32 moments (`Moments`, inline) — on
synthetic hidden states shaped like a trained model's (a common mean, consecutive layers close to
each other), without a model or a forward.  One intra-op thread unless told otherwise; per batch:
wall ms, µs per row and layer, and the minor page faults (fresh memory mappings show there).

    python bench/bench_cpu_accumulate.py                        # the matrix's shape: 8 × 512, d 512, 7 layers
    python bench/bench_cpu_accumulate.py --batch 216 --seq 30   # a sentence-like batch
    python bench/bench_cpu_accumulate.py --repo ../old-checkout # the same measurement of another checkout
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=7, help="layer indices (blocks + embeddings)")
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--batches", type=int, default=10, help="timed batches (after 3 warm-up ones)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repo", default=str(Path(__file__).resolve().parent.parent),
                    help="the checkout whose code is measured")
    a = ap.parse_args()
    sys.path.insert(0, a.repo)
    import numpy as np
    import torch

    from extract.accumulate.moments import Moments
    from extract.accumulate.sums import TokenSums

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    B, T, d, L = a.batch, a.seq, a.hidden, a.layers
    ids = torch.from_numpy(np.minimum(rng.zipf(1.2, size=(B, T)), a.vocab) - 1)  # (B, T) Zipf token ids
    counted = torch.ones(B, T, dtype=torch.bool)
    hs = [torch.randn(B, T, d) + 3 * torch.randn(d)]  # (B, T, d) per layer: a common mean, small steps
    for _ in range(L - 1):
        hs.append(hs[-1] + 0.5 * torch.randn(B, T, d))
    rows = [h.reshape(-1, d) for h in hs]  # (B·T, d)
    ok = torch.ones(B * T, dtype=torch.bool)
    sums = [r.double().sum(0) for r in rows]  # (d,) Σh per layer, as the token sums hand it over
    acc = TokenSums(L, a.vocab, d, "cpu")
    mom = Moments(L, d, "cpu", cross=False, background=False)

    def token_sums():
        acc.set_batch(ids, counted)
        for layer in range(L):
            acc.add(layer, hs[layer])

    def moments():
        for layer in range(L):
            mom.add(layer, rows[layer], ok, s=sums[layer], n=ok.sum())

    print(f"{B} x {T} rows, d {d}, {L} layers, {a.threads} thread(s); code: {a.repo}; "
          f"moments path {mom.paths['moments']}")
    for name, fn in (("token sums", token_sums), ("moments", moments)):
        for _ in range(3):
            fn()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        for _ in range(a.batches):
            fn()
        dt = (time.perf_counter() - t0) / a.batches
        faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / a.batches
        print(f"{name:10s}: {dt * 1e3:7.1f} ms per batch, {dt / (B * T * L) * 1e6:.3f} µs per row and layer, "
              f"{faults:.0f} minor faults per batch")


if __name__ == "__main__":
    main()
