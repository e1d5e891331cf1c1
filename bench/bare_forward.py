"""The bare forward a user would write, as a whole process: load the model and tokenizer the way
`extract` does, read the same source into the same windows and batches (`extract.run.windows.windows`,
`batches`, `batch_limits`), and run the base model over them — no hooks, no sums, no parameter
tables, nothing written.  bench_matrix.py times it beside `cli.py extract`.

    python bench/bare_forward.py MODEL_DIR SOURCE.jsonl [--unit sentence] [--max-length N] \\
        [--batch-size N] [--batch-tokens N] [--max-tokens N]

Prints one line: `bare: TOKENS tokens, WINDOWS windows, BATCHES batches, LOOP s, FAULTS minor page faults in
the forward` (the process's, all threads, while the model ran: compare with hook_accounting.py's).
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("source")
    ap.add_argument("--unit", default="document")
    ap.add_argument("--max-length", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--batch-tokens", type=int, default=None)
    a = ap.parse_args()

    import torch

    from extract.architectures import get_module
    from extract.models import forward_kwargs, load, resolve_model, to_compute
    from extract.run.settings import Settings, SourceResult
    from extract.run.windows import batch_limits, batches, windows
    from extract.sentences import SentenceSplitter
    from extract.sources import ReadStats, indexed_documents, parse_source

    settings = Settings(unit=a.unit, max_length=a.max_length, max_tokens=a.max_tokens, batch_size=a.batch_size,
                        batch_tokens=a.batch_tokens)
    loaded = load(resolve_model(a.model), "main", torch.float32, "cpu")
    to_compute(loaded, torch.float32, "cpu")
    base = get_module(loaded.model, loaded.layout.base)
    kwargs = forward_kwargs(loaded.layout.head)
    source = parse_source(f"bench={a.source}")
    splitter = SentenceSplitter() if a.unit == "sentence" else None
    texts = indexed_documents(source, settings.shard, ReadStats())
    tokens = wins = count = faults = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for input_ids, mask, counted, _ in batches(loaded, windows(loaded, texts, settings, SourceResult("bench"), splitter),
                                                   *batch_limits(loaded, settings)):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            base(input_ids=input_ids, attention_mask=mask, **kwargs)
            faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
            tokens += int(counted.sum())
            wins += input_ids.shape[0]
            count += 1
    print(f"bare: {tokens} tokens, {wins} windows, {count} batches, {time.perf_counter() - start:.1f} s, "
          f"{faults} minor page faults in the forward")


if __name__ == "__main__":
    main()
