"""The GPU pass, checked where torch allows it on a CPU: the compiled accumulation step never
recompiles for B = 1, T = 1 or T = d, a failed compile or recompile falls back to the eager path
with one warning and a recorded path, the bf16 moments' product probe and its fallback, the bf16
moments' precision bound against float64, the batch loop's staging (background thread, no mask
without padding) and `doctor`."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from extract import accumulate
from extract.accumulate import Moments, TokenSums


def _batch(B: int, T: int, V: int, d: int, gen: torch.Generator):
    ids = torch.randint(0, V, (B, T), generator=gen)
    counted = torch.ones(B, T, dtype=torch.bool)
    if T > 2:
        counted[-1, -1] = False  # padding
    hidden = torch.randn(B, T, d, generator=gen).bfloat16()
    if B * T > 3:
        hidden[0, 0, 1] = float("nan")
        hidden[-1, 0] = 0.0
    return ids, counted, hidden


def _feed(accs, shapes, V, d, L, gen):
    for B, T in shapes:
        ids, counted, hidden = _batch(B, T, V, d, gen)
        for acc in accs:
            acc.set_batch(ids, counted)
            for layer in range(L):
                acc.add(layer, hidden * (layer + 1))


def _assert_same(eager: TokenSums, other: TokenSums, L: int) -> None:
    for layer in range(L):
        (ce, se), (cf, sf) = eager.dense(layer), other.dense(layer)
        assert torch.equal(ce, cf) and torch.allclose(se, sf, rtol=1e-13, atol=1e-13)
    for name in ("nonfinite", "zero", "windows"):
        assert torch.equal(getattr(eager, name), getattr(other, name)), name
    for name in ("sum_h", "sum_u2", "window_cos"):
        assert torch.allclose(getattr(eager, name), getattr(other, name), rtol=1e-12, atol=1e-12), name


def test_compiled_step_never_recompiles_for_b1_t1_or_t_equal_d():
    """`layer_step` compiled with inductor on the CPU (on a GPU the same graph becomes Triton): the
    first batch has T == d (duck sizing would tie them) and B = 1 (0/1 specialisation); after it,
    batches with B = 1, T = 1, T = d, a one-row batch and a table that grew compile nothing more —
    dynamo's graph and recompile counters stay put — and every sum equals the eager path's."""
    L, V, d = 2, 3000, 4
    gen = torch.Generator().manual_seed(0)
    eager, fused = TokenSums(L, V, d, "cpu", fused=False), TokenSums(L, V, d, "cpu", fused=True)
    assert fused.paths["layer_step"] == "compiled" and eager.paths["layer_step"] == "eager"
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback warning may fire
        _feed([eager, fused], [(1, d)], V, d, L, gen)  # warm-up: the one compile
        graphs = counters["stats"]["unique_graphs"]
        recompiles = sum(counters["recompiles"].values())
        _feed([eager, fused], [(1, 7), (3, 1), (1, 1), (2, d), (5, 3), (1, 2)], V, d, L, gen)
        _feed([eager, fused], [(64, 40)], V, d, L, gen)  # > 1,024 new token types: the table grows
    assert fused.capacity > 1024
    assert counters["stats"]["unique_graphs"] == graphs, "the compiled step recompiled"
    assert sum(counters["recompiles"].values()) == recompiles
    assert fused._fused is not None and fused.paths["layer_step"] == "compiled"
    _assert_same(eager, fused, L)


def test_a_failed_recompile_falls_back_to_eager_with_one_warning():
    """A compile that fails after a first success (or torch's recompile limit, an error here) is not
    fatal: the step runs eagerly from then on, with one one-line RuntimeWarning and the path recorded;
    the sums equal the eager path's."""
    L, V, d = 2, 40, 4
    gen = torch.Generator().manual_seed(1)
    eager, fused = TokenSums(L, V, d, "cpu", fused=False), TokenSums(L, V, d, "cpu", fused=True)
    fused._fused = lambda *a: accumulate.layer_step(*a)  # a "compiled" step that works (the compiler is slow)
    _feed([eager, fused], [(2, 3)], V, d, L, gen)
    assert fused._compiled_once

    def broken(*a):
        raise RuntimeError("inductor exploded\nsecond line")

    fused._fused = broken
    with pytest.warns(RuntimeWarning) as caught:
        _feed([eager, fused], [(1, 5), (3, 2)], V, d, L, gen)
    msgs = [str(w.message) for w in caught if "accumulation step" in str(w.message)]
    assert len(msgs) == 1 and "\n" not in msgs[0] and "recompile failed (RuntimeError: inductor exploded)" in msgs[0]
    assert fused._fused is None and fused.paths["layer_step"] == "eager (recompile failed: RuntimeError)"
    _assert_same(eager, fused, L)


def test_recompile_limit_is_an_error_not_a_silent_eager_fallback(monkeypatch):
    """torch's recompile limit, inside `_run_compiled`, raises instead of silently running eager."""
    seen = {}

    def fn(*a):
        seen["fail"] = torch._dynamo.config.fail_on_recompile_limit_hit
        return "ok"

    t = [torch.zeros(3, 2), torch.zeros(3), torch.zeros(3), torch.zeros(1, 3, 2), torch.zeros(3), torch.zeros(1, 3)]
    assert accumulate._run_compiled(fn, *t) == "ok" and seen["fail"] is True
    assert not torch._dynamo.config.fail_on_recompile_limit_hit  # only around the call
