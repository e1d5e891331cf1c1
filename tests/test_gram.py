"""gram.py's kernel (the bf16 moments' products on a GPU), compiled for the GPU where there is one, else
run in Triton's interpreter on the CPU (TRITON_INTERPRET=1, set by conftest.py): against float64
products of the same rows, its float32 sums flushed into float64 every FLUSH rows, and the bf16
moments through it against float64 moments."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from extract.accumulate import fused, gram
from extract.accumulate.moments import Moments

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# covariance and cross-moment errors allowed, relative to the largest entry: the interpreter's float32
# sums are IEEE's; a GPU's tensor cores err more inside one float32 sum (~3e-9 per row measured, d 2,048)
COV, CROSS = (1e-7, 1e-8) if DEVICE == "cpu" else (1e-6, 1e-6)
if fused.available():
    import triton
    import triton.language as tl

    from extract.accumulate import triton_kernels

    triton_jit = triton.jit
else:  # the module's tests are skipped
    tl = triton_kernels = None

    def triton_jit(fn):
        return fn
pytestmark = pytest.mark.skipif(
    not fused.available() or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="Triton is not installed, or neither a GPU nor its interpreter")


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles small enough for several of each in tiny inputs (and for the interpreter's speed)."""
    for name, value in (("BM", 32), ("BN", 16), ("BK", 16), ("FLUSH", 64)):
        monkeypatch.setattr(gram, name, value)


def _rows(M: int, d: int, shift: float, g: torch.Generator):
    """bf16 rows (M, d) as a view with a row stride > d, ~10 % not ok (zeroed), and their bf16 mean."""
    wide = ((torch.randn(M, d + 5, generator=g) * torch.logspace(0, -1, d + 5)) + shift).bfloat16()
    h = wide[:, 2: 2 + d]
    ok = torch.rand(M, generator=g) > 0.1
    h[~ok] = 0
    return h, ok, h.float()[ok].mean(0).bfloat16().float()


def _exact(h, ok, c, split):
    """The side's rows as the kernel means them, in float64: where(ok, h − c, 0), or h as it is."""
    return torch.where(ok[:, None], h.double() - (c.double() if split else 0.0), 0.0)


