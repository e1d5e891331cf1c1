"""The default pass's cost with and without the layer change (`layer_change`) and the windows' mean
unit vectors (`random_word_sim`), the variants interleaved batch by batch in one process so that a
shared machine's drift hits them alike (their order rotated from batch to batch).

--mode sums (default): no model; random hidden states (a residual stream: each layer the last plus
noise) through the token sums (the CPU's chunked path, or the compiled step with --fused), every layer;
wall and CPU ms per batch and layer.
--mode forward: a random GPT-NeoX (bench_extract.py's shape: hidden 512, 6 layers, vocabulary 50,304,
built in memory) and the default pass (token sums, moments on their background thread, the per-window
measures); per batch: the bare forward, the pass without the new sums and with them.

"Without" is a TokenSums that never hands a layer its previous layer's rows (no layer change) and
adds no mean unit vectors; "with" is the code as it is.

    OMP_NUM_THREADS=1 PYTHONPATH=. python bench/bench_layer_change.py --batch 8 --seq 512
    OMP_NUM_THREADS=1 PYTHONPATH=. python bench/bench_layer_change.py --mode forward --batch 8 --seq 512 --reps 12
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from extract.accumulate import sums as sums_module  # noqa: E402
from extract.accumulate.moments import Moments  # noqa: E402
from extract.accumulate.sums import TokenSums  # noqa: E402


def _no_unit_means(u, n_w):
    z = torch.zeros((), dtype=torch.int64, device=u.device)
    return z, torch.zeros(u.shape[1], dtype=torch.float64, device=u.device), z.double()


class WithoutNewSums(TokenSums):
    """TokenSums without the layer change (no previous layer is ever kept) and the mean unit vectors."""

    _prev = property(lambda self: None, lambda self, value: None)

    def _window_stats(self, *a):
        real = sums_module.unit_means
        sums_module.unit_means = _no_unit_means
        try:
            super()._window_stats(*a)
        finally:
            sums_module.unit_means = real


def _report(times: dict[str, list[float]], unit: str, scale: float, base: str | None = None) -> None:
    for name, ts in times.items():
        print(f"  {name:28s} min {min(ts) * scale:9.3f} {unit}  median {statistics.median(ts) * scale:9.3f} {unit}")
    a, b = times["without"], times["with"]
    pairs = [y / x for x, y in zip(a, b)]
    print(f"  with / without: median of per-batch ratios {statistics.median(pairs):.4f}, "
          f"ratio of medians {statistics.median(b) / statistics.median(a):.4f}")
    if base is not None:
        bare = times[base]
        print(f"  (with - without) / bare forward: median {statistics.median([(y - x) / z for x, y, z in zip(a, b, bare)]):.4f}")


def mode_sums(a) -> None:
    gen = torch.Generator().manual_seed(0)
    B, T, d, L = a.batch, a.seq, a.d, a.layers
    ids = (torch.rand(B, T, generator=gen) ** 3 * a.vocab).long()  # skewed: repeated types
    counted = torch.ones(B, T, dtype=torch.bool)
    counted[:, 0] = False  # a special token per window
    hidden = [torch.randn(B, T, d, generator=gen)]  # a residual stream: each layer adds to the last
    for _ in range(L - 1):
        hidden.append(hidden[-1] + a.update * torch.randn(B, T, d, generator=gen))
    hidden = [h.to(getattr(torch, a.dtype)) for h in hidden]
    accs = {"without": WithoutNewSums(L, a.vocab, d, a.device, fused=a.fused),
            "with": TokenSums(L, a.vocab, d, a.device, fused=a.fused)}
    hidden = [h.to(a.device) for h in hidden]
    sync = torch.cuda.synchronize if a.device.startswith("cuda") else (lambda: None)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, {a.device}, d {d}, B×T {B}×{T}, "
          f"{L} layers, {a.dtype}, path {'compiled' if accs['with']._fused is not None else 'eager (CPU: chunked)'}, "
          f"{a.reps} batches each, interleaved")
    times = {k: [] for k in accs}
    cpu = {k: [] for k in accs}  # this thread's CPU time: what a loaded machine's other processes do not add
    names = list(accs)
    for rep in range(a.reps + 3):
        for name in names[rep % 2:] + names[: rep % 2]:
            acc = accs[name]
            sync()
            t, c = time.perf_counter(), time.thread_time()
            acc.set_batch(ids, counted)
            for layer in range(L):
                acc.add(layer, hidden[layer])
            sync()
            if rep >= 3:  # the first batches warm up (and compile)
                times[name].append((time.perf_counter() - t) / L)
                cpu[name].append((time.thread_time() - c) / L)
    assert int(accs["with"].change_n[0]) > 0 and int(accs["without"].change_n[0]) == 0
    print("wall ms per batch and layer:")
    _report(times, "ms", 1e3)
    print("CPU ms (this thread) per batch and layer:")
    _report(cpu, "ms", 1e3)


def mode_forward(a) -> None:
    from transformers import AutoModelForCausalLM

    from bench_extract import make_config, zipf_batches
    from extract.architectures import discover, get_module
    from extract.hooks import capture_layers, layer_kinds
    from extract.models import forward_kwargs
    from extract.sequences import WindowMeasures

    args = argparse.Namespace(arch="gpt_neox", vocab=a.vocab, hidden=a.d, layers=a.layers, seq=a.seq, batch=a.batch,
                              batches=a.reps, intermediate=None, kv_heads=None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_config(args)).eval()
    fam = discover(model, "causal", None, forward_kwargs("causal"))
    base = get_module(model, fam.base)
    L = len(layer_kinds(model, fam))
    batches = zipf_batches(args)
    counted = torch.ones_like(batches[0], dtype=torch.bool)
    where = torch.stack(torch.meshgrid(torch.arange(a.batch), torch.arange(a.seq), indexing="ij"), -1)
    accs = {}
    for name, cls in (("without", WithoutNewSums), ("with", TokenSums)):
        acc = cls(L, a.vocab, a.d, "cpu")
        acc.moments = Moments(L, a.d, "cpu")
        acc.extra = WindowMeasures(L, a.d, "cpu", worker=acc.moments._worker)
        accs[name] = acc

    def bare(i):
        base(input_ids=batches[i], use_cache=False)

    def run(acc, i):
        acc.set_batch(batches[i], counted, where)
        with capture_layers(model, fam, acc.add):
            base(input_ids=batches[i], use_cache=False)
        acc.moments.finish()  # the background thread's work belongs to this batch

    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, GPT-NeoX hidden {a.d}, {a.layers} layers, "
          f"vocab {a.vocab}; B×T {a.batch}×{a.seq}; default pass (token sums, moments on their thread, per-window "
          f"measures); {a.reps} batches, each: bare, without, with (rotated)")
    times = {"bare forward": [], "without": [], "with": []}
    cpu = {k: [] for k in times}  # the process's CPU time (the moments' thread included)
    steps = [("bare forward", bare), ("without", lambda i: run(accs["without"], i)), ("with", lambda i: run(accs["with"], i))]
    with torch.inference_mode():
        for fn in steps:  # warm-up
            fn[1](0)
        for i in range(len(batches)):
            k = i % 3
            for name, fn in steps[k:] + steps[:k]:
                t, c = time.perf_counter(), time.process_time()
                fn(i)
                times[name].append(time.perf_counter() - t)
                cpu[name].append(time.process_time() - c)
    print("wall seconds per batch:")
    _report(times, "s", 1.0, base="bare forward")
    print("process CPU seconds per batch:")
    _report(cpu, "s", 1.0, base="bare forward")
    for acc in accs.values():
        acc.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["sums", "forward"], default="sums")
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--update", type=float, default=0.5,
                    help="--mode sums: layer l + 1 = layer l + this × N(0, 1) (0.5: cos ≈ 0.9; 10: half the angles "
                         "beyond π/2, the CPU path's worst case)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--fused", action=argparse.BooleanOptionalAction, default=None,
                    help="the compiled step (default: on a GPU)")
    a = ap.parse_args()
    (mode_forward if a.mode == "forward" else mode_sums)(a)


if __name__ == "__main__":
    main()
