"""Benchmark: the forward loop with its batches made inline, or made ahead on the prefetch thread
(extract/staging.py: Prefetch) under the interpreter's default 5 ms switch interval and under
Prefetch.SWITCH_INTERVAL — the real windowing and batching (`--unit sentence` splits with pysbd) of
bench_matrix.py's random GPT-NeoX and Pile-like data, the base model's forward over each batch.
Modes alternate, `--runs` times; printed per mode: the loop's wall seconds, the main thread's CPU
seconds, and the difference (time the main thread waited: for the GIL, or for a core).  `--busy`
adds the worst case: batches made inline while another thread makes batches without pause (a
tokeniser that never catches up), under either switch interval.

    python bench/bench_gil_convoy.py [--unit sentence|document] [--tokens 20000] [--runs 3] [--threads 1] [--busy]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_extract import build_model  # noqa: E402
from bench_matrix import write_pile, write_short  # noqa: E402

from extract.architectures import get_module  # noqa: E402
from extract.models import forward_kwargs, load, resolve_model, to_compute  # noqa: E402
from extract.run.settings import Settings, SourceResult  # noqa: E402
from extract.run.windows import batch_limits, batches, windows  # noqa: E402
from extract.sentences import SentenceSplitter  # noqa: E402
from extract.sources import ReadStats, indexed_documents, parse_source  # noqa: E402
from extract.staging import Prefetch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--unit", default="sentence", choices=("sentence", "document", "short"))
    ap.add_argument("--tokens", type=int, default=20_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    ap.add_argument("--busy", action="store_true", help="also: beside a thread that makes batches without pause")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory(prefix="isobench-gil-") as tmp:
        tmp = Path(tmp)
        model = build_model(tmp / "model", argparse.Namespace(hidden=512, layers=6, vocab=50304, arch="gpt_neox",
                                                              intermediate=None, kv_heads=None, seq=512),
                            punctuation=True)
        data = tmp / "data.jsonl"
        (write_short if a.unit == "short" else write_pile)(data, a.tokens, 50304)
        settings = Settings(unit="sentence" if a.unit == "sentence" else "document",
                            max_length=128 if a.unit == "short" else 512)
        loaded = load(resolve_model(str(model)), "main", torch.float32, "cpu")
        to_compute(loaded, torch.float32, "cpu")
        base = get_module(loaded.model, loaded.layout.base)
        kwargs = forward_kwargs(loaded.layout.head)

        def make():
            splitter = SentenceSplitter() if settings.unit == "sentence" else None
            texts = indexed_documents(parse_source(f"bench={data}"), settings.shard, ReadStats())
            return batches(loaded, windows(loaded, texts, settings, SourceResult("bench"), splitter),
                           *batch_limits(loaded, settings))

        def loop(ahead: int, interval: float, busy: bool = False) -> tuple[float, float]:
            old = Prefetch.SWITCH_INTERVAL, sys.getswitchinterval()
            Prefetch.SWITCH_INTERVAL = interval
            stop = threading.Event()
            other = threading.Thread(target=lambda: [None for _ in itertools.takewhile(
                lambda _: not stop.is_set(), itertools.chain.from_iterable(make() for _ in itertools.count()))])
            if busy:
                sys.setswitchinterval(interval)
                other.start()
            try:
                t, c = time.perf_counter(), time.thread_time()
                with torch.inference_mode(), Prefetch(make, "cpu", ahead) as batches_made:
                    for input_ids, mask, _, _ in batches_made:
                        base(input_ids=input_ids, attention_mask=mask, **kwargs)
                return time.perf_counter() - t, time.thread_time() - c
            finally:
                stop.set()
                if busy:
                    other.join()
                Prefetch.SWITCH_INTERVAL = old[0]
                sys.setswitchinterval(old[1])

        modes = {"inline (prefetch 0)": (0, 5e-3), "thread, switch 5 ms": (4, 5e-3),
                 f"thread, switch {Prefetch.SWITCH_INTERVAL * 1e3:g} ms": (4, Prefetch.SWITCH_INTERVAL)}
        if a.busy:
            modes.update({"busy beside, switch 5 ms": (0, 5e-3, True),
                          f"busy beside, switch {Prefetch.SWITCH_INTERVAL * 1e3:g} ms": (0, Prefetch.SWITCH_INTERVAL, True)})
        loop(0, 5e-3)  # warm-up
        got = {m: [] for m in modes}
        for _ in range(a.runs):
            for m, how in modes.items():
                got[m].append(loop(*how))
        print(f"{time.strftime('%Y-%m-%d %H:%M')}, unit {a.unit}, ~{a.tokens} tokens, {torch.get_num_threads()} "
              f"intra-op thread(s), medians of {a.runs}")
        for m, runs in got.items():
            wall = statistics.median(w for w, _ in runs)
            cpu = statistics.median(c for _, c in runs)
            print(f"  {m:24s} loop {wall:6.2f} s, main thread CPU {cpu:6.2f} s, waiting {wall - cpu:5.2f} s  "
                  f"(walls {', '.join(f'{w:.2f}' for w, _ in runs)})")


if __name__ == "__main__":
    main()
