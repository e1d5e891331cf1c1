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

from accumulator_batches import assert_same, batch, feed
from extract.accumulate import fused, kernels, matmul
from extract.accumulate import moments as moments_module
from extract.accumulate.moments import Moments
from extract.accumulate.sums import TokenSums

# The dynamo settings these tests change; each test must leave them readable and as they were.
_DYNAMO_SETTINGS = ("recompile_limit", "fail_on_recompile_limit_hit")


@pytest.fixture(autouse=True)
def _dynamo_config_left_as_found():
    """Fails the test that leaves torch._dynamo.config changed or unreadable: the state is per process,
    and a later compile in the same pytest-xdist worker would fall back to eager for no reason of its
    own.  (The failure seen in CI: pytest >= 9.2's `monkeypatch.setattr` records a torch config module's
    setting as "absent" — settings live in the module's `_config`, not its `__dict__` — and its undo
    `delattr`s it, which torch's ConfigModule implements as *hide*: every later read, dynamo's own
    `config.recompile_limit` in the next compile included, raised "torch._dynamo.config.recompile_limit
    does not exist".  Torch settings are changed with `torch._dynamo.config.patch`, never monkeypatch.)"""
    before = {name: getattr(torch._dynamo.config, name) for name in _DYNAMO_SETTINGS}
    yield  # torn down after monkeypatch's undo (autouse fixtures are set up first)
    after = {}
    for name in _DYNAMO_SETTINGS:
        try:
            after[name] = getattr(torch._dynamo.config, name)
        except AttributeError as e:
            pytest.fail(f"the test left torch._dynamo.config unreadable: {e}")
    assert after == before, "the test left torch._dynamo.config changed"


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
        feed([eager, fused], [(1, d)], V, d, L, gen)  # warm-up: the one compile
        graphs = counters["stats"]["unique_graphs"]
        recompiles = sum(counters["recompiles"].values())
        feed([eager, fused], [(1, 7), (3, 1), (1, 1), (2, d), (5, 3), (1, 2)], V, d, L, gen)
        feed([eager, fused], [(64, 40)], V, d, L, gen)  # > 1,024 new token types: the table grows
        ids, counted, hidden = batch(2, 3, V, d, gen)
        for acc in (eager, fused):  # a batch with no counted position (only special tokens): adds nothing
            acc.set_batch(ids, counted & False)
            for layer in range(L):
                acc.add(layer, hidden)
    assert fused.capacity > 1024
    assert counters["stats"]["unique_graphs"] == graphs, "the compiled step recompiled"
    assert sum(counters["recompiles"].values()) == recompiles
    assert fused._fused is not None and fused.paths["layer_step"] == "compiled"
    assert_same(eager, fused, L)


def test_a_failed_recompile_falls_back_to_eager_with_one_warning():
    """A compile that fails after a first success (or torch's recompile limit, an error here) is not
    fatal: the step runs eagerly from then on, with one one-line RuntimeWarning and the path recorded;
    the sums equal the eager path's."""
    L, V, d = 2, 40, 4
    gen = torch.Generator().manual_seed(1)
    eager, fused = TokenSums(L, V, d, "cpu", fused=False), TokenSums(L, V, d, "cpu", fused=True)
    fused._fused = lambda *a: kernels.layer_step(*a)  # a "compiled" step that works (the compiler is slow)
    feed([eager, fused], [(2, 3)], V, d, L, gen)
    assert fused._compiled_once

    def broken(*a):
        raise RuntimeError("inductor exploded\nsecond line")

    fused._fused = broken
    with pytest.warns(RuntimeWarning) as caught:
        feed([eager, fused], [(1, 5), (3, 2)], V, d, L, gen)
    msgs = [str(w.message) for w in caught if "accumulation step" in str(w.message)]
    assert len(msgs) == 1 and "\n" not in msgs[0] and "recompile failed (RuntimeError: inductor exploded)" in msgs[0]
    assert fused._fused is None and fused.paths["layer_step"] == "eager (recompile failed: RuntimeError)"
    assert_same(eager, fused, L)


