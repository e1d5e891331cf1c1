"""Benchmark matrix: the whole `cli.py extract` process on the shapes users run, against a bare
forward over identical batches.

One random GPT-NeoX (hidden 512, 6 layers, vocabulary 50,304; saved with save_pretrained, a
word-level tokenizer over 't0' … and '.') and three shapes of ~100k Zipf-distributed tokens:

* long      Pile-like JSONL (`text`, `meta.pile_set_name`), documents of ~500 tokens made of
            sentences of 4–28 words and a '.', `--unit document --max-length 512`;
* sentence  the same file, `--unit sentence` (pysbd splits; the paper's unit);
* short     documents of 20–100 tokens, `--max-length 128`.

Each shape runs its variants as whole processes, alternating, `--runs` times: by default the default
pass, `--no-moments` and `bench/bare_forward.py` (same loader, windows and batches; the base model's
forward alone); any variant may carry environment variables (`default@ISO_MOMENTS_WORKER=inline`),
and `--threads` runs the thread budget's variants (THREAD_VARIANTS) in one command.  Printed per
shape and variant (medians): wall, forward-loop and CPU seconds (user + system, all threads: what
oversubscription burns shows here even on a shared machine), each ÷ the bare forward under the same
OMP_NUM_THREADS, tokens/s of the whole process, peak RSS; then sentence ÷ long in tokens/s, and
the ratios run by run.  The load average is printed with every run: on a shared machine compare
CPU seconds, and wall ratios only from one quiet hour.  A parameter-tables cache of the run's own
(ISO_PARAMS_CACHE in a temporary folder) is filled by the first extract, as a user's is.

    python bench/bench_matrix.py                       # ~100k tokens per shape, 2 runs of each variant
    python bench/bench_matrix.py --tokens 20000 --runs 1 --shapes short sentence
    python bench/bench_matrix.py --extra=--batch-size --extra=32     # any extract flags, all shapes
    python bench/bench_matrix.py --threads --tokens 100000 --runs 2  # every thread-budget variant
    python bench/bench_matrix.py --variants bare default default@ISO_MOMENTS_WORKER=inline
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_extract import build_model  # noqa: E402
from measure import run_script  # noqa: E402

SHAPES = {
    "long": ("pile", ["--max-length", "512"]),
    "sentence": ("pile", ["--max-length", "512", "--unit", "sentence"]),
    "short": ("short", ["--max-length", "128"]),
}
VARIANTS = ("default", "--no-moments", "bare")  # run by default; also: --no-sequences


def _zipf(vocab: int, rng: np.random.Generator):
    ranks = np.arange(1, vocab + 1, dtype=np.float64)
    p = ranks ** -1.1
    p /= p.sum()
    perm = rng.permutation(vocab)
    return lambda k: perm[rng.choice(vocab, size=k, p=p)]


def write_pile(path: Path, tokens: int, vocab: int, doc_len: int = 500) -> None:
    """Documents of ~doc_len tokens: sentences of 4–28 word tokens, each ending in '.'."""
    rng = np.random.default_rng(0)
    draw = _zipf(vocab - 1, rng)  # the last id is '.'
    with open(path, "w") as f:
        for _ in range(max(1, tokens // doc_len)):
            sentences, n = [], 0
            while n < doc_len:
                k = int(rng.integers(4, 29))
                sentences.append(" ".join(f"t{i}" for i in draw(k)) + ".")
                n += k + 1
            f.write(json.dumps({"text": " ".join(sentences), "meta": {"pile_set_name": "Bench"}}) + "\n")


def write_short(path: Path, tokens: int, vocab: int) -> None:
    """Documents of 20–100 tokens (uniform)."""
    rng = np.random.default_rng(1)
    draw = _zipf(vocab - 1, rng)
    n = 0
    with open(path, "w") as f:
        while n < tokens:
            k = int(rng.integers(20, 101))
            f.write(json.dumps({"text": " ".join(f"t{i}" for i in draw(k))}) + "\n")
            n += k


# The thread budget's variants (docs/performance.md, "Threads"): where the moments run (the crew by default,
# the background thread, inline), the thread's intra-op threads, batches made ahead, and the one-thread
# reference (CPU time without contention).
THREAD_VARIANTS = (
    "bare", "default", "no-moments",
    "default@ISO_MOMENTS_WORKER=inline", "default@ISO_MOMENTS_WORKER=thread",
    "default@ISO_MOMENTS_WORKER=thread,ISO_WORKER_THREADS=2", "default@ISO_PREFETCH=0",
    "default@ISO_MOMENTS_WORKER=inline,ISO_PREFETCH=0", "default@ISO_PARAMS_CACHE=off",
    "bare@OMP_NUM_THREADS=1", "default@OMP_NUM_THREADS=1",
)


def parse_variant(v: str) -> tuple[str, dict[str, str]]:
    """'default', 'bare', an extract flag ('no-moments', '--sequences'), each optionally followed by
    '@NAME=VALUE,NAME=VALUE' — environment variables set for that process alone."""
    base, _, env = v.partition("@")
    if base not in ("default", "bare") and not base.startswith("--"):
        base = "--" + base
    return base, dict(kv.split("=", 1) for kv in env.split(",") if kv)


def reference(v: str, variants: list[str]) -> str | None:
    """The bare forward a variant is compared with: the one under the same OMP_NUM_THREADS."""
    _, env = parse_variant(v)
    omp = env.get("OMP_NUM_THREADS")
    want = "bare" + (f"@OMP_NUM_THREADS={omp}" if omp else "")
    return want if want in variants else ("bare" if "bare" in variants else None)


def run(variant: str, model: Path, source: Path, flags: list[str], wh: Path, cache: Path) -> dict:
    """One whole process: wall seconds, CPU seconds (all threads), peak RSS (GB), tokens, forward-loop seconds."""
    base, env = parse_variant(variant)
    env = {"ISO_PARAMS_CACHE": str(cache), **env}  # this benchmark's own cache (a run's first process fills it)
    if base == "bare":
        script, args = ROOT / "bench" / "bare_forward.py", [str(model), str(source), *flags]
    else:
        script = ROOT / "cli.py"
        args = ["extract", "--model", str(model), "--source", f"bench={source}", "--warehouse", str(wh), *flags,
                *([base] if base != "default" else [])]
    seconds, gb, p = run_script(script, *args, env=env)
    if p.returncode:
        sys.exit(f"{variant} failed:\n{p.stderr[-3000:]}")
    text = p.stdout + p.stderr
    if base == "bare":
        m = re.search(r"bare: (\d+) tokens, (\d+) windows, (\d+) batches, ([0-9.]+) s", text)
        tokens, loop = int(m.group(1)), float(m.group(4))
    else:
        m = re.search(r": (\d+) tokens, \d+ documents, .* non-finite, ([0-9.]+) s \(", text)
        tokens, loop = int(m.group(1)), float(m.group(2))
    return {"s": seconds, "cpu": p.cpu_seconds, "gb": gb, "tokens": tokens, "loop": loop}


def load_line() -> str:
    try:
        return "load average " + " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "load average unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--runs", type=int, default=2, help="runs of each variant (alternating)")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS),
                    help="default, bare, or an extract flag without its dashes (no-moments, sequences, …), each "
                         "optionally with @NAME=VALUE[,NAME=VALUE] environment variables (e.g. "
                         "default@ISO_MOMENTS_WORKER=inline, bare@OMP_NUM_THREADS=1)")
    ap.add_argument("--threads", action="store_true",
                    help="the thread budget's variants (THREAD_VARIANTS) in place of --variants")
    ap.add_argument("--extra", action="append", default=[], help="more extract flags (all shapes, bare included)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=50304)
    args = ap.parse_args()
    if args.threads:
        args.variants = list(THREAD_VARIANTS)
    args.variants = [v if "@" in v or v in ("default", "bare") or v.startswith("--") else "--" + v
                     for v in args.variants]
    # any other variant is an extract flag (e.g. sequences, prompt-entropy), run in place of the default
    args.arch, args.intermediate, args.kv_heads, args.seq = "gpt_neox", None, None, 512
    import os

    print(f"{time.strftime('%Y-%m-%d %H:%M')}: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, "
          f"~{args.tokens} tokens per shape, {args.runs} run(s), {os.cpu_count()} cores, {load_line()}; "
          f"extra flags {args.extra}", flush=True)
    with tempfile.TemporaryDirectory(prefix="isobench-matrix-") as tmp:
        tmp = Path(tmp)
        model = build_model(tmp / "model", args, punctuation=True)
        corpora = {"pile": tmp / "pile.jsonl", "short": tmp / "short.jsonl"}
        write_pile(corpora["pile"], args.tokens, args.vocab)
        write_short(corpora["short"], args.tokens, args.vocab)
        res = {s: {v: [] for v in args.variants} for s in args.shapes}
        for i in range(args.runs):
            for shape in args.shapes:
                corpus, flags = SHAPES[shape]
                flags = flags + args.extra
                for k, v in enumerate(args.variants if i % 2 == 0 else args.variants[::-1]):
                    r = run(v, model, corpora[corpus], flags, tmp / f"wh-{shape}-{k}-{i}", tmp / "params-cache")
                    res[shape][v].append(r)
                    print(f"  {shape:9s} {v:48s} {r['s']:6.1f} s (loop {r['loop']:5.1f} s, CPU {r['cpu']:6.1f} s), "
                          f"{r['tokens']} tokens, {r['gb']:.2f} GB, {load_line()}", flush=True)
        med = lambda shape, v, k: statistics.median(r[k] for r in res[shape][v])  # noqa: E731
        print(f"\n{'shape':9s} {'variant':48s} {'wall s':>7s} {'loop s':>7s} {'CPU s':>7s}  {'÷bare whole':>11s} "
              f"{'÷bare loop':>10s} {'÷bare CPU':>9s}  {'tok/s':>7s} {'GB':>5s}")
        tps = {}
        for shape in args.shapes:
            tokens = res[shape][args.variants[0]][0]["tokens"]
            tps[shape] = {v: tokens / med(shape, v, "s") for v in args.variants}
            for v in args.variants:
                ref = reference(v, args.variants)
                ratio = lambda k: (f"{med(shape, v, k) / med(shape, ref, k):.3f}" if ref else "-")  # noqa: E731
                print(f"{shape:9s} {v:48s} {med(shape, v, 's'):7.1f} {med(shape, v, 'loop'):7.1f} "
                      f"{med(shape, v, 'cpu'):7.1f}  {ratio('s'):>11s} {ratio('loop'):>10s} {ratio('cpu'):>9s}  "
                      f"{tps[shape][v]:7.0f} {med(shape, v, 'gb'):5.2f}")
        for shape in args.shapes:  # the forward loops alone: per-token cost, the per-checkpoint fixed costs left out
            if "default" in args.variants and "--no-moments" in args.variants and "bare" in args.variants:
                lp = {v: med(shape, v, "loop") for v in ("default", "--no-moments", "bare")}
                print(f"{shape}: forward loop " + ", ".join(
                    f"{a} ÷ {b} {lp[a] / lp[b]:.3f}" for a, b in (("default", "--no-moments"), ("default", "bare"),
                                                                   ("--no-moments", "bare"))))
        if "long" in tps and "sentence" in tps:
            for v in args.variants:
                print(f"sentence ÷ long, tokens/s ({v}): {tps['sentence'][v] / tps['long'][v]:.3f}")
        for shape in args.shapes:  # run by run, each against the bare run of the same round (alternating order)
            for v in args.variants:
                ref = reference(v, args.variants)
                if ref is None or v == ref:
                    continue
                print(f"{shape}: {v} ÷ {ref} run by run: whole "
                      f"{[round(a['s'] / b['s'], 3) for a, b in zip(res[shape][v], res[shape][ref])]}, loop "
                      f"{[round(a['loop'] / b['loop'], 3) for a, b in zip(res[shape][v], res[shape][ref])]}")
        print(load_line())


if __name__ == "__main__":
    main()
