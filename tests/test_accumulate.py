"""The accumulators themselves, apart from a command: the compiled GPU step against the eager path, the
moments on a background thread, the oneDNN and bfloat16 products and the GPU paths against float64,
and the background queue's byte bound."""

from __future__ import annotations

import platform
import threading

import numpy as np
import pytest
import torch

from accumulator_batches import assert_same
from common.errors import UserError
from extract.accumulate import matmul
from extract.accumulate.background import SideStream
from extract.accumulate.moments import Moments
from extract.accumulate.sums import TokenSums


def test_compiled_gpu_step_equals_the_eager_path():
    """The GPU path (`layer_step` under torch.compile, over whole (B, T, d) batches) gives the
    eager path's sums, counts, excluded-vector counts and per-window sums, padding and NaN/inf
    and zero vectors included (compiled here for the CPU; on a GPU the same graph becomes Triton)."""
    torch.manual_seed(0)
    accs = [TokenSums(2, 20, 8, "cpu", fused=f) for f in (False, True)]
    accs += [TokenSums(2, 20, 8, "cpu", fold_partials=True)]  # per-batch partials folded in
    accs += [TokenSums(2, 20, 8, "cpu"), TokenSums(2, 20, 8, "cpu")]
    accs[-2].CHUNK = 5  # the CPU path in chunks of 5 rows: chunks with and without NaN/zero rows
    accs[-1].host_sync_free = False  # the general eager path (a GPU's without the compiler), whole batches
    for acc in accs:  # the moments ride along on every path
        acc.moments = Moments(2, 8, "cpu", precision="float64")
    for step in range(2):
        ids = torch.randint(0, 20, (3, 6))
        counted = torch.ones(3, 6, dtype=torch.bool)
        counted[2, 4:] = False  # padding
        counted[1, 0] = False  # a special token
        hidden = torch.randn(3, 6, 8).bfloat16()
        hidden[0, 1, 2] = float("nan")
        hidden[1, 3] = 0.0
        hidden[2, 5] = float("inf")  # padding: never counted, never summed
        for acc in accs:
            acc.set_batch(ids, counted)
            for layer in range(2):
                acc.add(layer, (hidden * (layer + 1)).roll(layer, -1))  # another direction per layer
    eager, fused, folded, chunked, general = accs
    assert fused._fused is not None and eager._fused is None and folded._fused is None
    for layer in range(2):  # the CPU path in chunks is the general path's arithmetic in its order: same bits
        for other in (chunked, general):
            (ce, se), (cf, sf) = eager.dense(layer), other.dense(layer)
            assert torch.equal(ce, cf) and torch.equal(se, sf)
    for other in (fused, folded, chunked, general):  # the compiled step; per-batch partials folded in
        assert_same(eager, other, 2)
    assert eager.nonfinite.tolist() == [2, 2] and eager.zero.tolist() == [2, 2]
    for other in (chunked, general):
        assert torch.equal(eager.sum_h, other.sum_h) and torch.equal(eager.window_cos, other.window_cos)
        for name in ("change_n", "change_cos", "change_angle", "unit_windows", "sum_ubar", "sum_ubar_sq"):
            assert torch.equal(getattr(eager, name), getattr(other, name)), name
        assert torch.equal(eager.moments.s1, other.moments.s1) and np.array_equal(eager.moments.s2(1), other.moments.s2(1))
    me, mf = eager.moments, fused.moments
    assert torch.equal(me.n, mf.n) and torch.equal(me.n_pair, mf.n_pair) and me.n.tolist() == [26, 26]  # 30 counted, 4 NaN/zero
    assert torch.allclose(me.s1, mf.s1, rtol=1e-13, atol=1e-13)
    assert np.allclose(me.s2(1), mf.s2(1), rtol=1e-13, atol=1e-13)
    assert np.allclose(me.cross(0), mf.cross(0), rtol=1e-13, atol=1e-13)


