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


# ---------------------------------------------------------------- the terms from the token-sum pass


def windows_batch(B: int, T: int, V: int, d: int, gen: torch.Generator):
    """A batch for TokenSums + WindowMeasures: bf16 rows with a NaN row, a zero row, uncounted positions
    inside windows (not only at their ends: consecutive counted rows are not always adjacent), a window
    with one counted row; `where` (B, T, 2) = (window, position)."""
    ids = torch.randint(0, V, (B, T), generator=gen)
    counted = torch.rand(B, T, generator=gen) > 0.15
    if B > 1 and T > 1:
        counted[-1, 1:] = False  # a window with one counted row (no curvature pair)
    hidden = (torch.randn(B, T, d, generator=gen) * torch.linspace(0.5, 4, d)).bfloat16()
    if B * T > 6:
        hidden[0, 1, 2] = float("nan")
        hidden[0, 3] = 0.0
    where = torch.stack(torch.meshgrid(torch.arange(B), torch.arange(T), indexing="ij"), -1)
    return ids, counted, hidden, where


def layer_rows(hidden: torch.Tensor, layer: int) -> torch.Tensor:
    """Layer `layer`'s hidden states of a batch in the tests that feed `hidden` (B, T, d) to every layer:
    scaled and rotated through the dimensions, so that the direction of a row changes from layer to
    layer (the layer change) and NaN/inf and zero rows stay where they are."""
    return (hidden * (layer + 1)).roll(layer, -1)


def window_definition(batches, L: int, d: int, k: int):
    """The per-window measures in float64 numpy from their definitions (docs/measures.md), per layer:
    Σ|h|, the top-k (|h|, document, position, dim), the curvature's sum over windows and windows, and
    the pooled windows' (W, Σz, Σzzᵀ) — over the counted finite non-zero vectors; layer l's rows are
    `layer_rows` in bf16 (as `feed_windows`)."""
    out = []
    for layer in range(L):
        sum_abs, entries, curv, curv_w = 0.0, [], 0.0, 0
        pooled = {p: [0, np.zeros(d), np.zeros((d, d))] for p in ("mean", "last", "normalized")}
        for _, counted, hidden, where in batches:
            H = layer_rows(hidden, layer).double().numpy()  # (B, T, d)
            for b in range(H.shape[0]):
                rows = [(t, H[b, t]) for t in range(H.shape[1]) if counted[b, t]]  # counted rows in order
                ok = [bool(np.isfinite(h).all() and np.abs(h).sum() > 0) for _, h in rows]
                vecs = [h for (_, h), o in zip(rows, ok) if o]
                for (t, h), o in zip(rows, ok):
                    if o:
                        sum_abs += np.abs(h).sum()
                        entries += [(-abs(h[i]), b, t, i) for i in range(d)]
                # curvature: velocities of adjacent counted rows, both ok; consecutive velocity pairs
                v = [rows[i + 1][1] - rows[i][1] if ok[i] and ok[i + 1] else None for i in range(len(rows) - 1)]
                v = [x if x is not None and np.linalg.norm(x) > 0 else None for x in v]
                cs = [np.arccos(min(1.0, abs(v[i] @ v[i + 1]) / (np.linalg.norm(v[i]) * np.linalg.norm(v[i + 1]))))
                      for i in range(len(v) - 1) if v[i] is not None and v[i + 1] is not None]
                if cs:
                    curv += np.mean(cs)
                    curv_w += 1
                if vecs:
                    z_mean = np.mean(vecs, 0)
                    r = np.linalg.norm(z_mean)
                    for p, z in (("mean", z_mean), ("last", vecs[-1]), ("normalized", z_mean / r if r > 0 else None)):
                        if z is not None:
                            pooled[p][0] += 1
                            pooled[p][1] += z
                            pooled[p][2] += np.outer(z, z)
        entries.sort()
        out.append({"sum_abs": sum_abs, "top": [(-e[0], e[1], e[2], e[3]) for e in entries[:k]],
                    "curv_sum": curv, "curv_windows": curv_w, "pooled": pooled})
    return out


