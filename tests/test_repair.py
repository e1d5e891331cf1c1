"""Repair that cannot destroy, and a warehouse that knows when a byte changed.

Checksums recorded per file and verified before a fold; `validate` verifies every file and
re-derives every merged table; `--fix` rebuilds lost or damaged merged tables, quarantines (never
deletes) only provably orphaned files, leaves a writer in flight alone (its lease), and refuses a
folder without a readable commit log; lost or damaged commit records are one line, never a rollback;
kill -9 at every new write point (lease, release, quarantine, S3 move) leaves nothing half-visible."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import ROOT, fork_popen, run_cli
from common.errors import UserError
from test_reliability import extract_args, run_subprocess, snapshot
from warehouse import merge, store
from warehouse.validate import validate

sys.path.insert(0, str(ROOT / "bench"))


@pytest.fixture(scope="session")
def clean(workdir, sources, model_factory):
    """A warehouse holding alpha (before) and one after an uninterrupted alpha+beta run (after)."""
    model = model_factory("gpt_neox", tied=False)
    before = workdir / "rep-before"
    code, _, err = run_cli("extract", "--model", model, "--source", f"alpha={sources['alpha']}", "--warehouse",
                           before, "--max-length", 32, "--batch-size", 2, "--moments", "--sample", 50)
    assert code == 0, err
    after = workdir / "rep-after"
    shutil.copytree(before, after)
    code, _, err = run_cli(*extract_args(model, sources, after))
    assert code == 0, err
    return {"model": model, "before": before, "after": after, "snap_before": snapshot(before),
            "snap_after": snapshot(after)}


def copy(src: Path, dst: Path) -> Path:
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    return dst


def files(wh: Path) -> dict[str, str]:
    """Every file below `wh` → blake2b of its bytes (to prove that nothing was touched)."""
    return {str(p.relative_to(wh)): hashlib.blake2b(p.read_bytes()).hexdigest()
            for p in sorted(wh.rglob("*")) if p.is_file()}


def merged_file(wh: Path, table: str, group: str = "all") -> Path:
    m = store.read_manifest(wh)
    e = next(e for e in m["entries"].values() if e["kind"] == "merged" and e["source"] == group)
    return wh / e["files"][table]


def param_file(wh: Path, table: str) -> Path:
    m = store.read_manifest(wh)
    return wh / next(e["files"][table] for e in m["entries"].values() if table in e["files"])


def flip(path: Path, offset: int, bit: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))


def one_line_error(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for n in needles:
        assert n in lines[0], err


# ---------------------------------------------------------------- checksums


def test_every_committed_file_has_its_size_and_hash(clean):
    wh = clean["after"]
    manifest = store.read_manifest(wh)
    n = 0
    for e in manifest["entries"].values():
        assert set(e["checksums"]) == set(e["files"].values())
        for rel, cs in e["checksums"].items():
            data = (wh / rel).read_bytes()
            assert cs == {"size": len(data), "blake2b": hashlib.blake2b(data).hexdigest()}
            n += 1
    assert n > 20
    for rec in sorted((wh / "_log").glob("*.json")):  # each record carries its own digest
        r = json.loads(rec.read_bytes())
        assert r["digest"] == store.record_digest(r)
    assert not list((wh / "_inflight").glob("*")), "leases of a finished run are removed"


def test_a_changed_byte_in_partition_fn_is_reported(clean, workdir):
    wh = copy(clean["after"], workdir / "rep-pfn")
    victim = param_file(wh, "partition_fn")
    flip(victim, victim.stat().st_size // 2, 3)
    code, out, _ = run_cli("validate", "--warehouse", wh)
    assert code == 1 and victim.name in out and "checksum" in out and "re-extract" in out
    code, out, _ = run_cli("validate", "--warehouse", wh, "--fix")  # a partial's file cannot be rebuilt
    assert code == 1 and victim.name in out


def test_a_flipped_bit_in_moments_merged_is_never_folded_into_all(clean, sources, workdir):
    wh = copy(clean["before"], workdir / "rep-moments")
    victim = merged_file(wh, "moments_merged")
    flip(victim, victim.stat().st_size // 2, 5)
    gen = store.read_state(wh)[0]
    code, out, _ = run_cli("validate", "--warehouse", wh)
    assert code == 1 and victim.name in out
    beta_only = ["extract", "--model", str(clean["model"]), "--source", f"beta={sources['beta']}", "--warehouse",
                 str(wh), "--max-length", "32", "--batch-size", "2", "--moments", "--sample", "50"]
    code, _, err = run_cli(*beta_only)  # beta folds onto the merged moments of 'all' (alpha's)
    one_line_error(code, err, victim.name, "validate --fix")
    assert store.read_state(wh)[0] == gen, "nothing was committed"
    code, out, err = run_cli("validate", "--warehouse", wh, "--fix")
    assert code == 0, out + err
    assert "rebuilt the merged tables" in err
    code, _, err = run_cli(*beta_only)
    assert code == 0, err
    assert snapshot(wh) == clean["snap_after"]
    assert run_cli("validate", "--warehouse", wh)[0] == 0


def test_a_lost_token_stats_of_all_is_rebuilt_and_later_extracts_work(clean, sources, workdir):
    wh = copy(clean["after"], workdir / "rep-lost-stats")
    victim = merged_file(wh, "token_stats")
    victim.unlink()
    code, out, _ = run_cli("validate", "--warehouse", wh)
    assert code == 1 and victim.name in out and "missing" in out
    code, out, err = run_cli("validate", "--warehouse", wh, "--fix")
    assert code == 0, out + err
    assert snapshot(wh) == clean["snap_after"]
    code, _, err = run_cli(*extract_args(clean["model"], sources, wh))  # the same command again
    assert code == 0, err
    assert snapshot(wh) == clean["snap_after"]


@pytest.mark.parametrize("table,column", [("moments_merged", "s1"), ("spectrum", "eigenvalue"),
                                          ("dim_variance", "variance"), ("layer_metrics", "twonn"),
                                          ("frequency_buckets", "sum_sq"), ("samples_merged", "vec"),
                                          ("token_stats", "sum_sq")])
def test_every_merged_table_is_re_derived_from_its_partials(clean, workdir, table, column):
    """A wrong value whose checksum was rewritten too (a bug, not a bit flip): found by re-merging."""
    wh = copy(clean["after"], workdir / f"rep-derive-{table}")
    _tamper(wh, merged_file(wh, table), column)
    problems = validate(wh)
    assert any(f"{table} differs from a fresh merge" in p for p in problems), problems
    assert validate(wh, fix=True) == []
    assert snapshot(wh) == clean["snap_after"]


@pytest.mark.parametrize("group", ["alpha", "all"])
def test_a_wrong_merged_table_of_a_one_source_checkpoint_is_found(clean, workdir, group):
    """Its source group and 'all' hold the same partials (validate merges them once): a wrong value in
    either is found."""
    wh = copy(clean["before"], workdir / f"rep-derive-one-{group}")
    _tamper(wh, merged_file(wh, "token_stats", group), "sum_sq")
    key = next(e["key"] for e in store.read_manifest(wh)["entries"].values()
               if e["kind"] == "merged" and e["source"] == group)
    problems = validate(wh)
    found = [p for p in problems if "differs from a fresh merge" in p]
    assert found and all(p.startswith(f"{key}: token_stats ") for p in found), problems
    assert validate(wh, fix=True) == []
    assert snapshot(wh) == clean["snap_before"]


def _tamper(wh: Path, victim: Path, column: str) -> None:
    """Scale the largest value of `column` in `victim` by 1 + 1e-4 and record the new bytes' checksum."""
    t = pq.read_table(victim)
    col = t.column(column).combine_chunks()
    if pa.types.is_list(col.type):  # a vector column: one value of one row
        flat = col.flatten().to_numpy().astype(np.float64)
        flat[int(np.argmax(np.abs(flat)))] *= 1 + 1e-4
        new = pa.ListArray.from_arrays(col.offsets, pa.array(flat, col.type.value_type), mask=col.is_null())
    else:
        vals = col.to_numpy(zero_copy_only=False).astype(np.float64).copy()
        vals[int(np.nanargmax(np.abs(vals)))] *= 1 + 1e-4
        new = pa.array(vals, col.type)
    pq.write_table(t.set_column(t.schema.get_field_index(column), column, new), victim)
    rel = str(victim.relative_to(wh))
    data = victim.read_bytes()
    for rec_path in sorted((wh / "_log").glob("*.json")):  # rewrite the checksum as if it were written so
        rec = json.loads(rec_path.read_bytes())
        for e in rec["put"] + list(rec.get("manifest", {}).get("entries", {}).values()):
            if rel in e.get("checksums", {}):
                e["checksums"][rel] = {"size": len(data), "blake2b": hashlib.blake2b(data).hexdigest()}
        rec["digest"] = store.record_digest(rec)
        rec_path.write_bytes(store.record_bytes(rec))