def test_the_gram_kernel_equals_float64_products_of_the_same_rows(small_tiles):
    """Raw and centred-and-split rows, the upper triangle's tiles (the Gram matrix: nothing written in
    the tiles wholly below the diagonal), and every tile (the cross moment, one side raw and the other
    split, both ways); d not a multiple of a tile (50; BM ≠ BN), rows not a multiple of a step (301)
    nor of FLUSH, strided rows, rows not ok zeroed by the kernel (zero already for raw rows, h − c ≠ 0
    for split ones) — against float64 products of the same rows to 1e-6 of the largest entry (measured
    ≤ 7e-8: float32 sums of ≤ FLUSH rows; hi + lo within 2⁻¹⁷ of each centred value)."""
    g = torch.Generator().manual_seed(1)
    M, d = 301, 50
    a = _rows(M, d, 3.0, g)
    b = _rows(M, d, -1.0, g)
    zero = torch.zeros(d)
    for split_a, split_b in ((False, False), (True, True), (False, True), (True, False)):
        side_a = (a[0].to(DEVICE), a[1].to(DEVICE), (a[2] if split_a else zero).to(DEVICE), split_a)
        side_b = (b[0].to(DEVICE), b[1].to(DEVICE), (b[2] if split_b else zero).to(DEVICE), split_b)
        xa, xb = _exact(a[0], a[1], a[2], split_a), _exact(b[0], b[1], b[2], split_b)
        bound = 1e-6
        if split_a == split_b:  # the Gram matrix of side a
            out = torch.zeros(d, d, dtype=torch.float64, device=DEVICE)
            gram.add(out, side_a)
            out = out.cpu()
            ref = xa.T @ xa
            assert ((out - ref).triu().abs().max() / ref.abs().max()) <= bound, (split_a, split_b)
            r, c = torch.meshgrid(torch.arange(d), torch.arange(d), indexing="ij")
            below = (c // gram.BN + 1) * gram.BN <= (r // gram.BM) * gram.BM  # tiles wholly below the diagonal
            assert bool(below.any()) and not bool(out[below].any())
            assert bool(out[~below].ne(0).all())
            continue
        out = torch.zeros(d, d, dtype=torch.float64, device=DEVICE)
        gram.add(out, side_a, side_b)
        ref = xa.T @ xb
        assert ((out.cpu() - ref).abs().max() / ref.abs().max()) <= bound, (split_a, split_b)
    out = torch.zeros(d, d, dtype=torch.float64, device=DEVICE)
    gram.add(out, (a[0][:0].to(DEVICE), a[1][:0].to(DEVICE), zero.to(DEVICE), False))  # no rows: nothing
    assert not bool(out.any())


def test_the_gram_kernels_float32_sums_go_into_float64_every_flush_rows(small_tiles, monkeypatch):
    """Rows built so that a float32 sum of FLUSH rows' products is exact and a float32 sum of all of
    them is not: values 1 + k/128 (bf16), so each product is a multiple of 2⁻¹⁴ below 4, a sum of 64
    rows < 2⁸ fits float32's 24 bits, a sum of 4,096 rows (~2¹³) does not.  Flushed every 64 rows the
    kernel's result is the float64 one exactly; with FLUSH past the rows (one float32 sum) it is not.
    (On a GPU, whose tensor cores sum in their own way: the flushed result at least 4× nearer.)"""
    g = torch.Generator().manual_seed(2)
    M, d = 4096, 16
    h = (1 + torch.randint(0, 128, (M, d), generator=g) / 128).bfloat16()
    ok = torch.ones(M, dtype=torch.bool)
    side = (h.to(DEVICE), ok.to(DEVICE), torch.zeros(d, device=DEVICE), False)
    ref = (h.double().T @ h.double()).triu()
    monkeypatch.setattr(gram, "BM", 16)
    monkeypatch.setattr(gram, "BK", 64)  # one step per flush
    errors = []
    for flush in (64, 2 * M):
        monkeypatch.setattr(gram, "FLUSH", flush)
        out = torch.zeros(d, d, dtype=torch.float64, device=DEVICE)
        gram.add(out, side)
        errors.append(float((out.cpu().triu() - ref).abs().max()))
    if DEVICE == "cpu":  # float32 sums as IEEE's: every one of ≤ 64 rows exact
        assert errors[0] == 0 < errors[1], errors
    else:  # a tensor core's own float32 sums: the flushed ones at least 4x nearer
        assert 4 * errors[0] < errors[1], errors


def _moments_against_float64(m: Moments, cov: float = COV, cross: float = CROSS, layers: int = 4, d: int = 40):
    """Feed `m` and float64 moments the same bf16 rows — layers at ‖μ‖²/tr C = 0.1, 1e3, 0.1 and one with a
    massive dimension (max μ_i²/max C_ii ≈ 100), batches of several sizes, ~10 % of rows not ok (zeroed), in
    some batches a different 10 % per layer — and assert n, Σh and the pairs' counts exact, each covariance
    within `cov` of its largest entry and each cross moment within `cross` of its own."""
    g = torch.Generator().manual_seed(3)
    sig = torch.logspace(0, -1, d)
    mus = [v / v.norm() * (ratio * float(sig.square().sum())) ** 0.5
           for v, ratio in zip(torch.randn(layers, d, generator=g), (0.1, 1e3, 0.1, 0.01))]
    mus[3] = torch.randn(d, generator=g) * 0.3 * sig
    mus[3][0] = 10.0  # a massive dimension
    exact = Moments(layers, d, "cpu", precision="float64", background=False)
    for M, own in ((50, False), (7, True), (130, True), (64, False)):
        ok = torch.rand(M, generator=g) > 0.1
        for layer in range(layers):
            if own:  # this layer's own rows not ok: the cross moments' pairs count fewer than either layer
                ok = torch.rand(M, generator=g) > 0.1
            h = (torch.randn(M, d, generator=g) * sig + mus[layer]).bfloat16()
            h[~ok] = 0
            m.add(layer, h.to(DEVICE), ok.to(DEVICE))
            exact.add(layer, h, ok)
    assert torch.equal(m.n.cpu(), exact.n) and torch.equal(m.n_pair.cpu(), exact.n_pair)
    assert bool((exact.n_pair < exact.n[:-1]).all())
    assert torch.allclose(m.s1.cpu(), exact.s1, rtol=1e-14, atol=0)
    for layer in range(layers):
        n = float(exact.n[layer])
        mu = exact.s1[layer].numpy() / n
        C64 = exact.s2(layer) / n - np.outer(mu, mu)
        assert np.abs(m.s2(layer) / n - np.outer(mu, mu) - C64).max() <= cov * np.abs(C64).max(), layer
    for layer in range(layers - 1):  # raw → split, split → raw, raw → split
        X64 = exact.cross(layer)
        assert np.abs(m.cross(layer) - X64).max() <= cross * np.abs(X64).max(), layer


def test_bf16_moments_through_the_gram_kernel_equal_float64_moments(small_tiles):
    """Moments(precision="bfloat16") with the kernel (a GPU's default; asked for here) against float64
    moments (`_moments_against_float64`): layers raw, split, raw, split; each covariance within 1e-7 of
    its largest entry (measured ≤ 6e-8; with the split layers' lo parts left out 2e-3) and the cross
    moments of every kind of pair within 1e-8 of theirs (≤ 2e-9; without lo parts 2e-5; with the previous
    layer's rows taken with this layer's `ok`, caught by the pairs that differ) — on a GPU 1e-6 each
    (`COV`, `CROSS`); the path recorded."""
    m = Moments(4, 40, DEVICE, precision="bfloat16", background=False, triton=True)
    assert m.paths["moments"] == "bfloat16 (Triton Gram kernel, float64 every 64 rows)"
    _moments_against_float64(m)
    assert m._split == [False, True, False, True] and m._ratio[1] > 500 and m._dim_ratio[3] > 50
    assert m._triton


@pytest.mark.parametrize("fail_at", [1, 3])
def test_a_kernel_that_cannot_launch_leaves_the_moments_to_torchs_products(small_tiles, monkeypatch, fail_at):
    """Where the kernel cannot be compiled or fit on a GPU (Triton raises, e.g. OutOfResources, before it
    adds anything), the bf16 moments go on through torch's products with one warning and the path
    recorded: at the first launch (layer 0's Gram matrix) or at the third (layer 1's cross moment, after
    its Gram matrix was added: the cross moment alone from torch, the previous layer's parts made from its
    kept rows) — and still equal float64 moments, to torch's products' 1e-6 (their float32 sums span a
    batch's rows: 1.7e-7 measured)."""
    from triton.runtime.errors import OutOfResources

    real, launches = gram.add, []

    def add(out, a, b=None):
        launches.append(b is None)
        if len(launches) == fail_at:
            raise OutOfResources(1 << 20, 1 << 16, "shared memory")
        real(out, a, b)

    monkeypatch.setattr(gram, "add", add)
    m = Moments(4, 40, DEVICE, precision="bfloat16", background=False, triton=True)
    with pytest.warns(RuntimeWarning, match="Triton Gram kernel cannot run .*OutOfResources"):
        _moments_against_float64(m, cov=1e-6, cross=1e-6)
    assert not m._triton and len(launches) == fail_at
    assert m.paths["moments"] == "bfloat16 (torch products: the Triton Gram kernel failed)"


@triton_jit
def _rounded(x, out, N: tl.constexpr):
    r = tl.arange(0, N)
    tl.store(out + r, triton_kernels.bf16_rne(tl.load(x + r)))


def test_the_split_rounds_to_the_nearest_bf16_as_a_gpu_converts():
    """The kernel's hi and lo are float32 values rounded to the nearest bf16, ties to even — torch's
    conversion and a GPU's, not the truncation of Triton's interpreter (whose hi + lo would lose up to
    2⁻¹⁵ of a value, not 2⁻¹⁷): random values over many binades, both signs, exact ties, bf16 values."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4096, generator=g) * torch.logspace(-20, 20, 4096)
    x[:1024] = x[:1024].bfloat16().float().view(torch.int32).bitwise_or(0x8000).view(torch.float32)  # ties
    x[1024:1100] = x[1024:1100].bfloat16().float()  # bf16 values: unchanged
    out = torch.empty_like(x, device=DEVICE)
    _rounded[(1,)](x.to(DEVICE), out, 4096)
    assert torch.equal(out.cpu(), x.bfloat16().float())
    truncated = x[:1024].view(torch.int32).bitwise_and(-65536).view(torch.float32)
    assert not torch.equal(x[:1024].bfloat16().float(), truncated)  # the ties tell rounding from truncation


def test_a_gpus_bf16_moments_take_the_gram_kernel_unless_asked_not_to(monkeypatch):
    """gram.wanted: on an NVIDIA GPU of compute capability 8.0 or later (before it Triton's tl.dot has no
    tensor cores) where Triton is there, unless $ISO_MOMENTS_GRAM is `torch`; never on a CPU (there the
    kernel only runs where a caller asks, in Triton's interpreter)."""
    monkeypatch.delenv(gram.ENV, raising=False)
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    assert gram.wanted(torch.device("cuda")) and not gram.wanted(torch.device("cpu"))
    capability[0] = (7, 5)
    assert not gram.wanted(torch.device("cuda"))
    capability[0] = (8, 0)
    assert gram.wanted(torch.device("cuda"))
    monkeypatch.setenv(gram.ENV, "torch")
    assert not gram.wanted(torch.device("cuda"))
    assert Moments(2, 8, "cpu", precision="bfloat16", background=False)._triton is False
    assert Moments(2, 8, "cpu", precision="float32", background=False, triton=True)._triton is False
    monkeypatch.setattr(gram, "FLUSH", gram.BK + 1)
    with pytest.raises(ValueError, match="multiple of gram.BK"):
        gram.add(torch.zeros(8, 8, dtype=torch.float64), (torch.ones(2, 8, dtype=torch.bfloat16),
                                                          torch.ones(2, dtype=torch.bool), torch.zeros(8), False))