def feed_windows(acc, batches, L: int) -> None:
    for ids, counted, hidden, where in batches:
        acc.set_batch(ids, counted, where)
        for layer in range(L):
            acc.add(layer, layer_rows(hidden, layer))


def assert_windows_equal_definition(wm: WindowMeasures, want, L: int, rtol: float = 1e-12) -> None:
    wm.finish()
    close = lambda a, b: abs(a - b) <= rtol * max(abs(b), 1e-300)  # noqa: E731
    for layer, w in enumerate(want):
        assert close(float(wm.sum_abs[layer]), w["sum_abs"]), (layer, float(wm.sum_abs[layer]), w["sum_abs"])
        assert int(wm.curv_windows[layer]) == w["curv_windows"] > 0
        assert close(float(wm.curv_sum[layer]), w["curv_sum"]), (layer, float(wm.curv_sum[layer]), w["curv_sum"])
        top = wm.top(layer)
        assert [(v, doc, pos, dim) for v, doc, pos, dim in zip(top["abs_value"], top["document"], top["position"],
                                                                top["dim"])] == w["top"]
        for p, (n, s1, s2) in w["pooled"].items():
            mo = wm.pooled[p]
            assert int(mo.n[layer]) == n
            assert np.allclose(mo.s1[layer].numpy(), s1, rtol=rtol, atol=rtol * np.abs(s1).max())
            assert np.allclose(mo.s2(layer), s2, rtol=rtol, atol=rtol * np.abs(s2).max())


def test_window_terms_from_the_token_sum_pass_equal_the_float64_definition(monkeypatch):
    """--sequences on the CPU: the per-window measures take Σ|h|, the row maxima and the curvature's
    ‖v‖² and ⟨v', v⟩ from the token-sum pass's float64 chunks (chunks of 7 rows in blocks of 3 here, so
    that pairs and triples span their boundaries) instead of reading the rows again: equal to the float64
    definition to 1e-12 (n exact, the top-k identical), as are the paths that compute them in
    WindowMeasures' own pass (the general eager path; WindowMeasures on the moments' background thread)
    — and the token sums, window sums and counts are bit-identical to a pass without the per-window
    measures."""
    from extract.accumulate import kernels
    from extract.accumulate.moments import Moments
    from extract.accumulate.sums import TokenSums

    L, V, d = 2, 50, 8
    gen = torch.Generator().manual_seed(11)
    batches = [windows_batch(B, T, V, d, gen) for B, T in ((3, 20), (1, 1), (2, 9), (5, 4), (1, 30))]
    accs = {name: TokenSums(L, V, d, "cpu", fused=False) for name in ("chunked", "rows", "thread", "bare")}
    accs["rows"].host_sync_free = False  # the general eager path: WindowMeasures computes the terms itself
    monkeypatch.setattr(kernels.chunk_terms, "__defaults__", (3,))  # blocks of 3 rows inside the chunks
    accs["thread"].moments = Moments(L, d, "cpu", background=True)  # WindowMeasures on its thread: own pass
    given = []
    for name, acc in accs.items():
        acc.CHUNK = 7
        if name != "bare":
            acc.extra = WindowMeasures(L, d, "cpu", top_k=5, worker=acc.moments._worker if acc.moments else None)
            acc.extra.CHUNK = 7
            real = acc.extra.add
            acc.extra.add = lambda *a, real=real, name=name, **k: (given.append((name, k.get("terms") is not None)),
                                                                  real(*a, **k))
    for acc in accs.values():
        feed_windows(acc, batches, L)
    assert set(given) == {("chunked", True), ("rows", False), ("thread", False)}
    want = window_definition(batches, L, d, 5)
    for name in ("chunked", "rows", "thread"):
        assert_windows_equal_definition(accs[name].extra, want, L)
    accs["thread"].close()
    bare, chunked = accs["bare"], accs["chunked"]
    for layer in range(L):
        assert all(torch.equal(a, b) for a, b in zip(bare.dense(layer), chunked.dense(layer)))
    for name in ("nonfinite", "zero", "windows", "sum_h", "sum_u2", "window_cos"):
        assert torch.equal(getattr(bare, name), getattr(chunked, name)), name
