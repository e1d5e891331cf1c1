"""Benchmark matrix: the whole `cli.py extract` process on the shapes users run, against a bare
forward over identical batches.

One random GPT-NeoX (hidden 512, 6 layers, vocabulary 50,304; saved with save_pretrained, a
word-level tokenizer over 't0' … and '.') and three shapes of ~100k Zipf-distributed tokens:

* long      Pile-like JSONL (`text`, `meta.pile_set_name`), documents of ~500 tokens made of
            sentences of 4–28 words and a '.', `--unit document --max-length 512`;
* sentence  the same file, `--unit sentence` (pysbd splits; the paper's unit);
* short     documents of 20–100 tokens, `--max-length 128`.

Each shape runs three whole processes, alternating, `--runs` times: the default pass, `--no-moments`,
and `bench/bare_forward.py` (same loader, windows and batches; the base model's forward alone).
Printed per shape (medians): wall seconds, default ÷ --no-moments, --no-moments ÷ bare,
default ÷ bare, tokens/s of the whole process, peak RSS; the same ratios of the forward loops alone
(the per-token cost, without the per-checkpoint fixed costs); then sentence ÷ long in tokens/s.

    python bench/bench_matrix.py                       # ~100k tokens per shape, 2 runs of each variant
    python bench/bench_matrix.py --tokens 20000 --runs 1 --shapes short sentence
    python bench/bench_matrix.py --extra=--batch-size --extra=32     # any extract flags, all shapes
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


def run(variant: str, model: Path, source: Path, flags: list[str], wh: Path) -> dict:
    """One whole process: wall seconds, peak RSS (GB), tokens, forward-loop seconds."""
    if variant == "bare":
        script, args = ROOT / "bench" / "bare_forward.py", [str(model), str(source), *flags]
    else:
        script = ROOT / "cli.py"
        args = ["extract", "--model", str(model), "--source", f"bench={source}", "--warehouse", str(wh), *flags,
                *([variant] if variant != "default" else [])]
    seconds, gb, p = run_script(script, *args)
    if p.returncode:
        sys.exit(f"{variant} failed:\n{p.stderr[-3000:]}")
    text = p.stdout + p.stderr
    if variant == "bare":
        m = re.search(r"bare: (\d+) tokens, (\d+) windows, (\d+) batches, ([0-9.]+) s", text)
        tokens, loop = int(m.group(1)), float(m.group(4))
    else:
        m = re.search(r": (\d+) tokens, \d+ documents, .* non-finite, ([0-9.]+) s \(", text)
        tokens, loop = int(m.group(1)), float(m.group(2))
    return {"s": seconds, "gb": gb, "tokens": tokens, "loop": loop}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--runs", type=int, default=2, help="runs of each variant (alternating)")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS),
                    help="default, bare, or an extract flag without its dashes (no-moments, sequences, …)")
    ap.add_argument("--extra", action="append", default=[], help="more extract flags (all shapes, bare included)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=50304)
    args = ap.parse_args()
    args.variants = [v if v in ("default", "bare") or v.startswith("--") else "--" + v for v in args.variants]
    # any other variant is an extract flag (e.g. sequences, prompt-entropy), run in place of the default
    args.arch, args.intermediate, args.kv_heads, args.seq = "gpt_neox", None, None, 512
    import os

    print(f"{time.strftime('%Y-%m-%d %H:%M')}: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, "
          f"~{args.tokens} tokens per shape, {args.runs} run(s), {os.cpu_count()} cores; extra flags {args.extra}",
          flush=True)
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
                for v in (args.variants if i % 2 == 0 else args.variants[::-1]):
                    r = run(v, model, corpora[corpus], flags, tmp / f"wh-{shape}-{v}-{i}")
                    res[shape][v].append(r)
                    print(f"  {shape:9s} {v:13s} {r['s']:6.1f} s (loop {r['loop']:5.1f} s), {r['tokens']} tokens, "
                          f"{r['gb']:.2f} GB", flush=True)
        med = lambda shape, v, k: statistics.median(r[k] for r in res[shape][v])  # noqa: E731
        print(f"\n{'shape':9s} {'tokens':>7s} " + " ".join(f"{v + ' s':>15s}" for v in args.variants) +
              "  def/no-mom  no-mom/bare  def/bare  def tok/s  bare tok/s  def GB  bare GB")
        tps = {}
        for shape in args.shapes:
            t = {v: med(shape, v, "s") for v in args.variants}
            tokens = res[shape][args.variants[0]][0]["tokens"]
            ratio = lambda a, b: f"{t[a] / t[b]:10.3f}" if a in t and b in t else f"{'-':>10s}"  # noqa: E731
            tps[shape] = {v: tokens / t[v] for v in t}
            gb = lambda v: f"{med(shape, v, 'gb'):7.2f}" if v in t else f"{'-':>7s}"  # noqa: E731
            tp = lambda v: f"{tps[shape][v]:10.0f}" if v in t else f"{'-':>10s}"  # noqa: E731
            print(f"{shape:9s} {tokens:7d} " + " ".join(f"{t[v]:15.1f}" for v in args.variants) +
                  f"  {ratio('default', '--no-moments')}  {ratio('--no-moments', 'bare'):>11s}  {ratio('default', 'bare'):>8s}"
                  f"  {tp('default'):>9s}  {tp('bare'):>10s}  {gb('default')}  {gb('bare')}")
        for shape in args.shapes:  # the forward loops alone: per-token cost, the per-checkpoint fixed costs left out
            lp = {v: med(shape, v, "loop") for v in args.variants}
            print(f"{shape}: forward loop " + ", ".join(
                f"{a} ÷ {b} {lp[a] / lp[b]:.3f}" for a, b in (("default", "--no-moments"), ("default", "bare"),
                                                               ("--no-moments", "bare")) if a in lp and b in lp))
        if "long" in tps and "sentence" in tps:
            for v in args.variants:
                print(f"sentence ÷ long, tokens/s ({v}): {tps['sentence'][v] / tps['long'][v]:.3f}")
        runs = {s: {v: [round(r["s"] / res[s]["bare"][i]["s"], 3) for i, r in enumerate(res[s][v])]
                    for v in args.variants if v != "bare"} for s in args.shapes if "bare" in args.variants}
        if runs:
            print(f"run by run, ÷ bare: {runs}")
        base = "default" if "default" in args.variants else args.variants[0]
        for shape in args.shapes:
            for v in args.variants:
                if v in (base, "bare"):
                    continue
                t = {u: med(shape, u, "s") for u in args.variants}
                print(f"{shape}: {v} ÷ {base} {t[v] / t[base]:.3f} (run by run "
                      f"{[round(a['s'] / b['s'], 3) for a, b in zip(res[shape][v], res[shape][base])]})")


if __name__ == "__main__":
    main()
