"""Benchmark: what the default pass's moments cost, whole process, and how exact they are.

Runs `python cli.py extract` end to end (start-up, model load, tokenising, forward passes, writing,
merging at commit) on the CPU benchmark shape — a random GPT-NeoX saved with save_pretrained
(hidden 512, 6 layers, vocabulary 50,304) over a JSONL source of ~100k Zipf-distributed tokens —
with `--no-moments` and with the default (moments on, float32 products), alternating, and prints
the wall times and their ratio.  Then one more run with `--moments-precision float64` (exact
products) gives the reference the float32 moments are compared with: the covariance matrices, their
eigenvalues, and every view built on the moments.

    python bench/bench_moments.py                 # ~100k tokens, 2 runs of each variant
    python bench/bench_moments.py --tokens 20000 --runs 1
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_extract import build_model  # noqa: E402


def write_source(path: Path, tokens: int, vocab: int, doc_len: int = 500) -> None:
    rng = np.random.default_rng(0)
    ranks = np.arange(1, vocab + 1, dtype=np.float64)
    p = ranks ** -1.1
    p /= p.sum()
    perm = rng.permutation(vocab)
    with open(path, "w") as f:
        for _ in range(max(1, tokens // doc_len)):
            ids = perm[rng.choice(vocab, size=doc_len, p=p)]
            f.write(json.dumps({"text": " ".join(f"t{i}" for i in ids)}) + "\n")


def _steal() -> int:
    """Clock ticks the hypervisor gave to others (/proc/stat 'steal'; 0 where there is none)."""
    try:
        return int(Path("/proc/stat").read_text().split("\n", 1)[0].split()[8])
    except (OSError, IndexError, ValueError):
        return 0


def run(model: Path, source: Path, wh: Path, extra: list[str]) -> tuple[float, float, float, float]:
    """(whole-process wall seconds, forward-loop seconds as the extract reports them, CPU seconds
    (user + sys) of the process, seconds of CPU stolen by the hypervisor meanwhile)."""
    cmd = [sys.executable, str(ROOT / "cli.py"), "extract", "--model", str(model), "--source", f"bench={source}",
           "--warehouse", str(wh), "--max-length", "512", "--batch-size", "8", *extra]
    r0, s0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), _steal(), time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    dt = time.perf_counter() - t0
    r1, s1 = resource.getrusage(resource.RUSAGE_CHILDREN), _steal()
    if p.returncode:
        sys.exit(p.stderr[-3000:])
    loop = re.search(r"non-finite, ([0-9.]+) s \(", p.stderr)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return dt, float(loop.group(1)) if loop else float("nan"), cpu, (s1 - s0) / os.sysconf("SC_CLK_TCK")


def moments(wh: Path) -> dict[int, dict]:
    from warehouse.query import connect

    con = connect(wh)
    out = {}
    for layer, n, s1, s2, n_pair, sc in con.execute(
            "SELECT layer, n, s1, s2, n_pair, s_cross FROM moments_merged WHERE source = 'all' ORDER BY layer").fetchall():
        d = len(s1)
        out[layer] = {"n": n, "s1": np.array(s1), "s2": np.array(s2).reshape(d, d),
                      "cross": None if sc is None else np.array(sc).reshape(d, d)}
    views = {}
    for view, cols in (("anisotropy", "anisotropy"), ("isoscore", "isoscore"), ("effective_rank", "effective_rank"),
                       ("linearity", "linearity, linearity_centered, cka, procrustes_orthogonal")):
        views[view] = con.execute(f"SELECT layer, {cols} FROM {view} WHERE source = 'all' ORDER BY layer").fetchall()
    con.close()
    return {"moments": out, "views": views}


def compare(a: dict, b: dict) -> list[str]:
    """a: float32 products, b: float64 reference."""
    lines = []
    worst_c = worst_e = worst_x = 0.0
    for layer, m in b["moments"].items():
        o = a["moments"][layer]
        n = m["n"]
        cov = lambda x: x["s2"] / n - np.outer(x["s1"] / n, x["s1"] / n)  # noqa: E731
        c64, c32 = cov(m), cov(o)
        worst_c = max(worst_c, np.abs(c32 - c64).max() / np.abs(c64).max())
        e64, e32 = np.linalg.eigvalsh(c64), np.linalg.eigvalsh(c32)
        worst_e = max(worst_e, np.abs(e32 - e64).max() / e64.max())
        if m["cross"] is not None:
            worst_x = max(worst_x, np.abs(o["cross"] - m["cross"]).max() / np.abs(m["cross"]).max())
    lines.append(f"covariance entries: max |C32 − C64| / max |C64| = {worst_c:.2e} (worst layer)")
    lines.append(f"eigenvalues: max |λ32 − λ64| / λ_max = {worst_e:.2e}")
    lines.append(f"cross moments: max |X32 − X64| / max |X64| = {worst_x:.2e}")
    for view, rows in b["views"].items():
        worst = 0.0
        for r64, r32 in zip(rows, a["views"][view]):
            for x, y in zip(r32[1:], r64[1:]):
                if x is not None and y is not None:
                    worst = max(worst, abs(x - y) / max(abs(y), 1e-300))
        lines.append(f"view {view}: max relative difference {worst:.2e}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--runs", type=int, default=2, help="runs of each variant (alternating)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=50304)
    args = ap.parse_args()
    args.arch, args.intermediate, args.kv_heads, args.seq = "gpt_neox", None, None, 512
    with tempfile.TemporaryDirectory(prefix="isobench-moments-") as tmp:
        tmp = Path(tmp)
        model = build_model(tmp / "model", args)
        source = tmp / "source.jsonl"
        write_source(source, args.tokens, args.vocab)
        times = {"--no-moments": [], "default": []}
        loops = {"--no-moments": [], "default": []}
        cpus = {"--no-moments": [], "default": []}
        for i in range(args.runs):
            for variant in times:
                extra = ["--no-moments"] if variant == "--no-moments" else []
                dt, loop, cpu, stolen = run(model, source, tmp / f"wh-{variant}-{i}", extra)
                times[variant].append(dt)
                loops[variant].append(loop)
                cpus[variant].append(cpu)
                print(f"{variant:>13}: {dt:.1f} s (forward loop {loop:.1f} s; CPU {cpu:.1f} s; stolen {stolen:.1f} s)",
                      flush=True)
        t_ref, loop_ref, cpu_ref, stolen = run(model, source, tmp / "wh-f64", ["--moments-precision", "float64"])
        print(f"{'float64':>13}: {t_ref:.1f} s (forward loop {loop_ref:.1f} s; CPU {cpu_ref:.1f} s; stolen {stolen:.1f} s; "
              "exact products, the reference)")
        off, on = statistics.median(times["--no-moments"]), statistics.median(times["default"])
        print(f"hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, ~{args.tokens} tokens, "
              f"{os.cpu_count()} cores")
        print(f"whole process: --no-moments {off:.1f} s, default {on:.1f} s (medians of {args.runs}); "
              f"ratio {on / off:.3f} (run by run: {', '.join(f'{b / a:.3f}' for a, b in zip(times['--no-moments'], times['default']))}); "
              f"float64 products {t_ref / off:.3f}")
        print(f"forward loop alone: ratio {statistics.median(loops['default']) / statistics.median(loops['--no-moments']):.3f}; "
              f"CPU time: ratio {statistics.median(cpus['default']) / statistics.median(cpus['--no-moments']):.3f}")
        for line in compare(moments(tmp / "wh-default-0"), moments(tmp / "wh-f64")):
            print(line)


if __name__ == "__main__":
    main()
