"""The CPU's compiled token sums (extract/accumulate/cpu_kernels.py) against the float64 definition and the
eager chunks (chunk_sums.py), and the way back to the eager chunks where Numba is missing or turned off."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from extract.accumulate import cpu_kernels
from extract.accumulate.sums import TokenSums

L, V, d = 3, 40, 24


def _batches():
    """float32 batches: padding, a NaN row, an infinite row, a zero row, a window with one counted vector, a
    row that turns by more than π/2 from layer 1 to layer 2, and a batch of one position."""
    gen = torch.Generator().manual_seed(5)
    out = []
    for B, T in ((4, 11), (1, 1), (3, 7)):
        ids = torch.randint(0, V, (B, T), generator=gen)
        counted = torch.rand(B, T, generator=gen) > 0.2
        counted[0, 0] = True
        H = [torch.randn(B, T, d, generator=gen) * torch.linspace(0.5, 3, d) + 1.0]
        for _ in range(L - 1):
            H.append(H[-1] + 0.7 * torch.randn(B, T, d, generator=gen))
        if B > 1:
            counted[-1, 1:] = False  # a window with one counted vector
            H[1][0, 1, 3] = float("nan")
            H[2][0, 2, 5] = float("inf")
            H[0][1, 0] = 0.0
            H[2][1, 2] = -H[1][1, 2] + 0.5 * torch.randn(d, generator=gen)  # beyond π/2 from layer 1
            counted[1, 2] = True
        out.append((ids, counted, [h.float() for h in H]))
    return out


def _feed(acc: TokenSums, batches) -> TokenSums:
    with torch.inference_mode():
        for ids, counted, H in batches:
            acc.set_batch(ids, counted)
            for layer, h in enumerate(H):
                acc.add(layer, h)
    return acc


def _definition(batches) -> dict:
    """Per layer in float64 numpy over the counted finite non-zero rows: Σû and n per token type, Σh, Σû²,
    Σ_w mean cos(h, m_w) over windows of ≥ 2, NaN/inf and zero rows counted; the change l → l + 1."""
    want = {k: [None] * L for k in ("S", "n", "sum_h", "sum_u2")}
    for layer in range(L):
        want["S"][layer], want["n"][layer] = np.zeros((V, d)), np.zeros(V, np.int64)
        want["sum_h"][layer], want["sum_u2"][layer] = np.zeros(d), np.zeros(d)
    want.update(window_cos=np.zeros(L), windows=np.zeros(L, np.int64), nonfinite=np.zeros(L, np.int64),
                zero=np.zeros(L, np.int64), change=[[0, 0.0, 0.0] for _ in range(L)])
    for ids, counted, H in batches:
        X = [h.double().numpy() for h in H]
        C = counted.numpy()
        oks = []
        for layer, x in enumerate(X):
            norm = np.linalg.norm(x, axis=-1)  # (B, T)
            finite = np.isfinite(norm)
            ok = C & finite & (norm > 0)
            oks.append(ok)
            want["nonfinite"][layer] += int((C & ~finite).sum())
            want["zero"][layer] += int((C & finite & (norm == 0)).sum())
            with np.errstate(invalid="ignore", divide="ignore"):
                U = x / norm[..., None]
            for b, t in zip(*np.nonzero(ok)):
                want["S"][layer][ids[b, t]] += U[b, t]
                want["n"][layer][ids[b, t]] += 1
                want["sum_h"][layer] += x[b, t]
                want["sum_u2"][layer] += U[b, t] ** 2
            for b in range(x.shape[0]):
                rows = x[b][ok[b]]
                if len(rows) >= 2:
                    m = rows.sum(0)
                    want["window_cos"][layer] += np.mean(rows @ m / (np.linalg.norm(rows, axis=1) * np.linalg.norm(m)))
                    want["windows"][layer] += 1
        for layer in range(L - 1):
            both = oks[layer] & oks[layer + 1]
            a, b = X[layer][both], X[layer + 1][both]
            cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
            c = want["change"][layer]
            c[0] += int(both.sum())
            c[1] += cos.sum()
            c[2] += (np.arccos(np.clip(cos, -1, 1)) / math.pi).sum()
    return want


def _close(a, b, rtol: float) -> bool:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return bool(np.all(np.abs(a - b) <= rtol * max(float(np.abs(b).max(initial=0.0)), 1e-300)))


def test_the_compiled_pass_equals_the_float64_definition_and_the_eager_chunks(monkeypatch):
    """Every token sum of the compiled pass equals the float64 definition to 1e-12 (the angle's to 1e-9:
    the definition's arccos loses digits) and the eager chunks (5 rows each) to 1e-14, counts exactly:
    NaN/inf and zero rows left out and counted, a window of one vector, a row beyond π/2."""
    batches = _batches()
    compiled = _feed(TokenSums(L, V, d, "cpu", fused=False), batches)
    monkeypatch.setenv(cpu_kernels.ENV, "off")
    eager = TokenSums(L, V, d, "cpu", fused=False)
    eager.CHUNK = 5
    _feed(eager, batches)
    assert compiled.paths["cpu_rows"] == "numba" and eager.paths["cpu_rows"] == "eager ($ISO_CPU_KERNELS=off)"
    want = _definition(batches)
    assert want["nonfinite"][2] >= 2 and want["zero"][0] >= 1  # NaN and inf rows, zero rows: all counted
    ids, counted, H = batches[0]
    assert float(torch.cosine_similarity(H[1][1, 2], H[2][1, 2], dim=0)) < 0 and counted[1, 2]  # beyond π/2
    assert any(int(c.sum()) == 1 for _, c, _ in batches)
    for acc in (compiled, eager):
        assert acc.nonfinite.tolist() == want["nonfinite"].tolist() and acc.zero.tolist() == want["zero"].tolist()
        assert acc.windows.tolist() == want["windows"].tolist()
        assert _close(acc.window_cos.numpy(), want["window_cos"], 1e-12)
        for layer in range(L):
            counts, sums = acc.dense(layer)
            assert counts.tolist() == want["n"][layer].tolist()
            assert _close(sums.numpy(), want["S"][layer], 1e-12)
            assert _close(acc.sum_h[layer].numpy(), want["sum_h"][layer], 1e-12)
            assert _close(acc.sum_u2[layer].numpy(), want["sum_u2"][layer], 1e-12)
            n, cos, angle = want["change"][layer]
            assert int(acc.change_n[layer]) == n and (n > 0) == (layer + 1 < L)
            assert abs(float(acc.change_cos[layer]) - cos) <= 1e-12 * max(1.0, abs(cos))
            assert abs(float(acc.change_angle[layer]) - angle) <= 1e-9 * max(1.0, angle)
    for layer in range(L):
        (cc, sc), (ce, se) = compiled.dense(layer), eager.dense(layer)
        assert torch.equal(cc, ce) and _close(sc.numpy(), se.numpy(), 1e-14)
    for name in ("sum_h", "sum_u2", "window_cos", "change_cos", "change_angle", "sum_ubar", "sum_ubar_sq"):
        assert _close(getattr(compiled, name).numpy(), getattr(eager, name).numpy(), 1e-14), name
    for name in ("change_n", "unit_windows", "windows", "nonfinite", "zero"):
        assert torch.equal(getattr(compiled, name), getattr(eager, name)), name


@pytest.mark.parametrize("why", ["missing", "broken"])
def test_without_the_kernel_the_eager_chunks_run_and_the_run_says_why(monkeypatch, why):
    """No Numba (its import fails) or a kernel that gives a wrong sum on the known input: the token sums
    take the eager chunks, bit for bit as with $ISO_CPU_KERNELS=off, and the code path says why."""
    batches = _batches()
    monkeypatch.setenv(cpu_kernels.ENV, "off")
    off = _feed(TokenSums(L, V, d, "cpu", fused=False), batches)
    monkeypatch.delenv(cpu_kernels.ENV)
    monkeypatch.setattr(cpu_kernels, "_state", {})

    def missing():
        raise ImportError("No module named 'numba'")

    def broken():
        return lambda *args: 0  # adds nothing

    monkeypatch.setattr(cpu_kernels, "_compile", missing if why == "missing" else broken)
    acc = _feed(TokenSums(L, V, d, "cpu", fused=False), batches)
    assert acc.paths["cpu_rows"] == ("eager (ImportError: No module named 'numba')" if why == "missing" else
                                     "eager (RuntimeError: the compiled token sums gave a wrong sum on a known input)")
    for layer in range(L):
        (c1, s1), (c2, s2) = off.dense(layer), acc.dense(layer)
        assert torch.equal(c1, c2) and torch.equal(s1, s2)
    for name in ("sum_h", "sum_u2", "window_cos", "change_cos", "change_angle", "sum_ubar"):
        assert torch.equal(getattr(off, name), getattr(acc, name)), name


def test_warm_loads_the_kernel_on_a_thread_once(monkeypatch):
    """`warm()` (an extract's start) compiles or loads the kernel on a background thread; once there is one
    (or a reason there is none) it starts nothing."""
    monkeypatch.setattr(cpu_kernels, "_state", {})
    t = cpu_kernels.warm()
    assert t is not None
    t.join(120)
    assert cpu_kernels.available() and cpu_kernels.warm() is None