def test_moments_on_a_background_thread_equal_inline_bit_for_bit():
    """On a CPU the d×d products run on one low-priority thread, in submission order: the sums are
    the inline ones bit for bit (both precisions), pairs and zeroed rows included; an error in the
    thread reaches the caller; close() stops it."""
    torch.manual_seed(0)
    for precision in ("float32", "float64"):
        ms = [Moments(3, 16, "cpu", precision=precision, background=b) for b in (False, True)]
        for _ in range(5):
            hs = [torch.randn(40, 16) * 3 + 50 * (layer + 1) for layer in range(3)]
            ok = torch.rand(40) > 0.1
            for m in ms:
                for layer, h in enumerate(hs):
                    m.add(layer, h.masked_fill(~ok[:, None], 0), ok)
        inline, bg = ms
        assert inline._worker is None and bg._worker is not None and bg._worker._thread is not None
        for layer in range(3):
            assert np.array_equal(inline.s2(layer), bg.s2(layer)), (precision, layer)
        for layer in range(2):
            assert np.array_equal(inline.cross(layer), bg.cross(layer)), (precision, layer)
        assert torch.equal(inline.n_pair, bg.n_pair) and torch.equal(inline.s1, bg.s1)
        bg.close()
        assert bg._worker._thread is None
    m = Moments(2, 4, "cpu", background=True)
    m._add = lambda *a: (_ for _ in ()).throw(RuntimeError("boom"))  # the thread's work fails
    m.add(0, torch.ones(3, 4), torch.ones(3, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="boom"):
        m.finish()
    with pytest.raises(RuntimeError, match="boom"):
        m.add(1, torch.ones(3, 4), torch.ones(3, dtype=torch.bool))
    m.close()
    assert Moments(2, 4, "meta").__dict__["_worker"] is None  # not a CPU: inline (a GPU queues kernels itself)


def test_onednn_products_equal_the_torch_path_and_float64():
    """The CPU's float32 products, in row chunks, through oneDNN on the transposed rows (taken where
    AMD CPUs with AVX-512) and through torch on the rows as they are (MKL; Intel and AVX2 CPUs),
    the latter also with Σh given by the caller (the token sums': the rows centred as they are
    copied), all against the exact float64 products — batches of changing size (the reused
    buffers grow and shrink) split into row chunks, an odd d, bf16 and float32 input, zeroed rows,
    pairs."""
    if platform.machine().lower() in ("x86_64", "amd64") and torch.backends.mkldnn.is_available():
        assert matmul.ONEDNN is not None  # CI's machine takes the fast path: it is what this checks
    else:
        pytest.skip("oneDNN's path is x86-64 only")
    torch.manual_seed(3)
    for d in (17, 64):
        fast, slow, given = (Moments(3, d, "cpu", background=False) for _ in range(3))
        fast._nt, slow._nt, given._nt = matmul.ONEDNN, None, None  # oneDNN on transposed rows; MKL on the rows
        fast.CHUNK = slow.CHUNK = given.CHUNK = 32  # several chunks per batch, a partial last one
        exact = Moments(3, d, "cpu", precision="float64", background=False)
        assert exact._nt is None and not exact._chunked
        for M, dtype in ((50, torch.float32), (120, torch.bfloat16), (7, torch.float32), (90, torch.float32)):
            ok = torch.rand(M) > 0.1
            for layer in range(3):
                h = (torch.randn(M, d) * (layer + 1) + 30).to(dtype).masked_fill(~ok[:, None], 0)
                for m in (fast, slow, exact):
                    m.add(layer, h, ok)
                given.add(layer, h, ok, s=h.double().sum(0), n=ok.sum())
        assert given._c_set == slow._c_set == [True] * 3
        for layer in range(3):
            ref64 = exact.s2(layer)
            for m in (fast, slow, given):
                assert np.abs(m.s2(layer) - ref64).max() <= 1e-6 * np.abs(ref64).max(), (d, layer)
                assert torch.allclose(m.s1, exact.s1, rtol=1e-14, atol=0) and torch.equal(m.n, exact.n)
        for layer in range(2):
            ref64 = exact.cross(layer)
            for m in (fast, slow, given):
                assert np.abs(m.cross(layer) - ref64).max() <= 1e-6 * np.abs(ref64).max(), (d, layer)
        for m in (fast, slow, given):
            assert torch.equal(m.n_pair, exact.n_pair)
    default = Moments(2, 4, "cpu", background=False)  # the layout this CPU gets
    assert default._chunked and (default._nt is matmul.ONEDNN) == matmul.mkl_skips_avx512()
    assert matmul.mkl_skips_avx512() <= matmul.avx512()


def test_bfloat16_moments_are_exact_products_against_float64():
    """precision "bfloat16" (the GPU default with a bf16 model): the raw bf16 rows' products, exact
    in float32, accumulated in float32 over ≤ CHUNK_BF16 rows, the Gram matrix's upper triangle by
    panels and the cross moment as one h_prevᵀh product — against float64 products on the same rows:
    batches of changing size, several chunks and a partial last one, zeroed rows, a large mean
    (no centre: the products must stay exact), the background thread bit for bit; float32 rows
    are refused with a one-line error."""
    a = torch.tensor([[3.0, -2.5, 0.5], [1.25, 7.0, -0.75]]).bfloat16()  # exact in float32 and float64
    assert torch.equal(matmul.mm_bf16(a, a.T).double(), a.double() @ a.double().T)
    torch.manual_seed(5)
    for d in (17, 64):
        fast = [Moments(3, d, "cpu", precision="bfloat16", background=b) for b in (False, True)]
        for m in fast:
            m.CHUNK_BF16 = 32
        exact = Moments(3, d, "cpu", precision="float64", background=False)
        for M in (50, 120, 7, 90):
            ok = torch.rand(M) > 0.1
            for layer in range(3):
                h = (torch.randn(M, d) * (layer + 1) + 4).bfloat16().masked_fill(~ok[:, None], 0)
                for m in (*fast, exact):
                    m.add(layer, h, ok)
        inline, bg = fast
        for layer in range(3):
            ref64 = exact.s2(layer)
            assert np.array_equal(inline.s2(layer), bg.s2(layer))
            assert np.abs(inline.s2(layer) - ref64).max() <= 1e-6 * np.abs(ref64).max(), (d, layer)  # ~3e-8
        for layer in range(2):
            ref64 = exact.cross(layer)
            assert np.array_equal(inline.cross(layer), bg.cross(layer))
            assert np.abs(inline.cross(layer) - ref64).max() <= 1e-6 * np.abs(ref64).max(), (d, layer)
        assert torch.equal(inline.s1, exact.s1) and torch.equal(inline.n, exact.n)  # bf16 sums of ≤ 120 rows: exact
        assert torch.equal(inline.n_pair, exact.n_pair)
        bg.close()
    with pytest.raises(UserError, match="needs bfloat16 hidden states; layer 1's are float32"):
        Moments(2, 4, "cpu", precision="bfloat16").add(1, torch.ones(3, 4), torch.ones(3, dtype=torch.bool))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the CPU tests above cover the arithmetic)")
