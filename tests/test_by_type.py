"""Layer 0's moments by token type (extract/accumulate/by_type.py): where a batch's layer-0 rows are the
input embedding's rows, the moments skip their per-token products and add each type's product once,
weighted by its count — equal to float64 products of the counted rows, and every other sum bit for bit
what the per-token path adds; a batch whose rows are not the embedding's (position embeddings, a NaN)
goes the per-token way, and so does every batch after it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from accumulator_batches import assert_identical
from conftest import one_thread
from extract.accumulate.by_type import EmbeddingRows, TypeCounts, embedding_rows
from extract.accumulate.moments import Moments
from extract.accumulate.sums import TokenSums
from extract.run.stream import code_paths

D, L, V = 64, 3, 40


def _batches(E: torch.Tensor, rng: torch.Generator, shifted: int | None = None):
    """Batches of (ids, counted, hidden states per layer): layer 0 the embedding's rows (but for batch
    `shifted`, whose layer 0 is moved by a position term), padding in each."""
    out = []
    for k in range(5):
        B, T = (3, 40) if k % 2 == 0 else (6, 17)
        ids = torch.randint(0, V, (B, T), generator=rng)
        counted = torch.ones(B, T, dtype=torch.bool)
        counted[0, T // 2:] = False  # padding
        h0 = E[ids]
        if k == shifted:
            h0 = h0 + 1e-3 * torch.arange(T, dtype=torch.float32)[None, :, None]
        hs = [h0]
        for _ in range(L - 1):
            hs.append(hs[-1] + 0.5 * torch.randn(B, T, D, generator=rng))
        out.append((ids, counted, hs))
    return out


def _run(batches, E, threads: int, by_type: bool, cross: bool = False):
    torch.set_num_threads(threads)
    acc = TokenSums(L, V, D, "cpu")
    acc.moments = Moments(L, D, "cpu", cross=cross, background=None if threads > 1 else False)
    acc.layer0 = EmbeddingRows(E) if by_type else None
    products = []  # the layers whose rows went into per-token products
    job = acc.moments._job  # a batch's products, whichever way they run
    acc.moments._job = lambda layer, *a, **k: (products.append(layer), job(layer, *a, **k))[1]
    with torch.inference_mode():
        for ids, counted, hs in batches:
            acc.set_batch(ids, counted)
            for layer, h in enumerate(hs):
                acc.add(layer, h)
    return acc, products


def _exact(batches, layer: int) -> np.ndarray:
    X = torch.cat([hs[layer][counted].double() for _, counted, hs in batches])
    X = X[(X != 0).any(1) & torch.isfinite(X).all(1)]  # zero and non-finite vectors are not counted
    return (X.T @ X).numpy()


def test_layer_zero_by_type_equals_float64_and_the_per_token_path():
    rng = torch.Generator().manual_seed(0)
    E = torch.randn(V, D, generator=rng) + 3.0  # a large common mean: the centre matters
    E[7] = 0.0  # a zero row: counted as zero, left out
    E[11, 3] = float("inf")  # an infinite one: counted as non-finite, left out
    batches = _batches(E, rng)
    threads = torch.get_num_threads()
    try:
        typed, typed_products = _run(batches, E, 2, by_type=True)
        with one_thread():
            plain, plain_products = _run(batches, E, 1, by_type=False)
    finally:
        torch.set_num_threads(threads)
    try:
        assert 0 not in typed_products and 1 in typed_products  # layer 0 never multiplied per token
        assert plain_products.count(0) == 5
        assert code_paths(typed)["moments_by_type"] == "layer 0 (its rows are the input embedding's)"
        assert typed.layer0.batches == 5 and "moments_by_type" not in code_paths(plain)
        mt, mp = typed.moments, plain.moments
        assert torch.equal(mt.n, mp.n) and torch.equal(mt.s1, mp.s1)
        assert typed.zero[0] > 0 and torch.equal(typed.zero, plain.zero)
        assert typed.nonfinite[0] > 0 and torch.equal(typed.nonfinite, plain.nonfinite)
        assert_identical(typed, plain, L)
        for layer in range(1, L):  # the other layers: the same products
            assert np.array_equal(mt.s2(layer), mp.s2(layer)), layer
        exact = _exact(batches, 0)
        for m in (mt, mp):
            assert np.abs(m.s2(0) - exact).max() <= 1e-6 * np.abs(exact).max()
        # the covariance (what the views take): Σhhᵀ/n − μμᵀ against float64, relative to its largest entry
        n, mu = int(mt.n[0]), mt.s1[0].numpy() / int(mt.n[0])
        cov, ref = mt.s2(0) / n - np.outer(mu, mu), exact / n - np.outer(mu, mu)
        assert np.abs(cov - ref).max() <= 1e-5 * np.abs(ref).max()
        assert np.array_equal(mt.s2(0), mt.s2(0))  # the types' products were added once
    finally:
        typed.close()
        plain.close()


def test_a_batch_that_is_not_the_embeddings_rows_goes_per_token_and_so_do_the_rest():
    """Reads in the middle of the run (the types' products added then, later batches' at the next read), a
    batch whose layer 0 is not the embedding's rows (per token from there on, the centre set by the first
    batch kept), sums made in inference mode and read outside it; a cross moment keeps layer 0 per token."""
    rng = torch.Generator().manual_seed(1)
    E = torch.randn(V, D, generator=rng) + 2.0
    batches = _batches(E, rng, shifted=3)
    with one_thread():
        with torch.inference_mode():  # as --split-by makes its sums
            acc = TokenSums(L, V, D, "cpu")
            acc.moments = Moments(L, D, "cpu", cross=False, background=False)
        acc.layer0 = EmbeddingRows(E)
        products, job = [], acc.moments._job
        acc.moments._job = lambda layer, *a, **k: (products.append(layer), job(layer, *a, **k))[1]
        crossed, crossed_products = _run(batches, E, 1, by_type=True, cross=True)
    try:
        for k, (ids, counted, hs) in enumerate(batches):
            with torch.inference_mode():
                acc.set_batch(ids, counted)
                for layer, h in enumerate(hs):
                    acc.add(layer, h)
            if k in (1, 2, 4):  # read after batches 0–1, 2 (by type), 3–4 (per token)
                exact = _exact(batches[: k + 1], 0)
                assert np.abs(acc.moments.s2(0) - exact).max() <= 1e-6 * np.abs(exact).max(), k
                assert int(acc.moments.n[0]) == sum(int(c.sum()) for _, c, _ in batches[: k + 1])
        assert products.count(0) == 2  # batches 0–2 by type; 3 is not the embedding's rows, nor is 4 checked
        assert acc.layer0.checking is False and acc.layer0.batches == 3
        assert code_paths(acc)["moments_by_type"] == ("layer 0: its first 3 batches by type (their rows were the "
                                                      "input embedding's), the rest per token")
        assert crossed_products.count(0) == 5  # a cross moment needs layer 0's rows
        assert "moments_by_type" not in code_paths(crossed)
    finally:
        acc.close()
        crossed.close()


def test_a_failure_while_the_types_products_are_added_adds_nothing(monkeypatch):
    """An error in the middle of the types' products (e.g. out of memory) leaves the sums as they were and
    the counts pending: a later read adds them whole."""
    from extract.accumulate import by_type

    rng = torch.Generator().manual_seed(2)
    E = torch.randn(V, D, generator=rng) + 1.0
    batches = _batches(E, rng)
    with one_thread():
        acc, _ = _run(batches, E, 1, by_type=True)
    calls, real = [], by_type.add_gram_upper

    def fail_twice(*a):
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError("simulated")
        return real(*a)

    monkeypatch.setattr(by_type, "add_gram_upper", fail_twice)
    monkeypatch.setattr(acc.moments, "CHUNK", 16)  # several chunks of types: the error comes after one added
    try:
        with pytest.raises(MemoryError):
            acc.moments.s2(0)
        exact = _exact(batches, 0)
        assert np.abs(acc.moments.s2(0) - exact).max() <= 1e-6 * np.abs(exact).max()
    finally:
        acc.close()


def test_type_counts_and_the_exact_check():
    E = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    ids = torch.tensor([3, 1, 1])
    assert embedding_rows(E[ids], E, ids)
    h = E[ids].clone()
    h[2, 0] = torch.nextafter(h[2, 0], torch.tensor(1e9))  # one ulp off
    assert not embedding_rows(h, E, ids)
    assert not embedding_rows(E[ids].double(), E, ids)  # another dtype
    nan = E.clone()
    nan[1, 1] = float("nan")
    assert not embedding_rows(nan[ids], nan, ids)
    counts = TypeCounts()
    counts.add(0, E, torch.tensor([2, 2]))
    counts.add(0, E, torch.tensor([3, 0, 2]))  # longer than the first: the counts grow
    (layer, weight, types, w), = counts.pending()
    assert layer == 0 and torch.equal(weight, E) and types.tolist() == [0, 2, 3] and w.tolist() == [1, 3, 1]
    counts.drop(0)
    assert counts.pending() == []
