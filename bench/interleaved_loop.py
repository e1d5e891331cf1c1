"""The default pass against a bare forward in one process, batch by batch: each batch runs through the base
model alone and through the model with the extract's hooks (`capture_layers` → `TokenSums.add`, the default
accumulator: token sums, moments, layer 0 by type), in alternating order, over the same batches.

A ratio of two processes moves with this machine's speed from one minute to the next; here both sides
share every minute.  Printed per pass over the batches: the bare forward's seconds, the forward's seconds
between the hooks (÷ bare: what the hooks cost the forward itself, e.g. through the caches), the hooks' and
`set_batch`'s seconds, and (forward + hooks + set_batch) ÷ bare — the forward loop's ratio less the
per-source costs (the first buffer of windows, the types' product when the sums are read).  The first
pass includes the token table's growth (later passes find every type's slot).

    python bench/interleaved_loop.py MODEL_DIR SOURCE.jsonl --unit sentence --max-length 512 --tokens 100000
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.allocator import keep_freed_memory  # noqa: E402
from common.openmp import short_spin  # noqa: E402

short_spin()  # as the command line does, before torch loads
keep_freed_memory()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("source")
    ap.add_argument("--unit", default="document")
    ap.add_argument("--max-length", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--passes", type=int, default=2)
    a = ap.parse_args()

    import torch

    from extract.accumulate import cpu_kernels
    from extract.hooks import capture_layers
    from extract.models import load, resolve_model, to_compute
    from extract.run.settings import Settings, SourceResult
    from extract.run.stream import base_forward, new_accumulator
    from extract.run.windows import batch_limits, batches, windows
    from extract.sentences import SentenceSplitter
    from extract.sources import ReadStats, indexed_documents, parse_source

    cpu_kernels.warm()
    settings = Settings(unit=a.unit, max_length=a.max_length, max_tokens=a.tokens)
    loaded = load(resolve_model(a.model), "main", torch.float32, "cpu")
    to_compute(loaded, torch.float32, "cpu")
    splitter = SentenceSplitter() if a.unit == "sentence" else None
    texts = indexed_documents(parse_source(f"bench={a.source}"), settings.shard, ReadStats())
    made = list(batches(loaded, windows(loaded, texts, settings, SourceResult("bench"), splitter),
                        *batch_limits(loaded, settings)))
    run = base_forward(loaded, settings)
    acc = new_accumulator(loaded, settings, 8 << 30)
    in_hooks = [0.0]

    def add(layer, hidden):
        t = time.perf_counter()
        acc.add(layer, hidden)
        in_hooks[0] += time.perf_counter() - t

    print(f"{len(made)} batches, {sum(int(c.sum()) for _, _, c, _ in made)} tokens; unit {a.unit}")
    with torch.inference_mode():
        for p in range(a.passes):
            bare = fwd = hooks = sb = 0.0
            for i, (ids, mask, counted, where) in enumerate(made):
                for side in ((0, 1) if (i + p) % 2 == 0 else (1, 0)):
                    if side == 0:
                        t = time.perf_counter()
                        run(ids, mask)
                        bare += time.perf_counter() - t
                        continue
                    t = time.perf_counter()
                    acc.set_batch(ids, counted, where)
                    sb += time.perf_counter() - t
                    in_hooks[0] = 0.0
                    with capture_layers(loaded.model, loaded.layout, add):
                        t = time.perf_counter()
                        run(ids, mask)
                        dt = time.perf_counter() - t
                    fwd += dt - in_hooks[0]
                    hooks += in_hooks[0]
            print(f"pass {p}: bare {bare:.2f} s; with the hooks: forward {fwd:.2f} s ({fwd / bare:.3f} × bare), "
                  f"hooks {hooks:.2f} s, set_batch {sb:.2f} s; (forward + hooks + set_batch) ÷ bare "
                  f"{(fwd + hooks + sb) / bare:.3f}", flush=True)
    acc.close()


if __name__ == "__main__":
    main()