def test_gpu_paths_against_float64_without_host_syncs():
    """On a GPU: the compiled step against the CPU's eager path; bf16 moments (gram.py's kernel, its default
    tiles) on the side stream against float64 products; and no host synchronisation inside `add`
    (CUDA's sync debug mode raises on one)."""
    torch.manual_seed(0)
    L, V, d = 3, 500, 64
    from extract.sequences import WindowMeasures

    cpu = TokenSums(L, V, d, "cpu")
    cpu.moments = Moments(L, d, "cpu", precision="float64", background=False)
    cpu.extra = WindowMeasures(L, d, "cpu", precision="float64")
    gpus = [TokenSums(L, V, d, "cuda")]
    for g in gpus:
        g.moments = Moments(L, d, "cuda", precision="bfloat16", background=True)
        g.extra = WindowMeasures(L, d, "cuda", worker=g.moments._worker)
    assert gpus[0]._fused is not None
    assert isinstance(gpus[0].moments._worker, SideStream)
    for step in range(4):
        ids = torch.randint(0, V, (4, 50))
        counted = torch.ones(4, 50, dtype=torch.bool)
        counted[3, 40:] = False
        hidden = [(torch.randn(4, 50, d) * (layer + 1) + 2).bfloat16() for layer in range(L)]
        hidden[1][0, 3] = 0.0
        cpu.set_batch(ids, counted)
        for layer, h in enumerate(hidden):
            cpu.add(layer, h)
        for g in gpus:
            g.set_batch(ids, counted)
            hs = [h.cuda() for h in hidden]
            torch.cuda.synchronize()
            if step:  # the first batch compiles
                torch.cuda.set_sync_debug_mode("error")
            try:
                for layer, h in enumerate(hs):
                    g.add(layer, h)
            finally:
                torch.cuda.set_sync_debug_mode(0)
    for g in gpus:
        for layer in range(L):
            (cc, sc), (cg, sg) = cpu.dense(layer), g.dense(layer)
            assert torch.equal(cc, cg) and torch.allclose(sc, sg, rtol=1e-12, atol=1e-12)
            ref64 = cpu.moments.s2(layer)
            assert np.abs(g.moments.s2(layer) - ref64).max() <= 1e-6 * np.abs(ref64).max()
        for layer in range(L - 1):
            ref64 = cpu.moments.cross(layer)
            assert np.abs(g.moments.cross(layer) - ref64).max() <= 1e-6 * np.abs(ref64).max()
        assert torch.equal(g.moments.n.cpu(), cpu.moments.n) and torch.equal(g.zero.cpu(), cpu.zero)
        for name in ("sum_h", "window_cos"):
            assert torch.allclose(getattr(g, name).cpu(), getattr(cpu, name), rtol=1e-12, atol=1e-12), name
        g.extra.finish()
        # the per-window measures on the device, same stream discipline; Σ|h| sums each row in float32 (not in
        # bf16, where another order moved it by an ulp, 7e-6), so 1e-6 is ~10× the orders' difference
        for name in ("sum_abs", "curv_sum"):
            assert torch.allclose(getattr(g.extra, name).cpu(), getattr(cpu.extra, name), rtol=1e-6), name
        assert torch.equal(g.extra.curv_windows.cpu(), cpu.extra.curv_windows)
        for layer in range(L):
            assert g.extra.top(layer) == cpu.extra.top(layer)
            for pooling, mo in g.extra.pooled.items():
                ref64 = cpu.extra.pooled[pooling].s2(layer)
                assert np.abs(mo.s2(layer) - ref64).max() <= 1e-12 * np.abs(ref64).max(), pooling  # float64 products
        g.close()


