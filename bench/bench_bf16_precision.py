"""Benchmark: the bf16 moments' error against float64 products of the same bf16 rows, raw rows
against centred hi+lo rows (`Moments._add_bf16`), on the real all-MiniLM-L6-v2 in bf16, on
synthetic rows with a given ‖μ‖²/tr C, and on trained-like rows with two massive dimensions.  Runs on the CPU (the same exact products as a GPU's tensor
cores, float32 accumulation in another order).

    python bench/bench_bf16_precision.py
    python bench/bench_bf16_precision.py --d 384 --rows 20000

Errors printed: covariance C = Σhhᵀ/n − μμᵀ, max |ΔC| / max |C|; eigenvalues, max |Δλ| / λ_max; cross
moments Σ h_l h_{l+1}ᵀ, max |Δ| / max |·| — each the worst over the layers.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from extract.accumulate.moments import Moments  # noqa: E402


def feed(batches, L: int, d: int, ratio_cut: float, chunk: int):
    m = Moments(L, d, "cpu", cross=True, precision="bfloat16", background=False)
    m.SPLIT_RATIO = ratio_cut
    m.SPLIT_DIM_RATIO = float("inf") if ratio_cut == float("inf") else m.SPLIT_DIM_RATIO
    m.CHUNK_BF16 = chunk
    for hs, ok in batches:
        for layer, h in enumerate(hs):
            m.add(layer, h, ok)
    return m


def errors(m: Moments, exact: Moments, L: int) -> tuple[float, float, float]:
    cov, eig, cross = 0.0, 0.0, 0.0
    for layer in range(L):
        n = float(exact.n[layer])
        mu = exact.s1[layer].numpy() / n
        C64 = exact.s2(layer) / n - np.outer(mu, mu)
        C = m.s2(layer) / n - np.outer(m.s1[layer].numpy() / n, m.s1[layer].numpy() / n)
        cov = max(cov, np.abs(C - C64).max() / np.abs(C64).max())
        e64, e = np.linalg.eigvalsh(C64), np.linalg.eigvalsh((C + C.T) / 2)
        eig = max(eig, np.abs(e - e64).max() / e64.max())
        if layer + 1 < L:
            X64 = exact.cross(layer)
            cross = max(cross, np.abs(m.cross(layer) - X64).max() / np.abs(X64).max())
    return cov, eig, cross


def report(name: str, batches, L: int, d: int, chunk: int) -> None:
    exact = Moments(L, d, "cpu", cross=True, precision="float64", background=False)
    for hs, ok in batches:
        for layer, h in enumerate(hs):
            exact.add(layer, h, ok)
    ratios, dims = [], []
    for layer in range(L):
        n = float(exact.n[layer])
        mu = exact.s1[layer].numpy() / n
        var = np.diag(exact.s2(layer)) / n - mu * mu
        ratios.append(mu @ mu / var.sum())
        dims.append((mu * mu).max() / var.max())
    line = (f"{name:34s} |mu|^2/trC {min(ratios):9.3g}–{max(ratios):<9.3g} max mu_i^2/max C_ii "
            f"{min(dims):9.3g}–{max(dims):<9.3g}")
    for label, cut in (("raw", math.inf), ("split", 0.0), ("default", Moments.SPLIT_RATIO)):
        t = time.perf_counter()
        m = feed(batches, L, d, cut, chunk)
        cov, eig, cross = errors(m, exact, L)
        line += f" | {label}: cov {cov:.2g} eig {eig:.2g} cross {cross:.2g} ({time.perf_counter() - t:.1f} s)"
    print(line, flush=True)


def synthetic(ratio: float, d: int, rows: int, L: int = 2, batch: int = 4096, seed: int = 0):
    """Rows h = μ + z with z ~ N(0, diag(σ²)), σ² spread over a decade, ‖μ‖²/tr C = ratio; a few zeroed rows."""
    g = torch.Generator().manual_seed(seed)
    sig = torch.logspace(0, -1, d, dtype=torch.float64)
    out = []
    mus = []
    for layer in range(L):
        direction = torch.randn(d, generator=g, dtype=torch.float64)
        mus.append(direction / direction.norm() * math.sqrt(ratio * float(sig.square().sum())))
    for a in range(0, rows, batch):
        k = min(batch, rows - a)
        ok = torch.rand(k, generator=g) > 0.01
        hs = [((mus[layer] + torch.randn(k, d, generator=g, dtype=torch.float64) * sig).bfloat16()
               .masked_fill(~ok[:, None], 0)) for layer in range(L)]
        out.append((hs, ok))
    return out


def massive(d: int, rows: int, big: float, n_big: int = 2, L: int = 2, batch: int = 4096, seed: int = 0):
    """A trained-like layer: rows h = μ + z as in `synthetic` with a small mean (0.3 σ per dimension), but
    `n_big` massive dimensions whose mean is `big` (σ 1 there): max μ_i²/max C_ii ≈ big² while ‖μ‖²/tr C
    stays small at a large d."""
    g = torch.Generator().manual_seed(seed)
    sig = torch.logspace(0, -1, d, dtype=torch.float64)
    mus = []
    for _ in range(L):
        mu = torch.randn(d, generator=g, dtype=torch.float64) * 0.3 * sig
        mu[:n_big] = big
        mus.append(mu)
    s = sig.clone()
    s[:n_big] = 1.0
    out = []
    for a in range(0, rows, batch):
        k = min(batch, rows - a)
        ok = torch.rand(k, generator=g) > 0.01
        out.append(([((mu + torch.randn(k, d, generator=g, dtype=torch.float64) * s).bfloat16()
                      .masked_fill(~ok[:, None], 0)) for mu in mus], ok))
    return out


def minilm(tokens: int, batch_tokens: int = 4096):
    """bf16 hidden states (embeddings + 6 blocks) of all-MiniLM-L6-v2 over the repository's docs."""
    from transformers import AutoModel, AutoTokenizer

    from extract.models import minilm_dir

    where = minilm_dir()
    tok = AutoTokenizer.from_pretrained(where)
    model = AutoModel.from_pretrained(where, dtype=torch.bfloat16).eval()
    text = "\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"])
    paras = [p for p in text.split("\n\n") if len(p) > 40]
    out, rows, pending, count = [], [], [], 0
    with torch.inference_mode():
        for i in range(0, len(paras), 16):
            enc = tok(paras[i:i + 16], return_tensors="pt", padding=True, truncation=True, max_length=256)
            hs = model(**enc, output_hidden_states=True).hidden_states  # 7 × (B, T, d)
            keep = enc["attention_mask"].bool()
            pending.append([h[keep] for h in hs])
            count += int(keep.sum())
            if sum(len(p[0]) for p in pending) >= batch_tokens:
                rows = [torch.cat([p[layer] for p in pending]) for layer in range(len(hs))]
                out.append((rows, torch.ones(len(rows[0]), dtype=torch.bool)))
                pending = []
            if count >= tokens:
                break
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", type=int, default=384)
    ap.add_argument("--rows", type=int, default=20_000)
    ap.add_argument("--chunk", type=int, default=Moments.CHUNK_BF16, help="rows per bf16 product")
    ap.add_argument("--minilm-tokens", type=int, default=20_000)
    ap.add_argument("--massive-d", type=int, default=2048, help="d of the trained-like rows (massive dimensions)")
    ap.add_argument("--only", choices=("minilm", "synthetic", "massive"), help="one kind of rows only")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, rows per product {args.chunk}, SPLIT_RATIO {Moments.SPLIT_RATIO:g}, "
          f"SPLIT_DIM_RATIO {Moments.SPLIT_DIM_RATIO:g}")
    if args.only in (None, "minilm"):
        mb = minilm(args.minilm_tokens)
        report(f"MiniLM bf16, {sum(len(b[1]) for b in mb)} tokens, 7 layers", mb, 7, 384, args.chunk)
    for ratio in (1, 10, 100, 1e3, 1e4) if args.only in (None, "synthetic") else ():
        report(f"synthetic d {args.d}, {args.rows} rows, ratio {ratio:g}", synthetic(ratio, args.d, args.rows),
               2, args.d, args.chunk)
    for big in (5, 8, 10, 15, 25) if args.only in (None, "massive") else ():  # massive activations: max mu_i^2 / max C_ii ≈ big²
        report(f"massive d {args.massive_d}, {args.rows} rows, 2 dims of mean {big:g}",
               massive(args.massive_d, args.rows, big), 2, args.massive_d, args.chunk)


if __name__ == "__main__":
    main()
