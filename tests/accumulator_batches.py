"""Batches and comparisons shared by the accumulator tests (test_gpu_path.py, test_triton.py,
test_accumulate.py, test_crew.py, test_by_type.py): random batches with padding, NaN and zero vectors;
feeding several accumulators the same batches; two accumulators' tables and per-layer sums compared."""

from __future__ import annotations

import torch

from extract.accumulate.sums import TokenSums


def batch(B: int, T: int, V: int, d: int, gen: torch.Generator):
    """Token ids (B, T), the counted mask (B, T: the last position padding) and bf16 hidden states
    (B, T, d) with a NaN entry and a zero vector where the batch is large enough."""
    ids = torch.randint(0, V, (B, T), generator=gen)
    counted = torch.ones(B, T, dtype=torch.bool)
    if T > 2:
        counted[-1, -1] = False  # padding
    hidden = torch.randn(B, T, d, generator=gen).bfloat16()
    if B * T > 3:
        hidden[0, 0, 1] = float("nan")
        hidden[-1, 0] = 0.0
    return ids, counted, hidden


def feed(accs, shapes, V, d, L, gen):
    """The same batches of each (B, T) of `shapes` into every accumulator of `accs`, L layers each."""
    for B, T in shapes:
        ids, counted, hidden = batch(B, T, V, d, gen)
        for acc in accs:
            acc.set_batch(ids, counted)
            for layer in range(L):
                acc.add(layer, (hidden * (layer + 1)).roll(layer, -1).to(acc.device))  # another direction per layer


def assert_same(eager: TokenSums, other: TokenSums, L: int, names=None) -> None:
    """The token tables and every per-layer sum (`names`: only those) of two accumulators agree."""
    for layer in range(L):
        (ce, se), (cf, sf) = (t.cpu() for t in eager.dense(layer)), (t.cpu() for t in other.dense(layer))
        assert torch.equal(ce, cf) and torch.allclose(se, sf, rtol=1e-13, atol=1e-13)
    if names is None:
        assert eager.layer_sums() == other.layer_sums()
    names = eager.layer_sums() if names is None else names
    assert {"nonfinite", "zero", "windows", "sum_h", "sum_u2", "window_cos", "unit_windows", "change_n", "sum_ubar",
            "sum_ubar_sq", "change_cos", "change_angle"} <= set(eager.layer_sums())
    for name in names:  # every per-layer sum, whichever path added it
        a, b = getattr(eager, name).cpu(), getattr(other, name).cpu()
        assert a.dtype == b.dtype, name
        if a.is_floating_point():
            assert torch.allclose(a, b, rtol=1e-12, atol=1e-12), name
        else:
            assert torch.equal(a, b), name


def assert_identical(a: TokenSums, b: TokenSums, L: int) -> None:
    """The token tables and every per-layer sum of two accumulators equal bit for bit."""
    for layer in range(L):
        (ca, sa), (cb, sb) = a.dense(layer), b.dense(layer)
        assert torch.equal(ca, cb) and torch.equal(sa, sb), layer
    for name in a.layer_sums():
        assert torch.equal(getattr(a, name), getattr(b, name)), name
