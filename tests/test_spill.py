"""The token sums under a memory budget (extract/accumulate/): frequent types stay resident, the
evicted ones go to a host tier and to disk runs merged as they accumulate, and the sums read back
equal the unbudgeted ones at every budget; the spill bound; kill -9 during a spill; bad budgets."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import ROOT, fork_run, run_cli
from extract.accumulate.spill import remove_orphans
from extract.accumulate.sums import TokenSums
from extract.accumulate import tables
from extract.accumulate.tables import SlotTable
from common.errors import UserError
from warehouse.query import connect

L, V, D = 3, 1500, 8
B, T = 4, 32


def zipf_batches(n_tokens: int, a: float = 1.1, seed: int = 0, vocab: int = V, d: int = D):
    """(input_ids (B, T), counted (B, T), hidden per layer [(B, T, d)]) of a Zipf(a) id stream;
    some positions not counted, some vectors zero or NaN (excluded, but counted per layer)."""
    rng = np.random.default_rng(seed)
    for _ in range(0, n_tokens, B * T):
        ids = torch.from_numpy(np.minimum(rng.zipf(a, size=(B, T)) - 1, vocab - 1))
        counted = torch.from_numpy(rng.random((B, T)) < 0.9)
        hidden = [torch.from_numpy(rng.standard_normal((B, T, d))).float() for _ in range(L)]
        hidden[1][0, 3] = 0.0
        hidden[2][1, 5, 0] = float("nan")
        yield ids, counted, hidden


def accumulate(n_tokens: int = 20_000, **kw) -> tuple[TokenSums, list]:
    acc = TokenSums(L, V, D, "cpu", **kw)
    for ids, counted, hidden in zipf_batches(n_tokens):
        acc.set_batch(ids, counted)
        for layer in range(L):
            acc.add(layer, hidden[layer])
    return acc, rows(acc)


def rows(acc: TokenSums) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    out = []
    for layer in range(L):
        parts = list(acc.layer_rows(layer, chunk_rows=97))  # small chunks: many token ranges
        out.append(tuple(np.concatenate([p[k] for p in parts]) for k in range(3)))
    return out


@pytest.fixture(scope="module")
def unbudgeted():
    acc, out = accumulate()
    acc.close()
    return acc, out


def same(a: list, b: list, exact: bool = False) -> None:
    for (i0, n0, S0), (i1, n1, S1) in zip(a, b):
        assert np.array_equal(i0, i1) and np.array_equal(n0, n1)  # the same (layer, token) rows and counts
        if exact:
            assert np.array_equal(S0, S1)
        else:  # the order of float64 additions differs: sums of ≤ ~10³ unit vectors, 1e-12 relative
            assert (np.abs(S0 - S1).max(1) / np.maximum(1, np.abs(S0).max(1))).max() < 1e-12


def slot_bytes() -> int:
    return L * (8 * D + 8) + 8


@pytest.mark.parametrize("config", ["plain", "fold", "host", "host+fold", "host-tiny"])
@pytest.mark.parametrize("share", [1, 2, 4, 8, "few"])  # 1: room for growth, no eviction
def test_sums_equal_the_unbudgeted_run_at_every_budget(unbudgeted, tmp_path, config, share):
    """Budgets from the whole table down to a few batches' types; on the CPU with the partial-fold
    path of a separate accumulator device (`fold_partials`, what --accumulator-device takes) and a
    host tier between the table and disk (a cpu "device" table, no pinning)."""
    acc0, want = unbudgeted
    types = sum(len(set(i)) for i, _, _ in want[:1])
    table = acc0.table.resident * slot_bytes()
    budget = {"few": 3 * B * T * slot_bytes(), 1: 2 * acc0.table_bytes()}.get(share) or table // share
    kw = dict(budget=budget, spill_dir=tmp_path, fold_partials="fold" in config or None, host_budget=None)
    if config.startswith("host"):
        kw["host_budget"] = max(table // 2, 3 * B * T * slot_bytes())  # the host tier spills to disk too
    if config == "host-tiny":  # too small for an eviction: the table's rows go straight to disk
        kw["host_budget"] = 4 * slot_bytes()
    acc, got = accumulate(**kw)
    try:
        # the whole table fits: never evicted, bit-identical (the reference is the plain path)
        same(want, got, exact=share == 1 and config in ("plain", "host"))
        if share == 1:
            assert acc.spill_count == 0 and acc.spill_bytes == 0 and types
        else:
            assert acc.peak_bytes <= budget
            assert acc.spill_count > 0 or config.startswith("host")
            if config in ("host", "host+fold"):
                assert acc.host.resident > 0  # the evicted rows went through the host tier
        assert acc.spill_bytes >= acc.disk.bytes_evicted
        assert acc.spill_bytes <= 2.5 * acc.disk.bytes_evicted  # the merge policy's bound (RATIO 2)
    finally:
        acc.close()
    assert not list(tmp_path.iterdir())  # close removes the spill directory


def test_frequent_types_stay_resident(tmp_path):
    """At an eighth of the table, the most frequent types are never evicted: their sums are the
    unbudgeted run's bit for bit and no run holds them; whole-table spilling (EVICT = 1) writes them
    again at every fill: more bytes on this stream (~1.4×; asserted > 1.3×)."""
    acc0, want = accumulate(40_000)
    top = np.argsort(-acc0.freq, kind="stable")[:20]
    budget = acc0.table.resident * slot_bytes() // 8
    acc0.close()
    acc, got = accumulate(40_000, budget=budget, spill_dir=tmp_path, host_budget=None)
    written = acc.spill_bytes
    same(want, got)
    for (i0, _, S0), (i1, _, S1) in zip(want, got):
        at = np.isin(i0, top)
        assert np.array_equal(S0[at], S1[at])
    assert not any(np.isin(top, r.ids).any() for r in acc.disk.runs)
    acc.close()
    old = SlotTable.EVICT
    SlotTable.EVICT = 1.0
    try:
        acc, got = accumulate(40_000, budget=budget, spill_dir=tmp_path, host_budget=None)
        same(want, got)
        assert acc.spill_bytes > 1.3 * written
        acc.close()
    finally:
        SlotTable.EVICT = old


def test_spill_bound_on_a_zipf_stream(tmp_path):
    """A Zipf(1.2) stream of 20k tokens at half the table's bytes: bytes written stay under 2× the
    final table (types seen × (L(8d + 8) + 8)) — 1.4× measured, against 2.8× for whole-table
    spilling (EVICT = 1) — the runs left are few, and reading the sums back reads each spilled byte
    once: bytes read ≤ the bytes on disk.  (The bound holds for this stream, not for every stream:
    bytes written grow with the tail's re-entries, docs/performance.md.)"""
    stream = list(zipf_batches(20_000, a=1.2, seed=3))
    acc = TokenSums(L, V, D, "cpu", host_budget=None)
    for ids, counted, hidden in stream:
        acc.set_batch(ids, counted)
    table = acc.table.resident * slot_bytes()
    acc.close()
    written = {}
    old = SlotTable.EVICT
    try:
        for evict in (old, 1.0):
            SlotTable.EVICT = evict
            acc = TokenSums(L, V, D, "cpu", budget=table // 2, spill_dir=tmp_path, host_budget=None)
            for ids, counted, hidden in stream:
                acc.set_batch(ids, counted)
                for layer in range(L):
                    acc.add(layer, hidden[layer])
            written[evict] = acc.spill_bytes
            if evict == old:
                assert acc.spill_count >= 3 and len(acc.disk.runs) <= 8
                on_disk = sum(p.stat().st_size for r in acc.disk.runs for p in r.path.iterdir()
                              if p.name.startswith(("sums", "counts")))
                before = acc.spill_read_bytes
                rows(acc)
                assert acc.spill_read_bytes - before <= on_disk
            acc.close()
    finally:
        SlotTable.EVICT = old
    assert written[old] <= 2 * table < written[1.0], (written, table)


def test_bad_budgets_in_the_library():
    for budget in (0, -5, slot_bytes() - 1):
        with pytest.raises(UserError, match="below one token type"):
            TokenSums(L, V, D, "cpu", budget=budget)
    with pytest.raises(UserError, match="expected a number of bytes"):
        TokenSums(L, V, D, "cpu", budget="lots")
    with pytest.raises(UserError, match="host tier"):
        TokenSums(L, V, D, "cpu", host_budget=10)


@pytest.mark.parametrize("budget,message", [("0", "must be positive"), ("-5", "expected a size"),
                                            ("lots", "expected a size"), ("100", "below one token type")])
def test_bad_budgets_are_one_line(workdir, sources, model_factory, budget, message):
    wh = workdir / f"spill-bad-{budget}"
    code, _, err = run_cli("extract", "--model", model_factory("gpt_neox"), "--source", f"alpha={sources['alpha']}",
                           "--warehouse", wh, f"--memory-budget={budget}")
    assert code == 2 and message in err and err.startswith("error:") and err.count("\n") == 1, err
    assert not (wh / "tables").exists() or not any((wh / "tables").rglob("*.parquet"))


def test_kill_9_during_a_spill_leaves_nothing(workdir, sources, model_factory, tmp_path):
    """Killed inside a spill: nothing committed; the spill directory left behind is removed by the
    next run that spills there (its lock is held by nobody); that run equals the unbudgeted one, and
    its stats record the spills and the bytes written."""
    model = model_factory("gpt_neox")
    spill_dir = tmp_path / "spill"

    def args(wh, *extra):
        return ["extract", "--model", str(model), "--source", f"alpha={sources['alpha']}", "--warehouse", str(wh),
                "--batch-size", "2", "--max-length", "32", "--vector-dtype", "float64", *extra]

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "ISO_FAULT": "spill:2"}
    killed = workdir / "spill-killed"
    proc = fork_run([sys.executable, str(ROOT / "cli.py"), *args(killed, "--memory-budget", "80KB",
                                                                       "--spill-dir", str(spill_dir))],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert not connect(killed).execute("SELECT count(*) FROM runs WHERE kind = 'data'").fetchone()[0]
    left = list(spill_dir.iterdir())
    assert len(left) == 1 and any(p.name.endswith(".tmp") for p in left[0].iterdir())  # the run it was writing
    code, _, err = run_cli(*args(killed, "--memory-budget", "80KB", "--spill-dir", spill_dir))
    assert code == 0, err
    assert not list(spill_dir.iterdir())  # the orphan swept, its own directory removed at the end
    ref = workdir / "spill-ref"
    code, _, err = run_cli(*args(ref))
    assert code == 0, err
    q = "SELECT layer, token_id, n, vec FROM token_sums ORDER BY layer, token_id"
    a, b = connect(killed).execute(q).fetchall(), connect(ref).execute(q).fetchall()
    assert [r[:3] for r in a] == [r[:3] for r in b]
    assert max(np.abs(np.array(x[3]) - np.array(y[3])).max() for x, y in zip(a, b)) < 1e-12
    stats = json.loads(connect(killed).execute("SELECT stats FROM runs WHERE kind = 'data'").fetchone()[0])
    assert stats["spills"] >= 2 and stats["spill_bytes"] > 0


def test_only_orphans_are_swept(tmp_path):
    """A live accumulator's spill directory survives another's sweep; a dead one's does not."""
    live = TokenSums(L, V, D, "cpu", budget=3 * B * T * slot_bytes(), spill_dir=tmp_path, host_budget=None)
    for ids, counted, hidden in zipf_batches(5_000):
        live.set_batch(ids, counted)
    assert live.spill_count > 0 and live.disk.dir.exists()
    dead = tmp_path / "isotropy-spill-dead"
    (dead / "00000").mkdir(parents=True)
    (dead / "lock").write_text("")
    no_lock = tmp_path / "isotropy-spill-nolock"
    no_lock.mkdir()
    assert remove_orphans(tmp_path) == [dead]
    assert live.disk.dir.exists() and no_lock.exists() and not dead.exists()
    live.close()


def test_a_hidden_spill_directory_left_before_its_lock_goes_only_when_old(tmp_path):
    """A run killed between creating its (hidden) spill directory and locking it leaves
    `.isotropy-spill-*` with no lock: removed once older than the grace (no live run stays unlocked
    that long), kept while young; a hidden one whose lock a live process holds is kept at any age."""
    import fcntl
    import time

    from extract.accumulate import spill

    old, young, held = (tmp_path / f".isotropy-spill-{n}" for n in ("old", "young", "held"))
    for d in (old, young, held):
        d.mkdir()
    with open(held / "lock", "w") as f:  # flock is per open file: remove_orphans' own open cannot take it
        fcntl.flock(f, fcntl.LOCK_EX)
        then = time.time() - spill.HIDDEN_GRACE_S - 5
        for d in (old, held):
            os.utime(d, (then, then))
        assert remove_orphans(tmp_path) == [old]
        assert young.exists() and held.exists()


def test_spill_everything_then_a_lower_budget(unbudgeted, tmp_path):
    """What a split source does when a new value arrives (extract/run/stream.py, accumulate_split): the
    budget is lowered and `spill()` evicts every type and releases the table; the sums still equal
    the unbudgeted run."""
    _, want = unbudgeted
    acc = TokenSums(L, V, D, "cpu", spill_dir=tmp_path, host_budget=None)
    for i, (ids, counted, hidden) in enumerate(zipf_batches(20_000)):
        if i == 40:
            acc.budget = 6 * B * T * slot_bytes()
            acc.spill()
            assert acc.table_bytes() == 0 and acc.spill_count == 1
        acc.set_batch(ids, counted)
        for layer in range(L):
            acc.add(layer, hidden[layer])
    assert acc.table_bytes() <= acc.budget and acc.spill_count > 1
    same(want, rows(acc))
    acc.close()


def test_a_spill_that_cannot_be_written_is_one_line(tmp_path, monkeypatch):
    acc = TokenSums(L, V, D, "cpu", budget=3 * B * T * slot_bytes(), spill_dir=tmp_path, host_budget=None)

    def full(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(np, "save", full)
    with pytest.raises(UserError, match="No space left on device.*--spill-dir"):
        for ids, counted, hidden in zipf_batches(5_000):
            acc.set_batch(ids, counted)
    acc.close()
    assert not list(tmp_path.iterdir())


def test_a_spill_dir_that_cannot_be_made_is_one_line(tmp_path):
    """--spill-dir naming a file (or a directory that cannot be made): one line naming the option,
    not `[Errno 17] File exists`."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    acc = TokenSums(L, V, D, "cpu", budget=3 * B * T * slot_bytes(), spill_dir=afile, host_budget=None)
    with pytest.raises(UserError, match=f"--spill-dir {afile}: File exists; choose another --spill-dir"):
        for ids, counted, hidden in zipf_batches(5_000):
            acc.set_batch(ids, counted)
    acc.close()
    assert afile.read_text() == "x"


def test_a_cpu_table_grows_within_one_reservation(unbudgeted, monkeypatch):
    """On a CPU the table's rows are views of one allocation per layer sized for the most the table may
    hold (the vocabulary, or the budget's share): growing moves no row, zeroes only the new ones, and
    the pages beyond them are never touched (the process's resident memory grows by the rows reached,
    not by the reservation).  Where the allocation is refused, or reservations are off, each growth
    copies — the same sums bit for bit, with a budget too (the growth schedule is the same, so
    evictions fall alike); a raised budget that outgrows the reservation moves the rows once."""
    def resident() -> int:
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    if not tables.lazy_memory():  # strict overcommit or `ulimit -v`: reservations are off (tested below)
        pytest.skip("this system commits memory on allocation: a CPU table grows by copying")

    big = 200_000
    table = SlotTable(2, big, 512, "cpu", None, np.zeros(big, dtype=np.int64))
    before = resident()
    assert table.grow(10) and table.capacity == 1024
    assert resident() - before < 64 << 20  # 2 layers × 1,024 rows: 8 MiB, not 2 × 819 MB
    assert table.sums[0].untyped_storage().nbytes() == big * 512 * 8  # a view of the whole reservation
    where = [t.data_ptr() for t in table.sums + table.counts]
    table.sums[1][5] = 7.0
    table.counts[1][5] = 3
    assert table.grow(3000) and table.capacity == 3000
    assert [t.data_ptr() for t in table.sums + table.counts] == where  # nothing moved
    assert table.sums[1][5].eq(7.0).all() and table.counts[1][5] == 3
    assert not table.sums[1][6:].any() and not table.counts[1][6:].any()  # the new rows zeroed

    acc0, want = unbudgeted
    assert acc0.table.sums[0].untyped_storage().nbytes() == V * D * 8  # the reference reserved
    real_empty, asked = torch.empty, []

    def refuse(*size, **kw):  # the reservation (the first allocation of V rows) is refused
        asked.append(size)
        if len(asked) == 1 and size[0] == V:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
        return real_empty(*size, **kw)

    for system in (refuse, None):  # refused; a system where reserving would spend a limit (`lazy_memory`)
        with monkeypatch.context() as m:
            if system is refuse:
                m.setattr(torch, "empty", refuse)
            else:
                m.setattr(tables, "lazy_memory", lambda: False)
            acc, got = accumulate()
            assert acc.table.sums[0].untyped_storage().nbytes() == acc.capacity * D * 8  # copied growth
            acc.close()
        same(want, got, exact=True)
    assert asked[0][0] == V
    child = ("import resource, sys; sys.path.insert(0, '.'); resource.setrlimit(resource.RLIMIT_AS, (1 << 40, 1 << 40)); "
             "from extract.accumulate.tables import lazy_memory; print(lazy_memory())")
    assert subprocess.run([sys.executable, "-c", child], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip() == "False"  # under `ulimit -v`
    budget = acc0.table.resident * slot_bytes() // 4
    runs = []
    for reserve in (True, False):
        monkeypatch.setattr(SlotTable, "RESERVE", reserve)
        acc, got = accumulate(budget=budget, host_budget=None)
        assert acc.spill_count > 0 and acc.peak_bytes <= budget
        runs.append((got, acc.spill_count, acc.capacity))
        acc.close()
    assert runs[0][1:] == runs[1][1:]
    same(runs[0][0], runs[1][0], exact=True)

    monkeypatch.setattr(SlotTable, "RESERVE", True)
    row = 2 * (8 * 512 + 8)
    table = SlotTable(2, big, 512, "cpu", 5000 * row, np.zeros(big, dtype=np.int64))
    assert table.grow(2000) and table.sums[0].untyped_storage().nbytes() < 5000 * 512 * 8
    table.sums[0][1999] = 1.5
    table.budget = None  # raised: the next growth outgrows the reservation
    assert table.grow(9000) and table.sums[0][1999].eq(1.5).all() and not table.sums[0][2000:].any()
    assert table.peak_bytes >= 2 * (9000 + 2000) * (8 * 512 + 8)  # both reservations' rows, every layer, at once
    assert table.sums[0].untyped_storage().nbytes() == big * 512 * 8
