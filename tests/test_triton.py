"""The Triton kernels (extract/accumulate/fused.py), compiled for the GPU where there is one, else run
in Triton's interpreter on the CPU (TRITON_INTERPRET=1, set by conftest.py): the token sums, counts and
per-layer sums against the eager path, the moments they feed against float64, the layer change and
unit means against their float64 definitions, and the sums the kernels lack taking the other path."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch

from accumulator_batches import assert_same, batch, feed
from extract.accumulate import fused
from extract.accumulate.moments import Moments
from extract.accumulate.sums import TokenSums

# compiled for the GPU where there is one, else in Triton's interpreter on the CPU
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.skipif(not fused.available() or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
                    reason="Triton is not installed, or neither a GPU nor its interpreter")
@pytest.mark.parametrize("vocab", [7, 300])
def test_the_triton_kernels_equal_the_eager_path_and_the_float64_moments(vocab, monkeypatch):
    """fused.py's four kernels, run in Triton's interpreter on the CPU: the token sums and counts (runs
    of one type inside a block of rows and across blocks: 7 types; mostly single rows: 300; each run's
    total by the segmented scan), Σh, Σû², window cosines, NaN/inf and zero vectors, the
    windows' mean unit vectors and the layer change equal the eager path's (every per-layer sum of the
    default accumulator, to 1e-12 relative: the order of float64 additions; measured ≤ 6e-15); the rows,
    n and Σh they hand the moments give float64 moments equal to the eager path's; B = 1, T = 1, several
    blocks of rows, positions, windows and columns (d = 40) included.  (The interpreter scans in order: a
    combine that is not associative would pass here and fail on a GPU's tree scan; `_run_sum` is.)"""
    L, d = 2, 40
    for name in ("BLOCK_D", "NORMS_D", "SLOTS_D"):  # small blocks: several of each in tiny batches
        monkeypatch.setattr(fused, name, 32)
    monkeypatch.setattr(fused, "BLOCK_B", 4)
    monkeypatch.setattr(fused, "BLOCK_T", 16)  # T = 40: three tiles of positions and one wholly masked
    gen = torch.Generator().manual_seed(3)
    eager = TokenSums(L, vocab, d, "cpu")
    tri = TokenSums(L, vocab, d, TRITON_DEVICE, triton=True)
    assert set(tri.layer_sums()) == fused.FILLS  # the default accumulator's sums: all added by the kernels
    assert tri.paths == {"layer_step": "triton", "scatter": "segmented"} and eager._triton is False
    for acc in (eager, tri):
        acc.moments = Moments(L, d, acc.device, precision="float64", background=False)
    feed([eager, tri], [(3, 11), (1, 1), (2, 40), (5, 3)], vocab, d, L, gen)
    assert tri._triton_once and tri.paths == {"layer_step": "triton", "scatter": "segmented"}
    assert_same(eager, tri, L)
    assert int(tri.nonfinite.sum()) > 0 and int(tri.zero.sum()) > 0 and int(tri.windows.sum()) > 0
    assert int(tri.change_n.sum()) > 0 and int(tri.unit_windows.sum()) > 0
    assert torch.equal(eager.moments.n, tri.moments.n.cpu())
    assert torch.allclose(eager.moments.s1, tri.moments.s1.cpu(), rtol=1e-13, atol=1e-12)
    for layer in range(L):
        assert np.allclose(eager.moments.s2(layer), tri.moments.s2(layer), rtol=1e-13, atol=1e-12)


def test_a_massive_dimension_centres_a_layer_whose_trace_ratio_is_small():
    """A trained-like layer: one dimension's mean (a massive activation) dominates the largest
    variance (max μ_i²/max C_ii ≈ 280) while ‖μ‖²/tr C < 1: its bf16 rows are centred and split, and
    the covariance is within 1e-5 of the largest entry, and at least 4× nearer than the raw rows'
    through the same GEMM; without the massive dimension, raw rows, within 1e-5.

    That the split matters holds whatever float32 GEMM the CPU has, by construction: the massive
    dimension's values are chosen on bf16's grid (k/8, mean 17) so that their exact Σ h₀², one entry
    of the raw rows' product, lies halfway between two float32 numbers; whatever order the GEMM sums
    in, its float32 result is at least half an ulp (2⁻⁴ here) off, 1.5e-5 of the largest entry once
    divided by n.  The split rows' error does not grow with the mean, but depends on how long the
    GEMM's float32 runs of rows are: 4.9e-7 through MKL's and oneDNN's (AMD EPYC, AVX-512-BF16, every
    ISA forced; 1.5e-6 with oneDNN's bf16 mode), 1.5e-6 to 2.4e-6 in runs of 512 to 1,024 rows, 9.7e-6
    summed one row after another — within the 1e-5, not 4× under the floor: a GEMM that sums ≥ 2,048 rows
    in one float32 run fails the 4× (bench/results/2026-11-29-bf16-split-bound-by-summation-order.txt)."""
    d, rows = 512, 4096
    g = torch.Generator().manual_seed(7)
    sig = torch.logspace(0, -0.12, d, dtype=torch.float64)  # tr C ≈ 390: ‖μ‖²/tr C < 1 with μ₀ = 17
    k = 136 + torch.arange(rows) % 27 - 13  # (rows,) integers: h₀ = k/8, exact in bf16
    assert int((k * k).sum()) % 8 == 4  # Σ h₀² = Σ k²/64 ≡ 2⁻⁴ mod 2⁻³, float32's ulp in [2²⁰, 2²¹)
    for split in (True, False):
        mu = torch.randn(d, generator=g, dtype=torch.float64) * 0.1 * sig
        mu[0] = 0.0
        h = (mu + torch.randn(rows, d, generator=g, dtype=torch.float64) * sig).bfloat16()
        if split:
            h[:, 0] = k / 8
        ok = torch.ones(rows, dtype=torch.bool)
        m = Moments(1, d, "cpu", cross=False, precision="bfloat16", background=False)
        raw = Moments(1, d, "cpu", cross=False, precision="bfloat16", background=False)
        raw.SPLIT_RATIO = raw.SPLIT_DIM_RATIO = float("inf")
        exact = Moments(1, d, "cpu", cross=False, precision="float64", background=False)
        for acc in (m, raw, exact):
            acc.add(0, h, ok)
        assert (m._split, m._ratio[0] < 1, m._dim_ratio[0] > 64) == ([split], True, split), (m._ratio, m._dim_ratio)
        assert split or m._dim_ratio[0] < 1
        n = float(exact.n[0])
        mean = exact.s1[0].numpy() / n
        C64 = exact.s2(0) / n - np.outer(mean, mean)

        def error(acc):
            return np.abs(acc.s2(0) / n - np.outer(mean, mean) - C64).max() / np.abs(C64).max()

        assert error(m) <= 1e-5, error(m)
        if split:
            assert 2.0 ** 20 <= float((h[:, 0].double() ** 2).sum()) < 2.0 ** 21
            assert raw.CHUNK_BF16 >= rows  # the floor's premise: all the rows in one float32 product
            floor = 2.0 ** -4 / n / np.abs(C64).max()  # half float32's ulp at Σ h₀², as a covariance error
            assert error(raw) >= 0.999 * floor, (error(raw), floor)
            assert 4 * error(m) < floor, (error(m), floor)  # the split matters


@pytest.mark.skipif(not fused.available() or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
                    reason="Triton is not installed, or neither a GPU nor its interpreter")
def test_the_triton_layer_change_and_unit_means_equal_their_float64_definition():
    """The layer change and the windows' mean unit vectors the kernels add, against their definition in
    float64 numpy on the same bf16 rows: per pair of consecutive layers, over the positions counted,
    finite and non-zero at both, n, Σ cos(a, b) and Σ arccos(cos)/π of the unit vectors (random
    angles, where arccos is accurate, and one opposite row, θ = π); per window with ≥ 1 such vector, ū = mean û, Σ ū
    and Σ ‖ū‖².  NaN, inf, zero and padded positions included, some at one layer only; 3 layers (two
    changes)."""
    L, V, d = 3, 20, 24
    gen = torch.Generator().manual_seed(5)
    tri = TokenSums(L, V, d, TRITON_DEVICE, triton=True)
    ids, counted, hidden = batch(3, 7, V, d, gen)
    layers = [(hidden * (layer + 1)).roll(layer, -1) for layer in range(L)]
    layers[2][1, 2] = -layers[1][1, 2]  # an opposite row (θ = π): ‖a + b‖ from the float64 sums
    layers[0][1, 5] = 0.0  # excluded at one layer of a pair only: out of that pair, in the next one
    layers[1][2, 3, 0] = float("inf")
    tri.set_batch(ids, counted)
    with np.errstate(invalid="ignore"):  # the interpreter's numpy on the inf row (inf − inf, inf · 0: excluded)
        for layer in range(L):
            tri.add(layer, layers[layer].to(tri.device))
    assert tri.paths["layer_step"] == "triton" and tri._triton_once
    units, oks = [], []
    for h in layers:
        x = h.double().numpy().reshape(-1, d)  # (B·T, d) exact upcast
        norm = np.sqrt((x * x).sum(1))
        ok = counted.numpy().reshape(-1) & np.isfinite(norm) & (norm > 0)
        units.append(np.where(ok[:, None], x / np.where(ok, norm, 1.0)[:, None], 0.0))
        oks.append(ok)
    for layer in range(L - 1):
        pair = oks[layer] & oks[layer + 1]
        cos = (units[layer] * units[layer + 1]).sum(1)[pair]
        assert int(tri.change_n[layer]) == pair.sum() > 0
        assert np.isclose(float(tri.change_cos[layer]), cos.sum(), rtol=1e-13, atol=1e-13)
        assert np.isclose(float(tri.change_angle[layer]), (np.arccos(np.clip(cos, -1, 1)) / np.pi).sum(),
                          rtol=1e-9, atol=1e-9)
    assert int(tri.change_n[L - 1]) == 0 and float(tri.change_angle[L - 1]) == 0.0
    for layer in range(L):
        u, ok = units[layer].reshape(3, 7, d), oks[layer].reshape(3, 7)
        n = ok.sum(1)
        ubar = u[n > 0].sum(1) / n[n > 0][:, None]
        assert int(tri.unit_windows[layer]) == (n > 0).sum()
        assert np.allclose(tri.sum_ubar[layer].cpu().numpy(), ubar.sum(0), rtol=1e-13, atol=1e-14)
        assert np.isclose(float(tri.sum_ubar_sq[layer]), (ubar * ubar).sum(), rtol=1e-13, atol=1e-14)


@pytest.mark.skipif(not fused.available() or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
                    reason="Triton is not installed, or neither a GPU nor its interpreter")
def test_sums_the_triton_kernels_lack_take_the_other_path_recorded_without_a_warning(monkeypatch):
    """An accumulator holding a per-layer sum that fused.py's kernels do not add never runs them: at
    its first batch it takes the compiled step (on a CPU the eager path), records which sums made it,
    warns nothing, and every sum equals the eager path's.  The default accumulator's sums are all
    among the kernels' (`fused.FILLS`): it runs them."""
    L, V, d = 2, 50, 8
    assert set(TokenSums(L, V, d, "cpu").layer_sums()) == fused.FILLS
    monkeypatch.setattr(fused, "FILLS", fused.FILLS - {"change_angle", "sum_ubar"})  # as if they lacked these
    eager, other = TokenSums(L, V, d, "cpu"), TokenSums(L, V, d, TRITON_DEVICE, triton=True)
    assert other.paths["layer_step"] == "triton"
    gen = torch.Generator().manual_seed(4)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*[Tt]riton.*")
        feed([eager, other], [(2, 5), (3, 4)], V, d, L, gen)
    step = "compiled" if TRITON_DEVICE == "cuda" else "eager"
    assert other.paths == {"layer_step": f"{step} (triton kernels lack change_angle, sum_ubar)", "scatter": "atomic"}
    assert other._plan is None and not other._triton_once
    assert int(other.change_n.sum()) > 0
    assert_same(eager, other, L)
