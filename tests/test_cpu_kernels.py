"""The CPU's compiled token sums (extract/accumulate/cpu_kernels.py) against the float64 definition and the
eager chunks (chunk_sums.py), and the way back to the eager chunks where Numba is missing or turned off."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import reference as ref
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
            for k, v in enumerate(ref.layer_change(X[layer][both], X[layer + 1][both])):
                want["change"][layer][k] += v
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


@pytest.mark.parametrize("why", ["missing", "broken", "nojit"])
def test_without_the_kernel_the_eager_chunks_run_and_the_run_says_why(monkeypatch, why):
    """No Numba (its import fails), a kernel that gives wrong sums on the known input, or NUMBA_DISABLE_JIT
    (the kernel would run as Python, ~1000× slower): the token sums take the eager chunks, bit for bit as
    with $ISO_CPU_KERNELS=off (which warns nothing), the code path says why and one warning says so."""
    from extract.accumulate import numba_rows

    batches = _batches()
    monkeypatch.setenv(cpu_kernels.ENV, "off")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # asked for: no warning
        off = _feed(TokenSums(L, V, d, "cpu", fused=False), batches)
    monkeypatch.delenv(cpu_kernels.ENV)
    monkeypatch.setattr(cpu_kernels, "_state", {})
    if why == "missing":
        def build(cache):
            raise ImportError("No module named 'numba'")
        monkeypatch.setattr(numba_rows, "build", build)
    elif why == "broken":
        monkeypatch.setattr(numba_rows, "build", lambda cache: lambda *args: 0)  # adds nothing
    else:
        monkeypatch.setattr(numba_rows.numba.config, "DISABLE_JIT", True)
    with pytest.warns(RuntimeWarning, match="compiled token sums are not available"):
        acc = _feed(TokenSums(L, V, d, "cpu", fused=False), batches)
    assert acc.paths["cpu_rows"] == {
        "missing": "eager (ImportError: No module named 'numba')",
        "broken": "eager (RuntimeError: the compiled token sums gave a wrong sum on a known input)",
        "nojit": "eager (RuntimeError: NUMBA_DISABLE_JIT is set (the kernel would run as Python))"}[why]
    for layer in range(L):
        (c1, s1), (c2, s2) = off.dense(layer), acc.dense(layer)
        assert torch.equal(c1, c2) and torch.equal(s1, s2)
    for name in ("sum_h", "sum_u2", "window_cos", "change_cos", "change_angle", "sum_ubar"):
        assert torch.equal(getattr(off, name), getattr(acc, name)), name


def test_a_cache_that_cannot_be_used_compiles_for_the_run(monkeypatch):
    """Where the kernel's disk cache cannot be written or read (a read-only install, a damaged file), the
    kernel is compiled for the process alone: the compiled sums, and the path says so."""
    from extract.accumulate import numba_rows

    build = numba_rows.build

    def no_cache(cache):
        if cache:
            raise RuntimeError("cannot cache function 'token_rows_py': no locator available for file")
        return build(cache)

    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setattr(numba_rows, "build", no_cache)
    batches = _batches()
    acc = _feed(TokenSums(L, V, d, "cpu", fused=False), batches)
    assert acc.paths["cpu_rows"] == ("numba (compiled for this run: RuntimeError: cannot cache function "
                                     "'token_rows_py': no locator available for file)")
    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setattr(numba_rows, "build", build)
    cached = _feed(TokenSums(L, V, d, "cpu", fused=False), batches)
    assert cached.paths["cpu_rows"] == "numba"
    for layer in range(L):
        (c1, s1), (c2, s2) = cached.dense(layer), acc.dense(layer)
        assert torch.equal(c1, c2) and torch.equal(s1, s2)


def test_indices_out_of_range_raise_instead_of_writing_past_the_table():
    """The compiled kernel does not check its indices: its wrapper does (a slot or window out of range, the
    previous layer's rows of another shape) and raises before anything is added."""
    fn = cpu_kernels.kernel()
    h = torch.ones(3, 4)
    S = torch.zeros(2, 4, dtype=torch.float64)
    win = torch.zeros(3, dtype=torch.int64)
    for slots in (torch.tensor([0, 1, 2]), torch.tensor([0, -1, 1])):
        with pytest.raises(ValueError, match="out of range"):
            cpu_kernels.layer_sums(fn, h, slots, win, 1, S, None)
    with pytest.raises(ValueError, match="out of range"):
        cpu_kernels.layer_sums(fn, h, torch.zeros(3, dtype=torch.int64), torch.tensor([0, 1, 1]), 1, S, None)
    with pytest.raises(ValueError, match="do not match"):
        cpu_kernels.layer_sums(fn, h, torch.zeros(3, dtype=torch.int64), win, 1, S,
                               (torch.ones(2, 4), torch.ones(2, dtype=torch.float64)))
    assert not S.any()
    cpu_kernels.layer_sums(fn, h, torch.tensor([0, 1, 1]), win, 1, S, None)
    assert S[1].tolist() == [1.0] * 4 and S[0].tolist() == [0.5] * 4


def test_warm_loads_the_kernel_on_a_thread_once(monkeypatch):
    """`warm()` (an extract's start) compiles or loads the kernel on a background thread; once there is one
    (or a reason there is none) it starts nothing."""
    monkeypatch.setattr(cpu_kernels, "_state", {})
    t = cpu_kernels.warm()
    assert t is not None
    t.join(120)
    assert cpu_kernels.kernel() is not None and cpu_kernels.warm() is None
