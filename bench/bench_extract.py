"""Benchmark: extraction (hooks + float64 unit-vector sums) against a bare forward pass.

Both run over the *same* pre-built batches in one process, interleaved batch by batch
(bare, extract, bare, extract, ...) so that clock drift and thermal effects hit both alike.
The model is a random GPT-NeoX saved with save_pretrained and loaded back through the same
path a user's model takes; token ids follow a Zipf law over the vocabulary (s = 1.1), like text.

    python bench/bench_extract.py                       # the CPU target: hidden 512, 6 layers, vocab 50k
    python bench/bench_extract.py --device cuda --dtype bfloat16 --hidden 2048 --layers 24 --batch 8 --seq 2048
    # a Llama-3-8B shape (128k vocabulary), built on the GPU directly (--direct: no save/load round trip)
    python bench/bench_extract.py --arch llama --device cuda --dtype bfloat16 --hidden 4096 --layers 32 \
        --intermediate 14336 --kv-heads 8 --vocab 128256 --batch 4 --seq 2048 --direct --no-write

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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.openmp import short_spin  # noqa: E402

short_spin()  # as the command line does, before torch loads its OpenMP runtime

import numpy as np  # noqa: E402
import torch  # noqa: E402

from extract.accumulate.moments import PRECISIONS, Moments  # noqa: E402
from bench.moments_variants import VARIANTS  # noqa: E402
from extract.accumulate.sample import Sample  # noqa: E402
from extract.accumulate.sums import TokenSums  # noqa: E402
from extract.architectures import discover, get_module  # noqa: E402
from extract.hooks import capture_layers, layer_kinds  # noqa: E402
from extract.models import DTYPES, forward_kwargs, load, resolve_model, to_compute  # noqa: E402


def make_config(args):
    from transformers import GPTNeoXConfig, LlamaConfig

    common = dict(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                  num_attention_heads=args.hidden // 64, max_position_embeddings=max(2048, args.seq),
                  tie_word_embeddings=False)
    if args.arch == "llama":
        return LlamaConfig(intermediate_size=args.intermediate or int(3.5 * args.hidden),
                           num_key_value_heads=args.kv_heads or args.hidden // 64, **common)
    return GPTNeoXConfig(intermediate_size=args.intermediate or 4 * args.hidden, **common)


def build_model(directory: Path, args, punctuation: bool = False) -> Path:
    """A random model saved with save_pretrained and a word-level tokenizer over 't0' … (with
    `punctuation`, the last id is '.', so that text can be split into sentences)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(make_config(args)).save_pretrained(directory)
    vocab = {f"t{i}": i for i in range(args.vocab - punctuation)}
    if punctuation:
        vocab["."] = args.vocab - 1
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


