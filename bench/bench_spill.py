"""The token sums under a memory budget at Llama-3 / Gemma vocabularies: spill bytes
written and read and tokens/s against no budget.

What runs: `TokenSums` (extract/accumulate/sums.py) on the CPU fed directly, no forward pass — a
Zipf(a) stream of token ids over V types (ranks shuffled over the ids) and, per layer index,
synthetic hidden states (B·T rows of d float32, cut from a fixed pool of random rows at a random
offset: the values do not matter for the tables, only the ids do).  --layers 3 is a 2-block model's
(embeddings + 2 blocks); bytes per type L(8d + 8) + 8.  For each vocabulary: one unbudgeted run
(the table's size is then the types seen × bytes per type), then one per budget share (1/2, 1/4,
1/8 of that table), each checked against the unbudgeted sums (ids, counts equal; max relative |Δ|).

    python bench/bench_spill.py --vocab 128256 262144 --tokens 4000000 --d 64 --zipf 1.1
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from extract.accumulate.sums import TokenSums  # noqa: E402


def zipf_ids(vocab: int, a: float, n: int, seed: int) -> np.ndarray:
    """n token ids, rank r drawn with p ∝ r^-a over ranks 1..vocab, ranks shuffled over the ids."""
    rng = np.random.default_rng(seed)
    p = np.arange(1, vocab + 1, dtype=np.float64) ** -a
    cdf = np.cumsum(p / p.sum())
    ranks = np.minimum(np.searchsorted(cdf, rng.random(n)), vocab - 1)
    return rng.permutation(vocab)[ranks].astype(np.int64)


def run(ids: np.ndarray, vocab: int, layers: int, d: int, batch: int, budget: int | None, spill_dir: str,
        pool: list[torch.Tensor], read: bool = True):
    acc = TokenSums(layers, vocab, d, "cpu", budget=budget, spill_dir=spill_dir, host_budget=None)
    rng = np.random.default_rng(1)
    counted = torch.ones(1, batch, dtype=torch.bool)
    start = time.perf_counter()
    for a in range(0, len(ids) - batch + 1, batch):
        acc.set_batch(torch.from_numpy(ids[a:a + batch]).view(1, batch), counted)
        o = int(rng.integers(0, pool[0].shape[0] - batch))
        for layer in range(layers):
            acc.add(layer, pool[layer][o:o + batch].view(1, batch, d))
    seconds = time.perf_counter() - start
    out = None
    acc.merge_read = acc.spill_read_bytes  # read by the merges while accumulating
    t = time.perf_counter()
    if read:
        out = [[(i, n, S) for i, n, S in acc.layer_rows(layer)] for layer in range(layers)]
    read_s = time.perf_counter() - t
    return acc, seconds, read_s, out


def compare(want, got) -> float:
    worst = 0.0
    for lw, lg in zip(want, got):
        i0, n0, S0 = (np.concatenate([p[k] for p in lw]) for k in range(3))
        i1, n1, S1 = (np.concatenate([p[k] for p in lg]) for k in range(3))
        assert np.array_equal(i0, i1) and np.array_equal(n0, n1)
        worst = max(worst, float((np.abs(S0 - S1).max(1) / np.maximum(1, np.abs(S0).max(1))).max()))
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, nargs="+", default=[128_256, 262_144])
    ap.add_argument("--tokens", type=int, default=4_000_000)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--batch", type=int, default=4096, help="counted tokens per batch")
    ap.add_argument("--shares", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--spill-dir", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    L, d = args.layers, args.d
    slot = L * (8 * d + 8) + 8
    print(f"bench_spill {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, torch {torch.__version__}, 1 thread; L {L}, d {d} ({slot} bytes per type), "
          f"Zipf({args.zipf}), {args.tokens:,} tokens, batches of {args.batch}; TokenSums fed directly (no forward)")
    g = torch.Generator().manual_seed(0)
    pool = [torch.randn(1 << 16, d, generator=g) for _ in range(L)]
    for V in args.vocab:
        ids = zipf_ids(V, args.zipf, args.tokens, seed=V)
        with tempfile.TemporaryDirectory(dir=args.spill_dir) as tmp:
            acc0, s0, r0, want = run(ids, V, L, d, args.batch, None, tmp, pool)
            types = acc0.table.resident
            table = types * slot
            acc0.close()
            # the bytes any policy must write, roughly: a token beyond the K types the budget holds
            # (K = budget / bytes per type) costs a row unless it recurs while resident
            p = np.arange(1, V + 1, dtype=np.float64) ** -args.zipf
            tail = np.concatenate([np.cumsum((p / p.sum())[::-1])[::-1], [0.0]]) / types  # tail[K] = P(rank > K) / types
            print(f"\nV {V:,}: {types:,} types seen; table {table / 1e6:.1f} MB (dense {V * slot / 1e6:.1f} MB)")
            print(f"  no budget: {args.tokens / s0:,.0f} tok/s ({s0:.1f} s), read back {r0:.1f} s")
            print("  | budget | MB | spills | runs left | written MB | written / table | evicted / table | "
                  "read by merges MB | read back MB | tok/s | vs no budget | read back s | max rel Δ | N·P(rank > K) / types |")
            for share in args.shares:
                budget = table // share
                acc, s, r, got = run(ids, V, L, d, args.batch, budget, tmp, pool)
                worst = compare(want, got)
                print(f"  | 1/{share} | {budget / 1e6:.1f} | {acc.spill_count} | {len(acc.spills)} | "
                      f"{acc.spill_bytes / 1e6:.0f} | {acc.spill_bytes / table:.2f} | "
                      f"{acc.disk.bytes_evicted / table:.2f} | {acc.merge_read / 1e6:.0f} | "
                      f"{(acc.spill_read_bytes - acc.merge_read) / 1e6:.0f} | "
                      f"{args.tokens / s:,.0f} | {s0 / s:.2f} | {r:.1f} | {worst:.1e} | {args.tokens * tail[budget // slot]:.2f} |",
                      flush=True)
                acc.close()


if __name__ == "__main__":
    main()