def test_background_queue_is_bounded_in_bytes():
    """The rows waiting for the moments' thread never exceed the byte cap (one call over the cap
    still runs alone), and the sums equal inline ones."""
    torch.manual_seed(1)
    rows = 64 * 16 * 4  # bytes of one layer's float32 rows below
    inline = Moments(4, 16, "cpu", background=False)
    bg = Moments(4, 16, "cpu", background=True)
    bg._worker._max_bytes = 2 * rows  # two layers' rows at most
    for _ in range(6):
        ok = torch.ones(64, dtype=torch.bool)
        for layer in range(4):
            h = torch.randn(64, 16)
            inline.add(layer, h, ok)
            bg.add(layer, h, ok)
    bg.finish()
    assert 0 < bg._worker.peak_bytes <= 2 * rows and bg._worker._pending == 0
    assert all(np.array_equal(inline.s2(i), bg.s2(i)) for i in range(4))
    w = bg._worker
    gate, entered = threading.Event(), []
    w.submit(gate.wait, nbytes=rows)  # the thread is busy with `rows` bytes queued
    t = threading.Thread(target=lambda: (w.submit(lambda: None, nbytes=2 * rows), entered.append(1)))
    t.start()
    t.join(0.3)
    assert not entered  # rows + 2·rows > the cap: the caller waits ...
    gate.set()
    t.join(5)
    assert entered  # ... until the thread has freed the first call's rows
    w.wait()
    w._max_bytes = 1
    w.submit(lambda: None, nbytes=10 * rows)  # larger than the cap: runs alone, never deadlocks
    w.wait()
    bg.close()