# ---------------------------------------------------------------- the log


def test_tables_without_a_log_are_refused_and_untouched(clean, workdir):
    wh = copy(clean["after"], workdir / "rep-nolog")
    shutil.rmtree(wh / "_log")
    before = files(wh)
    for args in (["--fix", "--grace", "0"], []):
        one_line_error(*run_cli("validate", "--warehouse", wh, *args)[::2], "lost")
    for companion in ("manifest.json", "runs.parquet", "views.sql"):  # a bare copy of tables/
        (wh / companion).unlink()
    before = files(wh)
    for args in (["--fix", "--grace", "0"], []):
        one_line_error(*run_cli("validate", "--warehouse", wh, *args)[::2], "no readable commit log")
    assert files(wh) == before


def test_a_lost_latest_record_is_reported_never_rolled_back(clean, workdir):
    wh = copy(clean["after"], workdir / "rep-lost-record")
    latest = sorted((wh / "_log").glob("*.json"))[-1]
    latest.unlink()
    before = files(wh)
    one_line_error(*run_cli("sql", "SELECT count(*) FROM runs", "--warehouse", wh)[::2], "lost")
    one_line_error(*run_cli("validate", "--warehouse", wh)[::2], "lost")
    one_line_error(*run_cli("validate", "--warehouse", wh, "--fix", "--grace", "0")[::2], "lost")
    assert files(wh) == before  # nothing quarantined: the newer data is the lost record's