def test_recompile_limit_is_an_error_not_a_silent_eager_fallback():
    """torch's recompile limit, hit inside `run_compiled`, raises (instead of torch running the step
    eagerly without a word): `add` falls back to its own eager path with one warning, the path
    recorded, the sums right.  (dynamo's "eager" backend and a limit of 1: fast; a dtype change forces
    the recompile.  The limit is set with torch's own `config.patch`, not monkeypatch: see
    `_dynamo_config_left_as_found`.)"""
    L, V, d = 1, 40, 4
    gen = torch.Generator().manual_seed(3)
    eager, fused = TokenSums(L, V, d, "cpu", fused=False), TokenSums(L, V, d, "cpu", fused=True)
    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(recompile_limit=1):
            fused._fused = torch.compile(kernels.layer_step, backend="eager")
            feed([eager, fused], [(2, 3)], V, d, L, gen)  # bf16: compiled
            assert fused._compiled_once and fused._fused is not None
            ids, counted, hidden = batch(3, 2, V, d, gen)
            with pytest.warns(RuntimeWarning, match="recompile failed \\(FailOnRecompileLimitHit"):
                for acc in (eager, fused):
                    acc.set_batch(ids, counted)
                    acc.add(0, hidden.float())  # float32: another graph, over the limit
    finally:
        torch._dynamo.reset()  # the eager-backend entries on layer_step's code: not for the next test
    assert fused._fused is None and fused.paths["layer_step"] == "eager (recompile failed: FailOnRecompileLimitHit)"
    assert not torch._dynamo.config.fail_on_recompile_limit_hit  # set only around the call
    assert_same(eager, fused, L)


def test_bf16_product_probe_runs_on_the_rows_device_and_its_fallback_warns(monkeypatch):
    """The `out_dtype` probe is asked about the rows' own device (never a default "cuda"), once; where
    it says no on a GPU, the products run in float32 with one one-line warning and the path recorded
    — and the sums stay right (against float64 products)."""
    asked = []

    def probe(device):
        asked.append(device)
        return False

    monkeypatch.setattr(moments_module, "mm_out_dtype", probe)
    gen = torch.Generator().manual_seed(2)
    d = 6
    fast = Moments(2, d, "cpu", precision="bfloat16", background=False)
    assert fast.paths["moments"] == "bfloat16 (float32 products of the upcast rows)"
    fast._tensor_cores = True  # what a GPU's Moments sets: the probe is asked
    exact = Moments(2, d, "cpu", precision="float64", background=False)
    with pytest.warns(RuntimeWarning) as caught:
        for _ in range(3):
            ok = torch.ones(20, dtype=torch.bool)
            for layer in range(2):
                h = (torch.randn(20, d, generator=gen) + 3).bfloat16()
                for m in (fast, exact):
                    m.add(layer, h, ok)
    msgs = [str(w.message) for w in caught if "out_dtype" in str(w.message)]
    assert len(msgs) == 1 and "\n" not in msgs[0] and "float32 (~10x slower)" in msgs[0]
    assert asked == [torch.device("cpu")]  # the rows' device, once
    assert fast.paths["moments"] == "bfloat16 (float32 products: no mm out_dtype)" and fast._out_dtype is False
    for layer in range(2):
        ref = exact.s2(layer)
        assert np.abs(fast.s2(layer) - ref).max() <= 1e-6 * np.abs(ref).max()


def test_the_probe_itself_fails_closed(monkeypatch):
    """`mm_out_dtype` on a device whose torch.mm rejects `out_dtype` answers False (not an error)."""
    matmul.mm_out_dtype.cache_clear()

    def mm(*a, **k):
        raise TypeError("mm() got an unexpected keyword argument 'out_dtype'")

    monkeypatch.setattr(torch, "mm", mm)
    try:
        assert matmul.mm_out_dtype(torch.device("cpu")) is False
    finally:
        matmul.mm_out_dtype.cache_clear()


def _sums(model_dir, source_path, monkeypatch, prefetch: int, mask_only_with_padding: bool, **settings):
    from extract.run import settings as run_settings, stream as run
    from extract.models import load, resolve_model
    from extract.sources import Source

    monkeypatch.setattr(run, "PREFETCH_BATCHES", prefetch)
    monkeypatch.setattr(run, "MASK_ONLY_WITH_PADDING", mask_only_with_padding)
    seen = []
    real = run.base_forward

    def spy(loaded, s):  # which batches went in without a mask
        fwd = real(loaded, s)

        def go(ids, mask):
            seen.append(bool(mask.all()))
            return fwd(ids, mask)
        return go

    monkeypatch.setattr(run, "base_forward", spy)
    loaded = load(resolve_model(str(model_dir)), "main", torch.float32, "cpu")
    s = run_settings.Settings(**settings)
    result = run_settings.SourceResult("alpha")
    acc = run.accumulate_source(loaded, Source("alpha", source_path), s, result)
    try:
        out = [acc.dense(layer) for layer in range(acc.L)]
        return out, acc.moments.s1.clone(), acc.moments.s2(1), acc.sum_h.clone(), acc.window_cos.clone(), result, seen
    finally:
        acc.close()


