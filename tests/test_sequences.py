"""Precision of the per-window measures (extract/sequences.py) against their float64 definitions: the
pooled windows' moments on a rank-deficient covariance, and Σ|h| of bf16 rows."""

from __future__ import annotations

import numpy as np
import torch

from extract.sequences import WindowMeasures
from warehouse.measures import covariance


def _effective_rank(lam: np.ndarray) -> float:
    """As queries/sequence_spectrum.sql: p = max(λ, 0)/Σ, exp(−Σ_{p>0} p log p)."""
    lam = np.maximum(lam, 0)
    p = lam / lam.sum()
    p = p[p > 0]
    return float(np.exp(-(p * np.log(p)).sum()))


def _batch(wm: WindowMeasures, rows: list[torch.Tensor], layer: int = 0):
    """One batch of windows (each a (N_i, d) tensor) through WindowMeasures.add."""
    win = np.concatenate([np.full(len(r), i) for i, r in enumerate(rows)])  # (M,)
    wm.set_batch(win, len(rows), None)
    h = torch.cat(rows)  # (M, d)
    ok = torch.ones(len(h), dtype=torch.bool)
    m = torch.stack([r.sum(0, dtype=torch.float64) for r in rows])  # (B, d)
    n_w = torch.tensor([len(r) for r in rows])
    wm.add(layer, h, ok, m, n_w)


def test_last_pooling_on_a_rank_deficient_covariance_equals_float64():
    """'last' pooling at the embedding layer: 120 windows ending in one of 5 tokens, so the covariance
    of the last vectors has rank ≤ 4 of d = 64; with a large common offset (an embedding's mean) the
    products' rounding is what makes noise eigenvalues.  Effective rank from the stored sums (the
    merge's eigvalsh of the covariance) against the float64 definition; float32 products: ~1e-5 off."""
    gen = torch.Generator().manual_seed(3)
    d, W, vocab = 64, 120, 5
    table = torch.randn(vocab, d, generator=gen) + 4.0  # (V, d) float32 embeddings, mean far from 0
    ends = torch.randint(0, vocab, (W,), generator=gen)
    wm = WindowMeasures(1, d, "cpu", precision="float32")
    lasts = []
    for b in range(0, W, 8):  # batches of 8 windows of 3–9 vectors each
        rows = []
        for i in range(b, b + 8):
            n = 3 + (i % 7)
            body = torch.randn(n - 1, d, generator=gen)
            rows.append(torch.cat([body, table[ends[i]][None]]))
            lasts.append(table[ends[i]].double().numpy())
        _batch(wm, rows)
    mo = wm.pooled["last"]
    n, s1, S = int(mo.n[0]), mo.s1[0].numpy(), mo.s2(0)
    got = _effective_rank(np.linalg.eigvalsh(covariance(n, s1, S)))
    Z = np.stack(lasts)  # (W, d) the definition: the last vectors in float64
    want = _effective_rank(np.linalg.eigvalsh(np.cov(Z.T)))
    assert n == W
    assert abs(got - want) <= 1e-9 * want, (got, want)


def test_sum_abs_of_bf16_rows_is_float64_to_float32_rounding():
    """Σ|h| of bf16 rows: each row summed in float32 (exact bf16 values, d of them), the rows in float64;
    a row's sum rounded to bf16 (8 bits) was ~1e-4 off and moved with the summation order."""
    gen = torch.Generator().manual_seed(5)
    d = 384
    wm = WindowMeasures(1, d, "cpu")
    want = 0.0
    for _ in range(3):
        rows = [(torch.randn(n, d, generator=gen) * 3 + 1).bfloat16() for n in (17, 40, 5, 64)]
        want += sum(float(r.double().abs().sum()) for r in rows)
        _batch(wm, rows)
    got = float(wm.sum_abs[0])
    assert abs(got - want) <= 1e-6 * want, (got, want, abs(got - want) / want)
