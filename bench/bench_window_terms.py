"""Per-batch CPU time of the token-sum pass with and without the per-window measures (`--sequences`),
and against an older checkout of `extract/` (`--old DIR`: DIR/extract is imported as `extract_old`),
the variants interleaved batch by batch in one process so that a shared machine's drift hits them
alike.  No model: random hidden states, the token sums' CPU path (`TokenSums._add_chunked`),
`WindowMeasures` inline without moments (no background thread: the time is all the work) or, with
`--moments`, on the moments' background thread (then the time is the wall time until all is done).
Prints min and median ms per batch and layer, and the median of minor page faults per batch
(fresh pages for large temporaries: what differs between interleaved and separate runs).

    git archive COMMIT extract | tar -x -C /tmp/old        # the older code to compare with
    OMP_NUM_THREADS=1 PYTHONPATH=. python bench/bench_window_terms.py --old /tmp/old --batch 8 --seq 512
    OMP_NUM_THREADS=1 PYTHONPATH=. python bench/bench_window_terms.py --old /tmp/old --batch 250 --seq 16
"""

from __future__ import annotations

import argparse
import importlib.util
import resource
import statistics
import sys
import time
from pathlib import Path

import torch


def _load_old(root: str):
    """DIR/extract as the package `extract_old` (its imports inside the package are relative)."""
    spec = importlib.util.spec_from_file_location("extract_old", Path(root) / "extract" / "__init__.py",
                                                  submodule_search_locations=[str(Path(root) / "extract")])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["extract_old"] = mod
    spec.loader.exec_module(mod)
    import extract_old.accumulate
    import extract_old.sequences
    return extract_old


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--moments", action="store_true", help="moments on (their background thread; wall time)")
    ap.add_argument("--old", help="a checkout whose extract/ is compared (e.g. git archive of an older commit)")
    a = ap.parse_args()
    import extract
    import extract.accumulate
    import extract.sequences

    gen = torch.Generator().manual_seed(0)
    B, T, d, L = a.batch, a.seq, a.d, a.layers
    ids = (torch.rand(B, T, generator=gen) ** 3 * a.vocab).long()  # skewed: repeated types
    counted = torch.ones(B, T, dtype=torch.bool)
    counted[:, 0] = False  # a special token per window
    where = torch.stack(torch.meshgrid(torch.arange(B), torch.arange(T), indexing="ij"), -1)
    hidden = [torch.randn(B, T, d, generator=gen).to(getattr(torch, a.dtype)) for _ in range(L)]
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, d {d}, B×T {B}×{T}, "
          f"M {int(counted.sum())}, {L} layers, {a.dtype}{', moments on their thread' if a.moments else ''}, "
          f"{a.reps} batches each, interleaved")
    pkgs = [("current", extract)] + ([("old", _load_old(a.old))] if a.old else [])  # current: extract/ on PYTHONPATH
    variants = []  # (name, accumulator)
    for tag, pkg in pkgs:
        for kind in ("token sums alone", "+ --sequences", "+ --sequences, terms in their own pass"):
            TokenSums = pkg.accumulate.TokenSums
            if "own pass" in kind and not hasattr(TokenSums, "WINDOW_TERMS"):
                continue
            acc = TokenSums(L, a.vocab, d, "cpu")
            if a.moments:
                acc.moments = pkg.accumulate.Moments(L, d, "cpu")
            if "sequences" in kind:
                acc.extra = pkg.sequences.WindowMeasures(L, d, "cpu",
                                                         worker=acc.moments._worker if a.moments else None)
            if hasattr(TokenSums, "WINDOW_TERMS") and "sequences" in kind:  # fused, or not, whatever the thread
                acc.WINDOW_TERMS = "own pass" not in kind
            variants.append((f"{tag}: {kind}", acc, [], []))
    for rep in range(a.reps + 3):
        for name, acc, times, faults in variants:
            f = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t = time.perf_counter()
            acc.set_batch(ids, counted, where)
            for layer in range(L):
                acc.add(layer, hidden[layer])
            if acc.extra is not None:
                acc.extra.finish()
            if acc.moments is not None:
                acc.moments.finish()
            float(acc.sum_h.sum())
            if rep >= 3:
                times.append((time.perf_counter() - t) * 1e3 / L)
                faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f)
    for name, acc, times, faults in variants:
        print(f"{name:52s} min {min(times):7.2f}  median {statistics.median(times):7.2f} ms per batch and layer; "
              f"{statistics.median(faults):6.0f} page faults per batch (median)")
        acc.close()


if __name__ == "__main__":
    main()