@pytest.mark.parametrize("family", ["gpt_neox", "bert"])
def test_background_batches_and_no_mask_without_padding_give_identical_sums(family, model_factory, sources,
                                                                             monkeypatch):
    """The batch loop with batches made on a background thread and attention_mask=None for batches
    without padding: the token sums, moments and window sums equal the old loop's (batches made in
    the loop, a mask always) bit for bit — batches of one window (no padding) and of several."""
    model = model_factory(family)
    for size in (1, 4):
        old = _sums(model, sources["alpha"], monkeypatch, 0, False, batch_size=size, max_length=24)
        new = _sums(model, sources["alpha"], monkeypatch, 4, True, batch_size=size, max_length=24)
        for (ce, se), (cn, sn) in zip(old[0], new[0]):
            assert torch.equal(ce, cn) and torch.equal(se, sn)
        assert torch.equal(old[1], new[1]) and np.array_equal(old[2], new[2])
        assert torch.equal(old[3], new[3]) and torch.equal(old[4], new[4])
        assert old[5].tokens == new[5].tokens > 0 and old[5].documents == new[5].documents
        assert any(old[6]) and (size == 1) == all(old[6])  # some batches had no padding (all, one window each)
        by_type = {"moments_by_type": "layer 0 (its rows are the input embedding's)"} if family == "gpt_neox" else {}
        assert new[5].paths == {"layer_step": "eager", "scatter": "atomic", "moments": old[5].paths["moments"],
                                "cpu_rows": "numba", **by_type}  # BERT's layer 0 adds position embeddings and a LayerNorm: not by type


def synthetic(ratio: float, d: int, rows: int, L: int, batch: int, seed: int):
    """bf16 rows h = μ_l + z, z ~ N(0, diag(σ²)) with σ² over a decade, ‖μ_l‖²/tr C = ratio; 1 % zeroed."""
    g = torch.Generator().manual_seed(seed)
    sig = torch.logspace(0, -1, d, dtype=torch.float64)
    mus = [v / v.norm() * (ratio * float(sig.square().sum())) ** 0.5
           for v in (torch.randn(d, generator=g, dtype=torch.float64) for _ in range(L))]
    out = []
    for a in range(0, rows, batch):
        k = min(batch, rows - a)
        ok = torch.rand(k, generator=g) > 0.01
        out.append(([(mu + torch.randn(k, d, generator=g, dtype=torch.float64) * sig).bfloat16() for mu in mus], ok))
    return out


