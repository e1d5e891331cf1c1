"""The CPU's crew (extract/accumulate/crew.py): its tasks' order and errors, and a layer's token sums and
moments run on it equal to the same arithmetic in order on one thread, bit for bit, and to float64
products of the same rows; the OpenMP spin the command line sets before torch loads."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from accumulator_batches import assert_identical
from common.errors import UserError
from common.openmp import SPIN, short_spin
from conftest import ROOT, one_thread
from extract.accumulate.background import cpu_plan
from extract.accumulate.crew import Crew, Task
from extract.accumulate.matmul import panel_edges
from extract.accumulate.moments import Moments
from extract.accumulate.sums import TokenSums


def test_tasks_run_after_theirs_on_every_helper_and_the_first_error_reaches_the_caller():
    crew = Crew(2)
    log, names = [], threading.Lock()

    def step(name, pause=0.0):
        def fn():
            time.sleep(pause)
            with names:
                log.append((name, threading.current_thread().name, torch.is_inference_mode_enabled()))
        return fn

    a, b = Task(step("a", 0.05)), Task(step("b", 0.05))
    c = Task(step("c"), (a, b))  # after both
    d = Task(step("d"), (c,))
    with torch.inference_mode():
        crew.run([d, c, a, b])  # listed before what they wait for: still after it
    order = [n for n, _, _ in log]
    assert sorted(order) == ["a", "b", "c", "d"] and order.index("c") > max(order.index("a"), order.index("b"))
    assert order.index("d") > order.index("c")
    assert {t for _, t, _ in log[:2]} == {"crew-0", "crew-1"}  # a and b at once, one per helper
    assert all(mode for _, _, mode in log)  # in the caller's inference mode
    log.clear()

    def boom():
        raise RuntimeError("boom")

    first = Task(boom)
    with pytest.raises(RuntimeError, match="boom"):
        crew.run([first, Task(step("after"), (first,))])
    assert log == []  # what waited for the failed task did not run
    crew.run([Task(step("again"))])  # the crew still runs
    seen, one = [], Crew(1)
    count = Task(lambda: seen.append(torch.get_num_threads()), threads=3)
    one.run([count, Task(lambda: seen.append(torch.get_num_threads()), (count,))])
    one.close()
    assert seen == [3, 1]  # a task's own intra-op threads, and one again after it
    assert [n for n, _, _ in log] == ["again"]
    crew.close()
    crew.close()
    crew.run([Task(step("restarted"))])  # a closed crew starts its helpers again
    assert log[-1][0] == "restarted"
    crew.close()


def _batches(d: int, L: int, rng: torch.Generator):
    """Batches of (B, T, d) hidden states per layer — a common mean, layers close to each other — with
    padding, and a NaN and a zero vector in the third batch."""
    out = []
    for k in range(4):
        B, T = (3, 40) if k % 2 == 0 else (5, 24)
        ids = torch.randint(0, 50, (B, T), generator=rng)
        counted = torch.ones(B, T, dtype=torch.bool)
        counted[0, T // 2:] = False  # padding
        hs = [torch.randn(B, T, d, generator=rng) + 4.0]
        for _ in range(L - 1):
            hs.append(hs[-1] + 0.5 * torch.randn(B, T, d, generator=rng))
        if k == 2:
            hs[1][1, 3, 5] = float("nan")
            hs[2][2, 7] = 0.0
        out.append((ids, counted, hs))
    return out


def test_token_sums_and_moments_on_the_crew_equal_one_thread_in_order_bit_for_bit():
    """Two helpers (as on a 2-core machine) against the same tasks run in order on one thread: every sum
    equal bit for bit — the first batch (its centre from the token sums' Σh), padding, a batch whose
    NaN row makes the crew's products skip and go the plain way, the cross moments — and the moments
    equal float64 products of the counted rows."""
    d, L = 256, 3
    batches = _batches(d, L, torch.Generator().manual_seed(0))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        crewed = TokenSums(L, 50, d, "cpu")
        crewed.moments = Moments(L, d, "cpu", cross=True)
    finally:
        torch.set_num_threads(threads)
    assert crewed.moments.crew is not None and crewed.moments.crew.size == 2
    with one_thread():
        alone = TokenSums(L, 50, d, "cpu")
        alone.moments = Moments(L, d, "cpu", cross=True, background=False)
    assert alone.moments.crew is None and alone.moments.worker is None
    runs, plain = [], []
    crew_run, plain_add = crewed.moments.crew.run, crewed.moments._add
    crewed.moments.crew.run = lambda tasks: (runs.append(len(tasks)), crew_run(tasks))[1]
    crewed.moments._add = lambda layer, *a: (plain.append(layer), plain_add(layer, *a))[1]
    rows = [[] for _ in range(L)]  # the counted rows, zeroed where excluded, as the definition takes them
    try:
        with torch.inference_mode():
            for ids, counted, hs in batches:
                for acc in (crewed, alone):
                    with one_thread() if acc is alone else contextlib.nullcontext():
                        acc.set_batch(ids, counted)
                        for layer, h in enumerate(hs):
                            acc.add(layer, h)
                for layer, h in enumerate(hs):
                    r = h[counted].double()
                    rows[layer].append(torch.where(torch.isfinite(r).all(1, keepdim=True), r, 0.0))
        # the first batch of each layer and the NaN batch's layer 1 went the plain way, the rest on the crew
        assert plain == [0, 1, 2, 1] and len(runs) == 3 * L
        assert_identical(crewed, alone, L)
        mc, ma = crewed.moments, alone.moments
        assert torch.equal(mc.n, ma.n) and torch.equal(mc.s1, ma.s1) and torch.equal(mc.n_pair, ma.n_pair)
        assert mc.n.tolist() == [sum(int((r != 0).any(1).sum()) for r in rows[layer]) for layer in range(L)]
        assert crewed.nonfinite.tolist() == [0, 1, 0] and crewed.zero.tolist() == [0, 0, 1]
        for layer in range(L):
            assert np.array_equal(mc.s2(layer), ma.s2(layer)), layer
            X = torch.cat(rows[layer]).numpy()
            exact = X.T @ X
            assert np.abs(mc.s2(layer) - exact).max() <= 1e-6 * np.abs(exact).max(), layer
        job = mc.begin(2, torch.randn(70, d))  # its products wait for every copy of the rows
        copies = [t for t in job.tasks if not t.after]
        assert copies and len(job.tasks) > len(copies)
        assert all(set(t.after) == set(copies) for t in job.tasks if t.after)
        for layer in range(L - 1):
            assert np.array_equal(mc.cross(layer), ma.cross(layer)), layer
            X, Y = torch.cat(rows[layer]).numpy(), torch.cat(rows[layer + 1]).numpy()
            exact = X.T @ Y
            assert np.abs(mc.cross(layer) - exact).max() <= 1e-6 * np.abs(exact).max(), layer
    finally:
        crewed.close()
        alone.close()


def test_where_the_moments_run_is_chosen_by_the_environment():
    assert cpu_plan({}) == ("crew", 1)
    assert cpu_plan({"ISO_MOMENTS_WORKER": "thread", "ISO_WORKER_THREADS": "2"}) == ("thread", 2)
    assert cpu_plan({"ISO_MOMENTS_WORKER": " Inline "}) == ("inline", 1)
    with pytest.raises(UserError, match=r"ISO_MOMENTS_WORKER='pool': expected crew, thread, inline"):
        cpu_plan({"ISO_MOMENTS_WORKER": "pool"})
    with one_thread():  # one intra-op thread: nothing to share, the moments inline
        assert Moments(2, 8, "cpu").crew is None


def test_the_command_line_sets_a_short_openmp_spin_before_torch_loads():
    env = {"KMP_BLOCKTIME": "7"}
    short_spin(env)
    assert env == {"KMP_BLOCKTIME": "7", "GOMP_SPINCOUNT": SPIN["GOMP_SPINCOUNT"]}  # a user's value stays
    code = ("import os, sys; sys.argv = ['cli', '--help']\n"
            "import isotropy_warehouse.cli as c\n"
            "try:\n    c.main()\nexcept SystemExit:\n    pass\n"
            "print(os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules)")
    env = {k: v for k, v in __import__("os").environ.items() if k not in SPIN}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split()[-2:] == [SPIN["GOMP_SPINCOUNT"], "False"]


def test_panel_edges_cover_every_row_once_the_last_halved():
    """The row panels of a product's upper triangle partition its d rows, widest-reaching first; halved,
    the last panel is two of half its width (where it is at least two rows wide).  A CPU's float32 chunks
    take min(8, max(2, d // 128)) panels, the last halved."""
    for d, k in ((512, 4), (256, 2), (300, 2), (5, 8), (1, 4), (2, 1), (7, 4)):
        plain = panel_edges(d, k)
        for halve in (False, True):
            edges = panel_edges(d, k, halve_last=halve)
            assert edges[0][0] == 0 and edges[-1][1] == d
            assert all(a < b for a, b in edges) and all(p[1] == q[0] for p, q in zip(edges, edges[1:]))
            assert len(edges) == len(plain) + (halve and plain[-1][1] - plain[-1][0] >= 2)
    assert panel_edges(512, 4, halve_last=True) == [(0, 128), (128, 256), (256, 384), (384, 448), (448, 512)]
    assert panel_edges(7, 4, halve_last=True)[-2:] == [(5, 6), (6, 7)]
    with one_thread():
        for d, panels in ((128, 2), (512, 4), (1024, 8), (4096, 8)):
            job = Moments(1, d, "cpu", cross=False, background=False)._job(0, torch.zeros(4, d))
            assert len(job.tasks) == 1 + panels + 1, d  # one copy task, the panels, the last one halved