def test_a_gap_in_the_log_is_reported(clean, workdir):
    wh = copy(clean["after"], workdir / "rep-gap")
    first = sorted((wh / "_log").glob("*.json"))[0]
    first.unlink()
    before = files(wh)
    one_line_error(*run_cli("sql", "SELECT count(*) FROM runs", "--warehouse", wh)[::2], "missing", "lost")
    one_line_error(*run_cli("validate", "--warehouse", wh, "--fix", "--grace", "0")[::2], "missing")
    assert files(wh) == before


@pytest.mark.parametrize("damage", ["truncated", "no put", "changed value", "not an object"])
def test_a_damaged_record_is_one_line_naming_it(clean, workdir, damage):
    wh = copy(clean["after"], workdir / f"rep-damaged-{damage.replace(' ', '-')}")
    rec_path = sorted((wh / "_log").glob("*.json"))[-1]
    data = rec_path.read_bytes()
    rec = json.loads(data)
    if damage == "truncated":
        rec_path.write_bytes(data[: len(data) // 2])
    elif damage == "no put":
        rec.pop("put")
        rec_path.write_bytes(json.dumps(rec).encode())
    elif damage == "changed value":
        rec["put"][0]["stats"]["tokens"] = 12345
        rec_path.write_bytes(store.record_bytes(rec))
    else:
        rec_path.write_bytes(b"[1, 2]")
    before = files(wh)
    for args in (["sql", "SELECT count(*) FROM runs"], ["validate"], ["validate", "--fix"],
                 ["report", "--out", str(workdir / "rep-report")]):
        one_line_error(*run_cli(*args, "--warehouse", wh)[::2], rec_path.name, "damaged commit record")
    assert files(wh) == before


def test_a_space_changed_in_a_record_is_found_by_validate(clean, workdir):
    wh = copy(clean["after"], workdir / "rep-record-space")
    rec_path = sorted((wh / "_log").glob("*.json"))[-1]
    rec_path.write_bytes(rec_path.read_bytes().replace(b", ", b",\t", 1))  # parses to the same record
    one_line_error(*run_cli("validate", "--warehouse", wh)[::2], rec_path.name)


# ---------------------------------------------------------------- repair that cannot destroy


def test_fix_beside_a_writer_in_flight_leaves_its_files_and_the_commit_lands(clean, sources, workdir):
    """The race of repair and commit: a writer that has written its merged files but not its record, and
    `validate --fix --grace 0` beside it.  Its lease keeps its files; it commits; views equal a clean run."""
    wh = copy(clean["before"], workdir / "rep-race")
    flag = workdir / "rep-race.pause"
    flag.touch()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "ISO_PAUSE_FILE": str(flag)}
    proc = fork_popen([sys.executable, str(ROOT / "cli.py"), *extract_args(clean["model"], sources, wh)],
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        reached = Path(str(flag) + ".reached")
        deadline = time.monotonic() + 300
        while not reached.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert reached.exists(), proc.communicate()[1][-2000:] if proc.poll() is not None else "timeout"
        listed = {f for e in store.read_manifest(wh)["entries"].values() for f in e["files"].values()}
        in_flight = [p for p in (wh / "tables").rglob("*.parquet") if str(p.relative_to(wh)) not in listed]
        assert len(in_flight) > 5  # the writer's partials and merged files, not yet committed
        code, out, err = run_cli("validate", "--warehouse", wh, "--fix", "--grace", "0")
        assert code == 0, out + err
        assert "still in flight" in err
        assert all(p.exists() for p in in_flight)
        assert not list((wh / "_quarantine").rglob("*.parquet")) if (wh / "_quarantine").exists() else True
    finally:
        flag.unlink(missing_ok=True)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    assert snapshot(wh) == clean["snap_after"]
    assert run_cli("validate", "--warehouse", wh)[0] == 0


def test_a_dead_writers_files_are_quarantined_after_the_grace_period_and_purged(clean, sources, workdir):
    wh = copy(clean["before"], workdir / "rep-orphans")
    proc = run_subprocess(extract_args(clean["model"], sources, wh), fault="merge:1")  # files, no record
    assert proc.returncode == -9
    shutil.rmtree(wh / "_inflight")  # no lease to prove the writer gone (tests/test_operator_faults.py: with one)
    orphans = files(wh)
    code, out, _ = run_cli("validate", "--warehouse", wh, "--fix")  # default grace 1 h: kept
    assert code == 1 and "younger than the grace period" in out and files(wh) == orphans
    code, out, err = run_cli("validate", "--warehouse", wh, "--fix", "--grace", "0")
    assert code == 0, out + err
    assert snapshot(wh) == clean["snap_before"]
    moved = sorted((wh / "_quarantine").rglob("*.parquet"))
    listed = {f for e in store.read_manifest(wh)["entries"].values() for f in e["files"].values()}
    assert moved and {k for k in files(wh) if k.startswith("tables/")} == listed  # every orphan moved
    quarantined = {str(p.relative_to(wh)).split("/", 2)[2]: hashlib.blake2b(p.read_bytes()).hexdigest()
                   for p in (wh / "_quarantine").rglob("*") if p.is_file()}
    for rel, h in quarantined.items():  # moved byte for byte, under its original path
        assert orphans[rel] == h
    code, out, _ = run_cli("validate", "--warehouse", wh, "--purge")
    assert code == 0 and out.count("deleted ") == len(quarantined)
    assert not [p for p in (wh / "_quarantine").rglob("*") if p.is_file()]


@pytest.mark.parametrize("point", ["lease:1", "release:1"])
def test_kill_9_at_the_lease_points(clean, sources, workdir, point):
    wh = copy(clean["before"], workdir / f"rep-kill-{point.replace(':', '-')}")
    proc = run_subprocess(extract_args(clean["model"], sources, wh), fault=point)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert snapshot(wh) == (clean["snap_after"] if point.startswith("release") else clean["snap_before"])
    code, out, err = run_cli("validate", "--warehouse", wh, "--fix", "--grace", "0")  # the dead lease: no protection
    assert code == 0, out + err
    assert not list((wh / "_inflight").glob("*.json"))
    assert run_cli("validate", "--warehouse", wh)[0] == 0
    code, _, err = run_cli(*extract_args(clean["model"], sources, wh))
    assert code == 0, err
    assert snapshot(wh) == clean["snap_after"]


def test_kill_9_while_quarantining(clean, sources, workdir):
    wh = copy(clean["before"], workdir / "rep-kill-quarantine")
    assert run_subprocess(extract_args(clean["model"], sources, wh), fault="merge:1").returncode == -9
    proc = run_subprocess(["validate", "--warehouse", str(wh), "--fix", "--grace", "0"], fault="quarantine:2")
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert len([p for p in (wh / "_quarantine").rglob("*") if p.is_file()]) == 1  # one moved, whole
    assert snapshot(wh) == clean["snap_before"]
    assert run_cli("validate", "--warehouse", wh, "--fix", "--grace", "0")[0] == 0
    assert run_cli("validate", "--warehouse", wh)[0] == 0
    assert snapshot(wh) == clean["snap_before"]


# ---------------------------------------------------------------- any changed byte is reported


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A small warehouse of synthetic partials (two sources, moments-free), for the property test."""
    from bench_query import write_partial

    root = tmp_path_factory.mktemp("rep-small") / "wh"
    rng = np.random.default_rng(5)
    for source, shard in (("s0", "1-of-2"), ("s0", "2-of-2"), ("s1", "1-of-1")):
        merge.commit(root, [write_partial(root, "m", "c", source, shard, 3, 40, 8, rng, chunk=17)])
    from warehouse.query import refresh_companions
    refresh_companions(root)
    assert validate(root) == []
    return root


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(which=st.floats(0, 1, exclude_max=True), where=st.floats(0, 1, exclude_max=True),
       bit=st.one_of(st.integers(0, 7), st.none()), value=st.integers(0, 255))
def test_any_changed_byte_of_any_file_is_reported(small, tmp_path_factory, which, where, bit, value):
    names = sorted(p.relative_to(small) for p in small.rglob("*") if p.is_file())
    rel = names[int(which * len(names))]
    wh = copy(small, tmp_path_factory.mktemp("rep-prop") / "wh")
    data = bytearray((wh / rel).read_bytes())
    i = int(where * len(data))
    new = data[i] ^ (1 << bit) if bit is not None else (value if value != data[i] else (value + 1) % 256)
    data[i] = new
    (wh / rel).write_bytes(bytes(data))
    try:
        problems = validate(wh)
    except UserError:
        return  # one line (the log or a companion ahead of it)
    if not problems:  # only a derived file whose change made it look behind the log: --fix rewrites it
        assert str(rel) in ("manifest.json", "runs.parquet", "views.sql"), f"{rel}: byte {i} changed, validate ok"
        assert validate(wh, fix=True) == []
        assert (wh / rel).read_bytes() == (small / rel).read_bytes()


def test_a_changed_byte_inside_a_path_of_views_sql_is_not_a_move(small, tmp_path):
    """views.sql of a copied warehouse names the old directory (a move: fine); a byte changed inside
    one of its paths (found by the property test: '/' → NUL) is reported and rewritten by --fix."""
    wh = copy(small, tmp_path / "wh")
    assert validate(wh) == []  # moved: every path names the old directory
    data = (wh / "views.sql").read_bytes()
    i = data.rindex(b"/", 0, data.index(b"/tables/token_stats/"))  # a '/' of the directory's path
    (wh / "views.sql").write_bytes(data[:i] + b"\x00" + data[i + 1:])
    assert any("views.sql: differs" in p for p in validate(wh))
    assert validate(wh, fix=True) == []
    assert b"\x00" not in (wh / "views.sql").read_bytes()


def all_views(wh: Path) -> dict[str, str]:
    """Every view's rows (sorted, as text: NaN equals NaN) through connect()."""
    from warehouse.query import BASE_VIEWS, connect, load_metrics

    with connect(wh) as con:
        return {v: repr(con.sql(f"SELECT * FROM {v} ORDER BY ALL").fetchall())
                for v in (*BASE_VIEWS, *(m.name for m in load_metrics()))}


@pytest.fixture(scope="module")
def own_cache(tmp_path_factory):
    """connect()'s verified-files cache in a directory of this module's own."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
        yield


@pytest.fixture(scope="module")
def small_views(small, own_cache):
    return all_views(small)


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(which=st.floats(0, 1, exclude_max=True), where=st.floats(0, 1, exclude_max=True),
       bit=st.one_of(st.integers(0, 7), st.none()), value=st.integers(0, 255))
def test_a_changed_byte_never_silently_changes_a_view(small, small_views, tmp_path_factory, which, where, bit, value):
    """After any single changed byte or bit of any file, every view — through connect() and through
    `cli.py sql` — gives the clean warehouse's answer or one error line: never another answer."""
    names = sorted(p.relative_to(small) for p in small.rglob("*") if p.is_file())
    rel = names[int(which * len(names))]
    wh = copy(small, tmp_path_factory.mktemp("rep-views") / "wh")
    data = bytearray((wh / rel).read_bytes())
    i = int(where * len(data))
    data[i] = data[i] ^ (1 << bit) if bit is not None else (value if value != data[i] else (value + 1) % 256)
    (wh / rel).write_bytes(bytes(data))
    try:
        got = all_views(wh)
    except UserError as e:
        assert "\n" not in str(e), e
        code, _, err = run_cli("sql", "SELECT * FROM inter_sim", "--warehouse", wh)
        one_line_error(code, err)
        return
    for v, rows in got.items():
        assert rows == small_views[v], f"{rel}: byte {i} changed, view {v} answers differently"


def test_connect_hashes_each_file_version_once(small, own_cache, tmp_path, monkeypatch):
    """A warm cache costs stat() calls only; a file whose bytes change is hashed again and refused."""
    from warehouse import query
    from warehouse.storage import checksums
    from warehouse.query import connect

    calls = []
    real = checksums.checksum
    monkeypatch.setattr(checksums, "checksum", lambda st_, rel: calls.append(rel) or real(st_, rel))
    wh = copy(small, tmp_path / "wh")
    listed = {rel for e in store.read_manifest(wh)["entries"].values() for rel in e["files"].values()}
    connect(wh).close()
    assert set(calls) == listed and len(calls) == len(listed)  # cold: each listed file once
    calls.clear()
    connect(wh).close()
    assert calls == []  # warm: nothing hashed
    target = merged_file(wh, "token_stats")
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 4  # a data page: Parquet itself may not notice
    target.write_bytes(bytes(data))
    with pytest.raises(UserError, match="token_stats.*differs.*validate --fix"):
        connect(wh)
    assert calls == [str(target.relative_to(wh))]
    code, _, err = run_cli("sql", "SELECT 1", "--warehouse", wh)
    one_line_error(code, err, "token_stats", "content differs", "python cli.py validate --fix")
    assert query.verify_listed(small, store.read_manifest(small)) == 0  # the clean copy: still warm


def test_a_commit_puts_its_own_files_in_the_verified_cache(own_cache, tmp_path, monkeypatch):
    """The committer hashed its files while writing them: its commit remembers them (size, times,
    inode as right after the rename), so the first query hashes only what another process wrote —
    and a file changed between its write and the commit is not remembered."""
    from bench_query import write_partial
    from warehouse.storage import checksums
    from warehouse.query import connect

    root = tmp_path / "wh"
    rng = np.random.default_rng(7)
    merge.commit(root, [write_partial(root, "m", "c", "s0", "1-of-1", 3, 40, 8, rng, chunk=17)])
    entry = write_partial(root, "m", "c", "s1", "1-of-1", 3, 40, 8, rng, chunk=17)
    changed = root / entry["files"]["token_sums"]
    os.utime(changed, ns=(1, 1))  # touched after its write: its times no longer match the ones at write
    merge.commit(root, [entry])
    calls = []
    real = checksums.checksum
    monkeypatch.setattr(checksums, "checksum", lambda st_, rel: calls.append(rel) or real(st_, rel))
    connect(root).close()
    assert calls == [entry["files"]["token_sums"]]  # only the file touched after its write
    calls.clear()
    connect(root).close()
    assert calls == []


def test_connect_verifies_every_time_without_a_writable_cache(small, tmp_path, monkeypatch):
    from warehouse.storage import checksums
    from warehouse.query import connect

    ro = tmp_path / "ro-cache"
    ro.mkdir()
    (ro / "isotropy-warehouse").write_text("a file, not a directory")  # unwritable even for root
    ro.chmod(0o500)
    monkeypatch.setenv("XDG_CACHE_HOME", str(ro))
    calls = []
    real = checksums.checksum
    monkeypatch.setattr(checksums, "checksum", lambda st_, rel: calls.append(rel) or real(st_, rel))
    wh = copy(small, tmp_path / "wh")
    try:
        assert all_views(wh) == all_views(small)
        calls.clear()
        connect(wh).close()
        n = len(calls)
        assert n > 0
        connect(wh).close()
        assert len(calls) == 2 * n  # hashed again: nothing could be remembered
        target = merged_file(wh, "layer_totals")
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 1
        target.write_bytes(bytes(data))
        with pytest.raises(UserError, match="layer_totals"):
            connect(wh)
    finally:
        ro.chmod(0o700)


def test_a_changed_first_byte_of_every_file_is_reported(small, tmp_path):
    """The bytes a reader may never look at (a Parquet file's leading magic) count too."""
    for rel in sorted(p.relative_to(small) for p in small.rglob("*") if p.is_file()):
        wh = copy(small, tmp_path / "wh")
        flip(wh / rel, 0, 1)
        try:
            problems = validate(wh)
        except UserError:
            continue
        assert problems, f"{rel}: first byte changed, validate says ok"


# ---------------------------------------------------------------- S3