def row_by_row(a: torch.Tensor, b: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """torch.mm for float32 operands as the least accurate usual GEMM computes it: a (i, k) b (k, j)
    summed over k one term after another in float32 (no blocking, no wider accumulator)."""
    if a.dtype != torch.float32 or args or kwargs:
        return REAL_MM(a, b, *args, **kwargs)
    acc = torch.zeros(a.shape[0], b.shape[1])
    for r in range(a.shape[1]):
        acc.addr_(a[:, r], b[r])  # each product exact (bf16 values), each sum rounded to float32
    return acc


REAL_MM = torch.mm


@pytest.mark.parametrize("gemm", ["torch", "row by row"])
def test_bf16_moments_error_is_bounded_whatever_the_mean(gemm, monkeypatch):
    """precision "bfloat16" against float64 products of the same bf16 rows: a layer whose first batch
    has ‖μ‖²/tr C above SPLIT_RATIO is centred and split into bf16 hi + lo parts, and its covariance
    stays within 5e-6 of the largest entry at ‖μ‖²/tr C = 1e3 (raw rows there: 100× more) — layers raw,
    split and raw in turn, so that every kind of pair's cross moment is checked; zeroed rows, several
    products per batch, the background thread bit for bit.  The bounds hold whatever float32 GEMM the
    CPU has: checked with this torch's and with the float32 products summed row by row (the worst
    usual order; measured there: the raw rows 8.5e-3, the mild layers ≤ 1.5e-6, the split layer 2.4e-9)."""
    if gemm == "row by row":
        monkeypatch.setattr(torch, "mm", row_by_row)
        monkeypatch.setattr(moments_module, "mm_bf16", lambda a, b, out_dtype=False: row_by_row(a.float(), b.float()))
    L, d = 3, 24
    rows = synthetic(1e3, d, 6000, L=L, batch=1500, seed=4)
    mild = synthetic(0.1, d, 6000, L=L, batch=1500, seed=5)
    batches = [([m[0][0], h[0][1], m[0][2]], h[1] & m[1]) for m, h in zip(mild, rows)]  # ratios 0.1, 1e3, 0.1
    batches = [([h.masked_fill(~ok[:, None], 0) for h in hs], ok) for hs, ok in batches]
    ms = {name: Moments(L, d, "cpu", precision="bfloat16", background=bg) for name, bg in
          (("inline", False), ("thread", True), ("raw", False))}
    ms["raw"].SPLIT_RATIO = ms["raw"].SPLIT_DIM_RATIO = float("inf")
    for m in ms.values():
        m.CHUNK_BF16 = 1024
    exact = Moments(L, d, "cpu", precision="float64", background=False)
    from conftest import one_thread

    with one_thread():  # the worker's own count: float32 products summed in the same order on both
        for hs, ok in batches:
            for layer, h in enumerate(hs):
                for m in (*ms.values(), exact):
                    m.add(layer, h, ok)
        ms["thread"].finish()
    inline, thread, raw = ms["inline"], ms["thread"], ms["raw"]
    assert inline._split == [False, True, False] and raw._split == [False, False, False]
    assert inline.paths["moments_rows"] == "centred hi+lo in layers [1] (|mu|^2/tr C > 1 or max mu_i^2/max C_ii > 8), raw elsewhere"
    assert raw.paths["moments_rows"] == "raw" and 500 < inline._ratio[1] < 2000

    def cov_error(m, layer):
        n = float(exact.n[layer])
        mu = exact.s1[layer].numpy() / n
        C64 = exact.s2(layer) / n - np.outer(mu, mu)
        return np.abs(m.s2(layer) / n - np.outer(mu, mu) - C64).max() / np.abs(C64).max()

    # the split layer: 2.4e-9 through either GEMM; a lost loᵀlo term would be a ~4e-6 bias on the diagonal
    assert cov_error(inline, 1) <= 1e-7 and cov_error(raw, 1) > 100 * max(cov_error(inline, 1), 1e-9)  # the split matters
    for layer in range(L):
        assert cov_error(inline, layer) <= 5e-6, layer
        assert np.array_equal(inline.s2(layer), thread.s2(layer))
    assert torch.equal(inline.s1, exact.s1) and torch.equal(inline.n, exact.n) and torch.equal(inline.n_pair, exact.n_pair)
    for layer in range(L - 1):  # raw → split and split → raw pairs
        X64 = exact.cross(layer)
        assert np.abs(inline.cross(layer) - X64).max() <= 1e-6 * np.abs(X64).max(), layer
        assert np.array_equal(inline.cross(layer), thread.cross(layer))
    thread.close()


def _raw_floor(batches, layer: int, chunk: int, n: float, C64: np.ndarray) -> float:
    """The covariance error the raw bf16 path makes however exact its GEMM: every chunk's float32
    product correctly rounded (the least a float32 output can be off), relative to the largest entry."""
    err = np.zeros_like(C64)
    for hs, _ in batches:
        h = hs[layer].double()
        for a in range(0, len(h), chunk):
            g = h[a: a + chunk].T @ h[a: a + chunk]  # exact: products of bf16 values summed in float64
            err += (g.float().double() - g).numpy()
    return float(np.abs(err / n).max() / np.abs(C64).max())


def test_bf16_raw_rows_lose_a_dominant_means_covariance_on_every_cpu():
    """Why a mean-dominated layer is centred and split, shown on any CPU's GEMM (AVX2, AVX-512, bf16
    kernels, AMX): at ‖μ‖²/tr C = 1e5 the raw path's float32 products cannot be within 1e-4 of the
    largest covariance entry (even correctly rounded, each chunk's output is off by more: asserted on
    the data), while the centred hi + lo path stays within 5e-6."""
    L, d = 1, 16
    batches = [([h[0]], ok) for h, ok in synthetic(1e5, d, 3000, L=L, batch=1500, seed=6)]
    batches = [([h.masked_fill(~ok[:, None], 0) for h in hs], ok) for hs, ok in batches]
    split, raw = (Moments(L, d, "cpu", precision="bfloat16", background=False) for _ in range(2))
    raw.SPLIT_RATIO = raw.SPLIT_DIM_RATIO = float("inf")
    exact = Moments(L, d, "cpu", precision="float64", background=False)
    for m in (split, raw):
        m.CHUNK_BF16 = 1024
    for hs, ok in batches:
        for m in (split, raw, exact):
            m.add(0, hs[0], ok)
    n = float(exact.n[0])
    mu = exact.s1[0].numpy() / n
    C64 = exact.s2(0) / n - np.outer(mu, mu)
    err = {k: np.abs(m.s2(0) / n - np.outer(mu, mu) - C64).max() / np.abs(C64).max() for k, m in
           (("split", split), ("raw", raw))}
    assert split._split == [True] and raw._split == [False]
    assert _raw_floor(batches, 0, 1024, n, C64) > 1e-4  # the construction: no float32 output can do better
    assert err["raw"] > 1e-4 and err["split"] <= 5e-6, err


def test_doctor_measures_checks_and_saves_a_report(model_factory, sources, tmp_path):
    """`cli.py doctor` on a tiny model for a fraction of a second: the ratio, tok/s, peak memory, the
    paths taken, the check against float64 and versions, printed and saved as JSON; bad input is one
    error line and exit code 2."""
    import json

    from conftest import run_cli

    out = tmp_path / "doctor.json"
    code, _, err = run_cli("doctor", "--model", model_factory("gpt_neox"), "--device", "cpu", "--seconds", "0.2",
                           "--batches", "2", "--batch-tokens", "64", "--max-length", "24", "--source", f"alpha={sources['alpha']}", "--out", out)
    assert code == 0, err
    rep = json.loads(out.read_text())
    assert rep["device"] == "cpu" and rep["passes"] >= 1 and rep["batches"] == 2 and rep["tokens_per_pass"] > 0
    assert rep["bare_tok_s"] > 0 and rep["default_tok_s"] > 0 and rep["ratio"] > 0 and rep["peak_memory_bytes"] > 0
    assert rep["paths"] == {"layer_step": "eager", "scatter": "atomic", "moments": "float32 (centred, oneDNN)"
                            if matmul.ONEDNN is not None and matmul.mkl_skips_avx512() else "float32 (centred)",
                            "moments_by_type": "layer 0 (its rows are the input embedding's)", "cpu_rows": "numba"}
    assert rep["check"]["token_sums_max_rel_error"] <= 1e-12 and rep["check"]["moments_covariance_max_rel_error"] <= 1e-5
    assert rep["versions"]["torch"] and "ratio" in err and "saved:" in err
    assert "doctor: warm-up: one bare forward pass" in err and "alternating the bare forward" in err  # never silent
    code, _, err = run_cli("doctor", "--model", model_factory("gpt_neox"), "--seconds", "0", "--out", out)
    assert code == 2 and err.strip() == "error: --seconds 0.0: expected a positive number"
    for args, message in ((["--out", tmp_path / "no" / "r.json"], f"--out {tmp_path / 'no' / 'r.json'}: no directory"),
                          (["--out", tmp_path], "is a directory"),
                          (["--device", "tpu"], "--device 'tpu': expected cpu or cuda")):
        code, _, err = run_cli("doctor", "--model", model_factory("gpt_neox"), "--seconds", "0.1", *args)
        assert code == 2 and err.startswith("error: ") and message in err and err.count("\n") == 1, err
    if not torch.cuda.is_available():  # was torch's AssertionError (a traceback)
        code, _, err = run_cli("doctor", "--model", model_factory("gpt_neox"), "--device", "cuda")
        assert code == 2 and err.strip() == "error: --device cuda: no CUDA device is available", err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the CPU tests above cover the arithmetic)")
