"""The per-head attention sums' cost (--attention, and the opt-in --attention-moments and
--attention-sinks) in the default pass, measured batch by batch, interleaved: the same batches of
the benchmark matrix's three shapes (bench_matrix.py: a random GPT-NeoX, hidden 512, 6 layers, 8
heads, vocabulary 50,304; long documents at --max-length 512, sentences, short documents at 128)
go through the extract pass (`new_accumulator` + `forward_batch`: token sums, moments, the hooks)
without and with the attention sums, alternating which goes first, so a loaded machine's drift hits
both alike.  Printed per shape: the median and total of the per-batch CPU-time and wall-time ratios
(with ÷ without), and the CPU time spent inside the attention sums themselves (their `add`, timed on
the forward's thread) as a share of the pass without them: on a loaded machine the ratios wander by
±10 %, the share inside much less.  For the whole process use `bench_matrix.py --variants default attention`.

    python bench/bench_attention.py                         # ~30k tokens per shape
    python bench/bench_attention.py --tokens 10000 --variants attention attention-sinks
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_extract import build_model  # noqa: E402
from bench_matrix import write_pile, write_short  # noqa: E402

SHAPES = {"long": ("pile", "document", 512), "sentence": ("pile", "sentence", 512), "short": ("short", "document", 128)}
VARIANTS = {"attention": {"attention": True},
            "attention-moments": {"attention": True, "attention_moments": True},
            "attention-sinks": {"attention": True, "attention_sinks": True}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=30_000)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--variants", nargs="+", default=["attention"], choices=list(VARIANTS))
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=50304)
    args = ap.parse_args()
    args.arch, args.intermediate, args.kv_heads, args.seq = "gpt_neox", None, None, 512

    import torch

    from extract.attention import capture_attention
    from extract.hooks import capture_layers
    from extract.models import load, resolve_model, to_compute
    from extract.run.settings import Settings, SourceResult
    from extract.run.stream import attention_for, base_forward, forward_batch, new_accumulator
    from extract.run.windows import batch_limits, batches, windows
    from extract.sentences import SentenceSplitter
    from extract.sources import ReadStats, indexed_documents, parse_source

    with tempfile.TemporaryDirectory(prefix="isobench-attention-") as tmp:
        tmp = Path(tmp)
        model = build_model(tmp / "model", args, punctuation=True)
        corpora = {"pile": tmp / "pile.jsonl", "short": tmp / "short.jsonl"}
        write_pile(corpora["pile"], args.tokens, args.vocab)
        write_short(corpora["short"], args.tokens, args.vocab)
        loaded = load(resolve_model(str(model)), "main", torch.float32, "cpu")
        to_compute(loaded, torch.float32, "cpu")
        print(f"{time.strftime('%Y-%m-%d %H:%M')}: hidden {args.hidden}, {args.layers} layers, "
              f"{torch.get_num_threads()} threads, ~{args.tokens} tokens per shape", flush=True)
        for shape in args.shapes:
            corpus, unit, max_length = SHAPES[shape]
            base = Settings(unit=unit, max_length=max_length, max_tokens=args.tokens, attention=False)
            splitter = SentenceSplitter() if unit == "sentence" else None
            texts = indexed_documents(parse_source(f"bench={corpora[corpus]}"), (1, 1), ReadStats())
            made = list(batches(loaded, windows(loaded, texts, base, SourceResult("b"), splitter),
                                *batch_limits(loaded, base)))
            for name in args.variants:
                runs = {"off": base, "on": replace(base, **VARIANTS[name])}
                accs = {k: new_accumulator(loaded, s, 1 << 30) for k, s in runs.items()}
                plans = {k: attention_for(loaded, s) for k, s in runs.items()}
                forward = base_forward(loaded, base)
                cpu = {"off": [], "on": []}
                wall = {"off": [], "on": []}
                inside = [0.0]  # CPU seconds of the forward's thread inside the attention sums (`add`)
                own = accs["on"].attention
                if own is not None:
                    inner = own.add

                    def timed(*a, inner=inner):
                        t = time.thread_time()
                        inner(*a)
                        inside[0] += time.thread_time() - t
                    own.add = timed
                for i, batch in enumerate(made * 2):  # every batch twice: the first pass warms up
                    if i == len(made):
                        inside[0] = 0.0
                    for k in (("off", "on") if i % 2 == 0 else ("on", "off")):
                        acc = accs[k]
                        c, w = time.process_time(), time.perf_counter()
                        with torch.inference_mode(), capture_layers(loaded.model, loaded.layout, acc.add), \
                                capture_attention(plans[k], acc.attention.add if acc.attention is not None else None):
                            forward_batch(forward, acc, batch, 0, SourceResult("b"))
                            if acc.moments is not None:
                                acc.moments.finish()
                        if i >= len(made):
                            cpu[k].append(time.process_time() - c)
                            wall[k].append(time.perf_counter() - w)
                for acc in accs.values():
                    acc.close()
                ratio = lambda t: (statistics.median(a / b for a, b in zip(t["on"], t["off"])),  # noqa: E731
                                   sum(t["on"]) / sum(t["off"]))
                tokens = sum(int(b[2].sum()) for b in made)
                print(f"{shape:9s} {name:18s} {len(made):4d} batches, {tokens} tokens: CPU on ÷ off median "
                      f"{ratio(cpu)[0]:.3f}, total {ratio(cpu)[1]:.3f}; wall median {ratio(wall)[0]:.3f}, total "
                      f"{ratio(wall)[1]:.3f} (off {sum(wall['off']):.1f} s); inside the attention sums "
                      f"{inside[0]:.2f} CPU s = {inside[0] / sum(cpu['off']):.3f} of the pass without them", flush=True)


if __name__ == "__main__":
    main()