def moments_error(m, exact, L: int, precision: str) -> None:
    """Per layer: covariance entries (max |Δ| / max |C|), eigenvalues (max |Δ| / λ_max) and cross
    moments against float64 products of the same hidden states."""
    n = exact.n.cpu().numpy().astype(np.float64)
    s1, s1x = m.s1.cpu().numpy(), exact.s1.cpu().numpy()
    worst = {"cov": 0.0, "eig": 0.0, "cross": 0.0}
    for layer in range(L):
        mu, mux = s1[layer] / n[layer], s1x[layer] / n[layer]
        c, cx = m.s2(layer) / n[layer] - np.outer(mu, mu), exact.s2(layer) / n[layer] - np.outer(mux, mux)
        worst["cov"] = max(worst["cov"], np.abs(c - cx).max() / np.abs(cx).max())
        e, ex = np.linalg.eigvalsh(c), np.linalg.eigvalsh(cx)
        worst["eig"] = max(worst["eig"], np.abs(e - ex).max() / ex.max())
        if layer < L - 1 and m.has_cross:
            x, xx = m.cross(layer), exact.cross(layer)
            worst["cross"] = max(worst["cross"], np.abs(x - xx).max() / np.abs(xx).max())
    print(f"moments {precision} against float64 products of the same hidden states (worst layer): covariance "
          f"entries {worst['cov']:.1e}, eigenvalues {worst['eig']:.1e} of λ_max, cross moments {worst['cross']:.1e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="gpt_neox", choices=["gpt_neox", "llama"])
    ap.add_argument("--intermediate", type=int, default=None)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--direct", action="store_true",
                    help="build the random model on the device in --dtype (no save/load round trip; big shapes)")
    ap.add_argument("--budget", type=float, default=None, help="accumulator memory budget in GiB (spills beyond)")
    ap.add_argument("--profile", action="store_true", help="print the top kernels of one extraction batch")
    ap.add_argument("--fused", action=argparse.BooleanOptionalAction, default=None,
                    help="compiled layer step (default: on for cuda)")
    ap.add_argument("--triton", action=argparse.BooleanOptionalAction, default=None,
                    help="the Triton token-sum kernels (extract/accumulate/fused.py), which add every sum of the "
                         "default pass; --no-triton: the compiled step instead; default: as extract (on for cuda)")
    ap.add_argument("--split-all", action="store_true",
                    help="bf16 moments: every layer's rows centred and split into hi + lo (a trained model's "
                         "mean-dominated layers; random weights take the raw rows)")
    ap.add_argument("--moments-chunk", type=int, default=None,
                    help="bf16 moments: rows per product (Moments.CHUNK_BF16; fewer: a smaller error, more launches)")
    ap.add_argument("--moments-variant", default="lean", choices=list(VARIANTS),
                    help="bf16 moments: the default path (lean: on a GPU gram.py's kernel) or bench/moments_variants.py's "
                         "torch products or grouped products")
    ap.add_argument("--moments-panels", type=int, default=None,
                    help="bf16 moments: row panels of each product's upper triangle (Moments.PANELS; 1: full products)")
    ap.add_argument("--check", action="store_true",
                    help="also run the other path (fused vs eager) over the same batches and compare the sums")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2, help="passes over the batches")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=list(DTYPES))
    ap.add_argument("--moments", action="store_true", help="also accumulate Σh and Σhhᵀ (extract's default moments)")
    ap.add_argument("--cross-moments", action="store_true", help="with --moments: also Σ h_l h_{l+1}ᵀ (extract --cross-moments)")
    ap.add_argument("--moments-precision", default=None, choices=list(PRECISIONS),
                    help="default: bfloat16 on cuda with --dtype bfloat16 (as extract), else float32")
    ap.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                    help="moments off the forward's path: a thread on a CPU (default there), a side stream on cuda")
    ap.add_argument("--sample", type=int, default=0, help="also keep a bottom-k sample of K vectors per layer")
    ap.add_argument("--sequences", action="store_true", help="also the per-window measures (extract --sequences)")
    ap.add_argument("--write", action=argparse.BooleanOptionalAction, default=True,
                    help="also time writing the sums and report bytes per checkpoint")
    args = ap.parse_args()
    if args.moments_chunk:
        Moments.CHUNK_BF16 = args.moments_chunk
    if args.moments_panels:
        Moments.PANELS = args.moments_panels

    tmp = Path(tempfile.mkdtemp(prefix="isobench-"))
    acc = None
    try:
        t0 = time.perf_counter()
        if args.direct:
            from transformers import AutoModelForCausalLM

            torch.manual_seed(0)
            with torch.device(args.device):
                model = AutoModelForCausalLM.from_config(make_config(args), dtype=DTYPES[args.dtype]).eval()
            fam = discover(model, "causal", None, forward_kwargs("causal"))
            loaded = None
        else:
            build_model(tmp / "model", args)
            loaded = load(resolve_model(str(tmp / "model")), "main", DTYPES[args.dtype], args.device)
            to_compute(loaded, DTYPES[args.dtype], args.device)
            fam, model = loaded.layout, loaded.model
        print(f"model ready in {time.perf_counter() - t0:.1f} s; layout: blocks {fam.blocks}, final norm {fam.final_norm}")
        base = get_module(model, fam.base)
        kinds = layer_kinds(model, fam)
        host = zipf_batches(args)
        batches = [b.to(args.device) for b in host]
        mask = torch.ones_like(batches[0])
        counted = torch.ones_like(host[0], dtype=torch.bool)
        budget = int(args.budget * 2**30) if args.budget else None
        acc = TokenSums(len(kinds), args.vocab, args.hidden, args.device, budget=budget, fused=args.fused,
                        triton=args.triton)
        if args.triton:
            from extract.accumulate import fused as fused_kernels

            for name in set(acc.layer_sums()) - fused_kernels.FILLS:
                delattr(acc, name)  # sums the kernels do not add (none by default): dropped, so that they run
        if args.moments_precision is None:
            args.moments_precision = ("bfloat16" if args.device.startswith("cuda") and args.dtype == "bfloat16"
                                      else "float32")
        if args.moments:
            acc.moments = VARIANTS[args.moments_variant](len(kinds), args.hidden, args.device, cross=args.cross_moments,
                                                         precision=args.moments_precision, background=args.overlap)
            if args.split_all:
                acc.moments.SPLIT_RATIO = -1.0  # every layer's ‖μ‖²/tr C is above it
        if args.sample:
            acc.sample = Sample(len(kinds), args.sample, args.hidden)
        if args.sequences:
            from extract.sequences import WindowMeasures

            acc.extra = WindowMeasures(len(kinds), args.hidden, args.device, precision=args.moments_precision,
                                       worker=acc.moments._worker if acc.moments is not None else None)
        rng = np.random.default_rng(1)
        sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)

        seen = []  # batch indices extracted, in order (--check replays them)

        def bare(i):
            base(input_ids=batches[i], attention_mask=mask, use_cache=False)

        def extract(i, into=None):
            into = into or acc
            into.set_batch(host[i], counted)
            if into.sample is not None:
                m = host[i].numel()
                into.sample.set_batch(torch.from_numpy(rng.integers(0, 2**62, m)), torch.zeros(m, 3, dtype=torch.long))
            with capture_layers(model, fam, into.add):
                base(input_ids=batches[i], attention_mask=mask, use_cache=False)
            if into.moments is not None:  # the background thread's products belong to this batch's time:
                into.moments.finish()     # left queued, they would run during the next bare forward
            if into is acc:
                seen.append(i)

        t_bare = t_ext = c_bare = c_ext = 0.0  # wall and CPU seconds (process CPU: every thread)
        cuda = args.device.startswith("cuda")
        with torch.inference_mode():
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            bare(0)  # warm-up both paths
            sync()
            bare_peak = torch.cuda.max_memory_allocated() if cuda else 0
            extract(0)
            if args.profile:
                from torch.profiler import ProfilerActivity, profile

                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
                with profile(activities=acts) as prof:
                    extract(0)
                    sync()
                print(prof.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total",
                                                row_limit=15, max_name_column_width=50))
            for _ in range(args.repeats):
                for i in range(len(batches)):
                    for fn in (bare, extract):
                        sync()
                        t0, c0 = time.perf_counter(), time.process_time()
                        fn(i)
                        sync()
                        dt, dc = time.perf_counter() - t0, time.process_time() - c0
                        if fn is bare:
                            t_bare += dt
                            c_bare += dc
                        else:
                            t_ext += dt
                            c_ext += dc
        tokens = args.repeats * args.batches * args.batch * args.seq
        print(f"model: {args.arch} hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; "
              f"{args.device} {args.dtype}; threads {torch.get_num_threads()}; "
              f"moments {args.moments_precision if args.moments else 'off'} (overlap "
              f"{acc.moments is not None and acc.moments._worker is not None}), sample {args.sample}, "
              f"fused {acc._fused is not None}")
        print(f"batches: {args.batches} x ({args.batch} x {args.seq}) tokens, {args.repeats} passes, {tokens} tokens each")
        print(f"bare forward : {tokens / t_bare:10.0f} tok/s  ({t_bare:.2f} s)")
        print(f"extraction   : {tokens / t_ext:10.0f} tok/s  ({t_ext:.2f} s)")
        print(f"ratio (extraction time / bare time): {t_ext / t_bare:.3f}")
        print(f"CPU seconds (all threads): bare {c_bare:.2f}, extraction {c_ext:.2f}, ratio {c_ext / max(c_bare, 1e-9):.3f}; "
              f"load average {' '.join(open('/proc/loadavg').read().split()[:3]) if Path('/proc/loadavg').exists() else '?'}")
        print(f"paths: {acc.paths}" + (f", moments {acc.moments.paths}" if acc.moments is not None else ""))
        print(f"token types seen: {acc.used} (+{len(acc.spills)} spills); accumulator tables "
              f"{acc.table_bytes() / 2**30:.2f} GiB (peak {acc.peak_bytes / 2**30:.2f} GiB; dense would be "
              f"{len(kinds) * args.vocab * args.hidden * 8 / 2**30:.1f} GiB)")
        if cuda:
            print(f"GPU peak memory: bare forward {bare_peak / 2**30:.2f} GiB, with extraction "
                  f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
        if args.check:
            other = TokenSums(len(kinds), args.vocab, args.hidden, args.device, fused=acc._fused is None)
            if args.moments:  # the same hidden states' exact products: the precision of the moments
                other.moments = Moments(len(kinds), args.hidden, args.device, cross=args.cross_moments,
                                        precision="float64", background=False)
            with torch.inference_mode():
                for i in seen:  # the very batches `acc` saw, in order
                    extract(i, other)
            worst = 0.0
            for layer in range(len(kinds)):
                (ca, sa), (cb, sb) = acc.dense(layer), other.dense(layer)
                assert torch.equal(ca, cb)  # the same token types and counts
                worst = max(worst, float(((sa - sb).abs().amax(1) / sb.abs().amax(1).clamp_min(1.0)).max()))
            for name in ("sum_h", "sum_u2", "window_cos"):
                x, y = getattr(acc, name).double().cpu(), getattr(other, name).double().cpu()
                worst = max(worst, float(((x - y).abs().max() / y.abs().max().clamp_min(1.0))))
            assert torch.equal(acc.windows.cpu(), other.windows.cpu())
            print(f"check: fused {acc._fused is not None} vs {other._fused is not None}: same token types and counts, "
                  f"max relative |Δ| of Σû, Σh, Σû², window cosines = {worst:.2e}")
            if args.moments:
                moments_error(acc.moments, other.moments, len(kinds), args.moments_precision)
        if args.write and loaded is not None:
            from extract.run.settings import Settings
            from extract.run.tables import write_sums
            from extract.sources import Source

            for vdt in ("float32", "float16"):
                settings = Settings(device=args.device, vector_dtype=vdt)
                t0 = time.perf_counter()
                files, _ = write_sums(tmp / f"wh-{vdt}", loaded, Source("bench", tmp), settings, acc, "bench")
                dt = time.perf_counter() - t0
                size = sum((tmp / f"wh-{vdt}" / f).stat().st_size for f in files.values())
                types = acc.used
                print(f"write ({vdt} vectors): {dt:.2f} s, {size / 2**20:.1f} MiB for {len(kinds)} layers x "
                      f"{types} token types ({size / (len(kinds) * types):.0f} B per (layer, token); "
                      f"{4 * args.hidden if vdt == 'float32' else 2 * args.hidden} B of it the vector)")
    finally:
        if acc is not None:
            acc.close()  # stops the moments' thread before the interpreter exits
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
