"""Benchmark: extraction (hooks + float64 unit-vector sums) against a bare forward pass.

Both run over the *same* pre-built batches in one process, interleaved batch by batch
(bare, extract, bare, extract, ...) so that clock drift and thermal effects hit both alike.
The model is a random GPT-NeoX saved with save_pretrained and loaded back through the same
path a user's model takes; token ids follow a Zipf law over the vocabulary (s = 1.1), like text.

    python bench/bench_extract.py                       # the CPU target: hidden 512, 6 layers, vocab 50k
    python bench/bench_extract.py --device cuda --dtype bfloat16 --hidden 2048 --layers 24 --batch 16 --seq 2048

Prints tokens/s for both, the ratio (extract time / bare time), the one-off write time and the
bytes written per checkpoint for this model and token count.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from extract.accumulate import Moments, Sample, TokenSums  # noqa: E402
from extract.architectures import get_module  # noqa: E402
from extract.hooks import capture_layers, layer_kinds  # noqa: E402
from extract.models import DTYPES, load, resolve_model  # noqa: E402


def build_model(directory: Path, args) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, GPTNeoXConfig, PreTrainedTokenizerFast

    config = GPTNeoXConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                           num_attention_heads=args.hidden // 64, intermediate_size=4 * args.hidden,
                           max_position_embeddings=max(2048, args.seq), tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    vocab = {f"t{i}": i for i in range(args.vocab)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0").save_pretrained(directory)
    return directory


def zipf_batches(args) -> list[torch.Tensor]:
    rng = np.random.default_rng(0)
    ranks = np.arange(1, args.vocab + 1)
    p = ranks ** -1.1
    p /= p.sum()
    perm = rng.permutation(args.vocab)
    return [torch.tensor(perm[rng.choice(args.vocab, size=(args.batch, args.seq), p=p)])
            for _ in range(args.batches)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2, help="passes over the batches")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=list(DTYPES))
    ap.add_argument("--moments", action="store_true", help="also accumulate Σh, Σhhᵀ and cross moments")
    ap.add_argument("--sample", type=int, default=0, help="also keep a bottom-k sample of K vectors per layer")
    ap.add_argument("--write", action=argparse.BooleanOptionalAction, default=True,
                    help="also time writing the sums and report bytes per checkpoint")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="isobench-"))
    try:
        build_model(tmp / "model", args)
        loaded = load(resolve_model(str(tmp / "model")), "main", DTYPES[args.dtype], args.device)
        loaded.model.to(args.device, DTYPES[args.dtype])
        fam, model = loaded.family, loaded.model
        base = get_module(model, fam.base)
        kinds = layer_kinds(model, fam)
        batches = [b.to(args.device) for b in zipf_batches(args)]
        mask = torch.ones_like(batches[0])
        counted = torch.ones_like(batches[0], dtype=torch.bool)
        acc = TokenSums(len(kinds), args.vocab, args.hidden, args.device)
        if args.moments:
            acc.moments = Moments(len(kinds), args.hidden, args.device)
        if args.sample:
            acc.sample = Sample(len(kinds), args.sample, args.hidden)
        rng = np.random.default_rng(1)
        sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)

        def bare(ids):
            base(input_ids=ids, attention_mask=mask, use_cache=False)

        def extract(ids):
            acc.set_batch(ids, counted)
            if acc.sample is not None:
                m = ids.numel()
                acc.sample.set_batch(torch.from_numpy(rng.integers(0, 2**62, m)), torch.zeros(m, 3, dtype=torch.long))
            with capture_layers(model, fam, acc.add):
                base(input_ids=ids, attention_mask=mask, use_cache=False)

        t_bare = t_ext = 0.0
        with torch.inference_mode():
            bare(batches[0])  # warm-up both paths
            extract(batches[0])
            for _ in range(args.repeats):
                for ids in batches:
                    for fn in (bare, extract):
                        sync()
                        t0 = time.perf_counter()
                        fn(ids)
                        sync()
                        dt = time.perf_counter() - t0
                        if fn is bare:
                            t_bare += dt
                        else:
                            t_ext += dt
        tokens = args.repeats * args.batches * args.batch * args.seq
        print(f"model: GPT-NeoX hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; "
              f"{args.device} {args.dtype}; threads {torch.get_num_threads()}; "
              f"moments {'on' if args.moments else 'off'}, sample {args.sample}")
        print(f"batches: {args.batches} x ({args.batch} x {args.seq}) tokens, {args.repeats} passes, {tokens} tokens each")
        print(f"bare forward : {tokens / t_bare:10.0f} tok/s  ({t_bare:.2f} s)")
        print(f"extraction   : {tokens / t_ext:10.0f} tok/s  ({t_ext:.2f} s)")
        print(f"ratio (extraction time / bare time): {t_ext / t_bare:.3f}")
        if args.write:
            from extract.run import Settings, write_sums
            from extract.sources import Source

            for vdt in ("float32", "float16"):
                settings = Settings(device=args.device, vector_dtype=vdt)
                t0 = time.perf_counter()
                files = write_sums(tmp / f"wh-{vdt}", loaded, Source("bench", tmp), settings, acc, "bench")
                dt = time.perf_counter() - t0
                size = sum((tmp / f"wh-{vdt}" / f).stat().st_size for f in files.values())
                types = int((acc.counts[0] > 0).sum())
                print(f"write ({vdt} vectors): {dt:.2f} s, {size / 2**20:.1f} MiB for {len(kinds)} layers x "
                      f"{types} token types ({size / (len(kinds) * types):.0f} B per (layer, token); "
                      f"{4 * args.hidden if vdt == 'float32' else 2 * args.hidden} B of it the vector)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