def test_the_whole_batch_loop_has_no_host_sync_on_cuda(model_factory, sources, monkeypatch):
    """On a GPU, after the first batch (which compiles the step and decides each layer's bf16 rows),
    the whole batch loop — batches made on the background thread, pinned copies, the forward without
    a mask, the hooks, the token sums, bf16 moments — runs under CUDA's sync debug mode "error"."""
    from extract.run import settings as run_settings, stream as run
    from extract.models import load, resolve_model, to_compute
    from extract.sources import Source

    loaded = load(resolve_model(str(model_factory("gpt_neox"))), "main", torch.bfloat16, "cuda")
    to_compute(loaded, torch.bfloat16, "cuda")
    real = run.forward_batch
    calls = []

    def forward(*a):
        calls.append(1)
        if len(calls) == 2:  # from the second batch on
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        return real(*a)

    real_finish = run._finish

    def finish(*a):  # the loop is over: the source's counts are read to the host here, once
        torch.cuda.set_sync_debug_mode("default")
        calls.append("finish")
        return real_finish(*a)

    monkeypatch.setattr(run, "forward_batch", forward)
    monkeypatch.setattr(run, "_finish", finish)
    s = run_settings.Settings(device="cuda", dtype="bfloat16", moments_precision="bfloat16", batch_size=2, max_length=24,
                     memory_budget=1 << 30)
    try:
        acc = run.accumulate_source(loaded, Source("alpha", sources["alpha"]), s, run_settings.SourceResult("alpha"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    try:
        assert len(calls) > 4 and calls[-1] == "finish"
        assert acc.paths["layer_step"] == ("triton" if fused.enabled() else "compiled")
    finally:
        acc.close()


def test_moments_fed_the_compiled_steps_n_and_sum_equal_their_own():
    """On the compiled path the bf16 moments take n and Σh from the token-sum step's per-window sums
    instead of reading the rows again: the same sums, bit for bit, as the eager path's moments that
    compute them (NaN/zero rows, padding, several batches, the centred layers' decision included)."""
    L, V, d = 2, 3000, 4
    gen = torch.Generator().manual_seed(7)
    accs = [TokenSums(L, V, d, "cpu", fused=f) for f in (False, True)]
    for acc in accs:
        acc.moments = Moments(L, d, "cpu", precision="bfloat16", background=False)
    fed = []
    real = accs[1].moments.add
    accs[1].moments.add = lambda *a, **k: (fed.append(k.get("s") is not None), real(*a, **k))
    with warnings.catch_warnings():
        # a fallback to eager fails here, naming torch's error (the compiled path is what this test is about)
        warnings.filterwarnings("error", "torch.compile of the accumulation step", RuntimeWarning)
        for B, T in ((3, 5), (1, d), (2, 7)):
            ids, counted, hidden = batch(B, T, V, d, gen)
            hidden = hidden + 3  # a mean: layer 0 is centred and split, the other raw
            hidden[0, 0, 1] = float("nan")
            for acc in accs:
                acc.set_batch(ids, counted)
                for layer in range(L):
                    acc.add(layer, hidden if layer == 0 else hidden - 3)
    eager, fused = accs
    assert all(fed) and len(fed) == 6 and fused._fused is not None
    me, mf = eager.moments, fused.moments
    assert torch.equal(me.n, mf.n) and torch.equal(me.s1, mf.s1) and me._split == mf._split == [True, False]
    for layer in range(L):
        assert np.array_equal(me.s2(layer), mf.s2(layer))


def test_compiled_step_gives_the_window_measures_their_terms_without_recompiles():
    """--sequences on the compiled path: `layer_step` computes the per-window measures' row terms
    (Σ|h|, row maxima, the curvature's ‖v‖ and ⟨v', v⟩, float64) from the masked float64 rows it
    forms for the token sums, and `WindowMeasures` reads only the few rows it needs (the windows'
    last vectors, the top-k rows) — with the moments on, from their gathered rows; alone, gathered
    from the hidden states.  Equal to the float64 definition to 1e-12 (counts exact, the top-k
    identical) like the eager path; B = 1, T = 1 and T = d batches after the warm-up compile nothing."""
    from test_sequences import assert_windows_equal_definition, feed_windows, window_definition, windows_batch

    from extract.sequences import WindowMeasures

    L, V, d = 2, 3000, 8
    gen = torch.Generator().manual_seed(1)
    warm = [windows_batch(1, d, V, d, gen)]  # T == d, B = 1 in the first batch
    rest = [windows_batch(B, T, V, d, gen) for B, T in ((1, 7), (3, 1), (1, 1), (2, d), (5, 9), (1, 2), (4, 30))]
    accs = {(f, mo): TokenSums(L, V, d, "cpu", fused=f) for f, mo in ((False, False), (True, False), (True, True))}
    given = []
    for (f, mo), acc in accs.items():
        acc.extra = WindowMeasures(L, d, "cpu", top_k=5)
        if mo:
            acc.moments = Moments(L, d, "cpu", precision="bfloat16", background=False)
        real = acc.extra.add

        def spy(*a, real=real, key=(f, mo), **kw):
            given.append((key, kw.get("terms") is not None, kw.get("sel") is not None))
            return real(*a, **kw)
        acc.extra.add = spy
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback warning may fire
        for acc in accs.values():
            feed_windows(acc, warm, L)
        graphs = counters["stats"]["unique_graphs"]
        recompiles = sum(counters["recompiles"].values())
        for acc in accs.values():
            feed_windows(acc, rest, L)
    if any(acc._fused is None for (f, _), acc in accs.items() if f):  # inductor could not compile here
        pytest.skip("the compiled step fell back to eager in this environment: nothing to compare")
    assert counters["stats"]["unique_graphs"] == graphs and sum(counters["recompiles"].values()) == recompiles
    assert {(k, t, s) for k, t, s in given} == {((False, False), True, False), ((True, False), True, True),
                                                ((True, True), True, False)}  # terms from the pass everywhere
    want = window_definition(warm + rest, L, d, 5)
    for acc in accs.values():
        assert_windows_equal_definition(acc.extra, want, L)
    assert_same(accs[(False, False)], accs[(True, False)], L)


@pytest.mark.parametrize("family", ["gpt_neox", "llama", "gemma2", "bert"])
@pytest.mark.parametrize("padded", [True, False])
def test_a_batch_reads_nothing_of_its_device_tensors_and_gives_the_same_states(family, padded, model_factory,
                                                                                monkeypatch):
    """transformers' questions before it builds a mask are answered from the host (extract/masks.py) —
    no tensor is read into a Python bool during the forward (on a GPU each read is a host sync): with
    padding, whether the mask may be dropped (`fast_all`, `.all()`); without, whether the model's own
    position ids pack sequences (`find_packed_sequence_indices`).  Every layer's hidden states equal
    those of transformers' own path bit for bit (causal, sliding-window and bidirectional models)."""
    from transformers import masking_utils

    from extract.architectures import get_module
    from extract.hooks import capture_layers
    from extract.models import forward_kwargs, load, resolve_model
    from extract.run import settings as run_settings, stream as run

    loaded = load(resolve_model(str(model_factory(family))), "main", torch.float32, "cpu")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, loaded.model.config.vocab_size, (3, 12), generator=g)
    mask = torch.ones(3, 12, dtype=torch.long)
    if padded:
        mask[1, 7:] = 0
        mask[2, 3:] = 0

    def states(forward):
        out = {}
        with torch.inference_mode(), capture_layers(loaded.model, loaded.layout,
                                                    lambda layer, h: out.__setitem__(layer, h.clone())):
            forward()
        return out

    base = get_module(loaded.model, loaded.layout.base)
    plain = states(lambda: base(input_ids=ids, attention_mask=mask if padded else None,
                                **forward_kwargs(loaded.layout.head)))
    reads = []
    real_bool, real_fast_all = torch.Tensor.__bool__, masking_utils.fast_all
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda t: reads.append("bool") or real_bool(t))
    monkeypatch.setattr(masking_utils, "fast_all", lambda t: reads.append("fast_all") or real_fast_all(t))
    fwd = run.base_forward(loaded, run_settings.Settings())
    ours = states(lambda: fwd(ids, mask))
    monkeypatch.undo()
    assert reads == []
    assert plain.keys() == ours.keys() and len(plain) >= 3
    for layer in plain:
        assert torch.equal(plain[layer], ours[layer]), layer
    for name in ("_ignore_causal_mask_sdpa", "find_packed_sequence_indices"):  # the originals are back
        assert getattr(masking_utils, name).__module__ == "transformers.masking_utils", name
