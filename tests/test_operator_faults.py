"""What an operator runs into: whether a writer is alive, paths that look like patterns, a disk full
after a commit's record, a copy taken during a commit, and the read-only wrapper's allow-list.

Each case ends by comparing every view with a clean warehouse built the same way.  The warehouses
are small synthetic ones (bench/bench_query.write_partial: random, self-consistent sums), built in
a second; processes are started only where the test is about processes (a writer in another pid
namespace, a kill -9, a fault point read from the environment).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import numpy as np
import pytest

from conftest import ROOT, run_cli
from common import faults
from common.errors import UserError
from warehouse import merge, store
from warehouse.query import BASE_VIEWS, connect, load_metrics, refresh_companions, sql
from warehouse.validate import validate

sys.path.insert(0, str(ROOT / "bench"))
from bench_query import write_partial  # noqa: E402

PARTIALS = [("s0", "1-of-2"), ("s0", "2-of-2"), ("s1", "1-of-1")]


def partial(root, i: int) -> dict:
    """Partial i of PARTIALS, the same numbers in every warehouse (its own seed)."""
    source, shard = PARTIALS[i]
    return write_partial(root, "m", "c", source, shard, 3, 40, 8, np.random.default_rng(100 + i), chunk=17)


def build(root: Path, pending: int = 0) -> Path:
    """The three partials committed one by one, the last `pending` of them without a fold."""
    for i in range(len(PARTIALS)):
        merge.commit(root, [partial(root, i)], fold=i < len(PARTIALS) - pending)
    refresh_companions(root)
    return root


def all_views(wh) -> dict[str, str]:
    """Every view's rows (sorted, as text), runs without its run ids and times."""
    import warnings

    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # partials pending a fold: said by a note, compared here anyway
        with connect(wh) as con:
            for v in (*BASE_VIEWS, *(m.name for m in load_metrics())):
                q = (f"SELECT * FROM {v} ORDER BY ALL" if v != "runs" else
                     "SELECT kind, model, checkpoint, source, shard, tokens, folded FROM runs ORDER BY ALL")
                out[v] = repr(con.sql(q).fetchall())
    return out


@pytest.fixture(scope="module")
def own_cache(tmp_path_factory):
    """connect()'s verified-files cache in a directory of this module's own."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
        yield


@pytest.fixture(scope="module")
def clean(tmp_path_factory, own_cache):
    """Every view of the three partials, all folded; and of the first two folded, the third pending."""
    done = build(tmp_path_factory.mktemp("clean") / "wh")
    waiting = build(tmp_path_factory.mktemp("clean-pending") / "wh", pending=1)
    return {"wh": done, "views": all_views(done), "pending": all_views(waiting), "pending_wh": waiting}


def tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.blake2b(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def unlisted(wh: Path) -> list[str]:
    listed = {f for e in store.read_manifest(wh)["entries"].values() for f in e["files"].values()}
    return sorted(str(p.relative_to(wh)) for p in (wh / "tables").rglob("*") if p.is_file()
                  and str(p.relative_to(wh)) not in listed)


def cli(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, str(ROOT / "cli.py"), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}, cwd=ROOT)


def lease(run_id: str, **fields) -> dict:
    """A lease of this process, with `fields` changed."""
    return {"run_id": run_id, "host": store.HOST, **store.own_identity(), "started": time.time(),
            "heartbeat": time.time(), "interval": store.HEARTBEAT_S, **fields}


def forge_lease(wh: Path, run_id: str, **fields) -> None:
    """Replace this process's lease of `run_id` by another writer's (its files stay unlisted)."""
    store.release_leases(merge.open_storage(wh), [run_id])
    (wh / "_inflight").mkdir(exist_ok=True)
    (wh / "_inflight" / f"{run_id}.json").write_text(json.dumps(lease(run_id, **fields)))


def start_time(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])


# ---------------------------------------------------------------- liveness: the rule


def test_the_liveness_rule():
    """Proof where the reader shares the writer's boot and pid namespace; the heartbeat elsewhere."""
    now = time.time()
    me = lease("r")
    assert store.lease_state(me, now)[0] == store.LIVE  # this very process
    other = lease("r", pid=1, pid_start=start_time(1) + 1)  # pid 1 lives, but started at another time
    assert store.lease_state(other, now) == (store.GONE, "pid 1 is another process now")
    child = subprocess.Popen(["true"])
    child.wait()  # exited and reaped: its pid is free
    assert store.lease_state(lease("r", pid=child.pid, pid_start=123), now)[0] == store.GONE
    zombie = subprocess.Popen(["sh", "-c", "exit 0"])
    deadline = time.monotonic() + 10
    while Path(f"/proc/{zombie.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert store.lease_state(lease("r", pid=zombie.pid, pid_start=start_time(zombie.pid)), now)[0] == store.GONE
    zombie.wait()
    stale = now - store.STALE_AFTER * store.HEARTBEAT_S - 1
    for elsewhere in ({"pid_ns": me["pid_ns"] + 1}, {"boot_id": "another-boot"}, {"host": "h2", "boot_id": "b2"}):
        dead_here = {**elsewhere, "pid": child.pid}  # no such pid here: it says nothing about another namespace
        assert store.lease_state(lease("r", **dead_here), now)[0] == store.LIVE  # fresh heartbeat
        assert store.lease_state(lease("r", **dead_here, heartbeat=stale), now)[0] == store.STALE
        assert store.lease_state(lease("r", **elsewhere, heartbeat=stale), now)[0] == store.STALE
    old = {"run_id": "r", "host": store.HOST, "pid": os.getpid(), "heartbeat": now}  # without process identity
    assert store.lease_state(old, now)[0] == store.LIVE
    assert store.lease_state({**old, "heartbeat": stale}, now)[0] == store.STALE  # pid reused, or hung
    assert store.lease_state({**old, "pid": child.pid}, now)[0] == store.STALE  # never proven: the grace applies
    assert store.lease_state({**old, "host": "h2", "pid": child.pid}, now)[0] == store.LIVE


def test_a_lease_records_the_process_identity_and_its_interval(tmp_path):
    entry = partial(tmp_path / "wh", 0)
    info = json.loads((tmp_path / "wh" / "_inflight" / f"{entry['run_id']}.json").read_text())
    assert {k: info[k] for k in ("pid", "pid_start", "boot_id", "pid_ns")} == {
        "pid": os.getpid(), "pid_start": start_time(os.getpid()),
        "boot_id": Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
        "pid_ns": os.stat("/proc/self/ns/pid").st_ino}
    assert info["interval"] == store.HEARTBEAT_S and abs(info["heartbeat"] - time.time()) < 60
    store.release_leases(merge.open_storage(tmp_path / "wh"), [entry["run_id"]])


# ---------------------------------------------------------------- liveness: writers


def _unshare_refusal() -> str | None:
    try:
        r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, text=True,
                           timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    return None if r.returncode == 0 else (r.stderr.strip() or f"exit {r.returncode}")


WRITER = """
import sys
from pathlib import Path
sys.path[:0] = [{root!r}, {bench!r}, {tests!r}]
from test_operator_faults import partial
from warehouse import merge
wh = Path(sys.argv[1])
merge.commit(wh, [partial(wh, 2)])  # waits at the 'merge' point while the pause file exists
"""


def test_a_writer_in_another_pid_namespace_keeps_its_files(clean, tmp_path):
    """A writer in its own pid namespace (a second container, an Apptainer --containall job), paused
    between its files and its record, beside `validate --fix --grace 0`: its lease's pid means nothing
    here, its fresh heartbeat keeps its files; it commits, and every view equals a clean run."""
    refused = _unshare_refusal()
    if refused:
        pytest.skip(f"unshare --pid --fork --mount-proc refused here: {refused} (the rule for a lease of another "
                    "pid namespace is tested in test_the_liveness_rule and test_a_fresh_lease_of_another_namespace…)")
    wh = tmp_path / "wh"
    for i in range(2):
        merge.commit(wh, [partial(wh, i)])
    flag = tmp_path / "pause"
    flag.touch()
    script = WRITER.format(root=str(ROOT), bench=str(ROOT / "bench"), tests=str(ROOT / "tests"))
    proc = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", script, str(wh)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "ISO_PAUSE_FILE": str(flag)})
    try:
        reached = Path(str(flag) + ".reached")
        deadline = time.monotonic() + 120
        while not reached.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert reached.exists(), proc.communicate()[1][-2000:] if proc.poll() is not None else "timeout"
        infos = [json.loads(p.read_text()) for p in (wh / "_inflight").glob("*.json")]  # its partial's, its fold's
        assert len(infos) >= 2 and all(i["pid_ns"] != os.stat("/proc/self/ns/pid").st_ino for i in infos)  # its own
        in_flight = unlisted(wh)
        assert len(in_flight) >= 4  # its partial and the merged files of both groups
        code, out, err = run_cli("validate", "--warehouse", wh, "--fix", "--grace", "0")
        assert code == 0, out + err
        assert "still in flight" in err and "heartbeat" in err
        assert unlisted(wh) == in_flight and not (wh / "_quarantine").exists()
    finally:
        flag.unlink(missing_ok=True)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    assert all_views(wh) == clean["views"]
    assert validate(wh) == []


def test_a_fresh_lease_of_another_namespace_protects_a_stale_one_waits_the_grace(clean, tmp_path):
    """The same rule without a namespace: a lease whose pid namespace differs (its pid gone here)."""
    wh = tmp_path / "wh"
    for i in range(2):
        merge.commit(wh, [partial(wh, i)])
    entry = partial(wh, 2)
    gone_pid = subprocess.Popen(["true"])
    gone_pid.wait()
    forge_lease(wh, entry["run_id"], pid=gone_pid.pid, pid_ns=store.own_identity()["pid_ns"] + 1)
    files = unlisted(wh)
    assert validate(wh, fix=True, grace_s=0) == [] and unlisted(wh) == files  # fresh heartbeat: in flight
    merge.commit(wh, [entry])  # it commits
    assert all_views(wh) == clean["views"] and validate(wh) == []
    # a stale lease of another namespace: not a proof, so the files wait out the grace period
    entry = write_partial(wh, "m", "c", "s2", "1-of-1", 3, 40, 8, np.random.default_rng(9), chunk=17)
    forge_lease(wh, entry["run_id"], pid=gone_pid.pid, pid_ns=store.own_identity()["pid_ns"] + 1,
                heartbeat=time.time() - 3600)
    problems = validate(wh, fix=True)  # default grace: kept
    assert len(problems) == 2 and all("younger than the grace period" in p for p in problems)
    assert validate(wh, fix=True, grace_s=0) == [] and unlisted(wh) == []
    assert all_views(wh) == clean["views"]


def test_pid_reuse_does_not_keep_a_dead_writers_files(clean, tmp_path):
    """A killed merge whose pid went to an unrelated process: its lease names a live pid with another
    start time — proven gone, so `--fix` moves every orphan at once (the default grace included)."""
    wh = build(tmp_path / "wh", pending=1)
    st = merge.open_storage(wh)
    seq, manifest = store.read_state(wh)
    folded = merge.fold_groups(wh, manifest, [], [], [("m", "c")])  # a merge's files, its record never made
    run_ids = {e["run_id"] for e in folded}
    for run_id in run_ids:
        forge_lease(wh, run_id, pid=1, pid_start=start_time(1) + 7)
    orphans = unlisted(wh)
    assert len(orphans) >= 4
    code, out, err = run_cli("validate", "--warehouse", wh)
    problems = out.strip().splitlines()
    assert code == 1 and len(problems) == 1, out + err  # one summary line, not one per file
    assert problems[0].startswith(f"{len(orphans)} file(s) not listed in the manifest") and "another process" in out
    code, out, err = run_cli("validate", "--warehouse", wh, "--fix")
    assert code == 0, out + err
    assert unlisted(wh) == [] and not list((wh / "_inflight").glob("*.json"))
    assert len([p for p in (wh / "_quarantine").rglob("*.parquet")]) == len(orphans)
    assert all_views(wh) == clean["pending"]
    assert st.exists(store.MANIFEST) and store.read_state(wh)[0] == seq
    code, _, err = run_cli("merge", "--warehouse", wh)
    assert code == 0, err
    assert all_views(wh) == clean["views"] and run_cli("validate", "--warehouse", wh)[0] == 0


def test_after_a_kill_9_validate_says_one_line_and_fix_moves_at_once(clean, tmp_path):
    """kill -9 of `cli.py merge` with its merged files written and no record; and a temporary file
    of a run whose lease was released: one summary line, and `--fix` moves them without the grace."""
    wh = build(tmp_path / "wh", pending=1)
    proc = cli("merge", "--warehouse", wh, env={"ISO_FAULT": "merge:1"})
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert list((wh / "_inflight").glob("*.json"))  # the dead writer's leases (one per group it folded): left
    tmp = next((wh / "tables" / "token_sums").rglob("*.parquet")).parent / ".20260101T000000-0badf00d.parquet.tmp"
    tmp.write_bytes(b"half a file")  # a temporary whose run holds no lease
    orphans = unlisted(wh)
    code, out, _ = run_cli("validate", "--warehouse", wh)
    assert code == 1 and len(out.strip().splitlines()) == 1, out
    assert f"{len(orphans)} file(s) not listed in the manifest" in out and "has exited" in out
    code, out, err = run_cli("validate", "--warehouse", wh, "--fix")  # the default grace of an hour
    assert code == 0, out + err
    assert unlisted(wh) == [] and not list((wh / "_inflight").glob("*.json"))
    assert all_views(wh) == clean["pending"]
    assert run_cli("merge", "--warehouse", wh)[0] == 0
    assert all_views(wh) == clean["views"] and run_cli("validate", "--warehouse", wh)[0] == 0


# ---------------------------------------------------------------- a full disk after the record


def full_disk_at(monkeypatch, point: str) -> None:
    """Fault point `point` raises ENOSPC once (as ISO_FAULT=point ISO_FAULT_ACTION=enospc does)."""
    real, left = faults.hit, [1]

    def hit(p):
        if p == point and left[0]:
            left[0] -= 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(p)
    monkeypatch.setattr(faults, "hit", hit)


def warnings_of(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith(("warning:", "error:"))]


@pytest.mark.parametrize("command,point", [("merge", "views"), ("merge", "release"), ("merge", "gc"),
                                           ("compact", "views")])
def test_a_full_disk_after_the_record_is_reported_as_committed(clean, tmp_path, monkeypatch, command, point):
    wh = build(tmp_path / "wh", pending=1)
    gen = store.read_state(wh)[0]
    full_disk_at(monkeypatch, point)
    code, out, err = run_cli(command, "--warehouse", wh)
    assert code == 0, err
    (line,) = warnings_of(err)
    assert line.startswith("warning: committed (generation") and "No space left on device" in line, line
    assert store.read_state(wh)[0] > gen
    monkeypatch.undo()
    if command == "merge":
        assert f"(generation {gen + 1})" in err
        assert all_views(wh) == clean["views"]
    else:  # compacted: the views a compaction keeps
        clean_copy = tmp_path / "clean"
        shutil.copytree(clean["wh"], clean_copy)
        assert run_cli("compact", "--warehouse", clean_copy)[0] == 0
        assert all_views(wh) == all_views(clean_copy)
    code, out, err = run_cli("validate", "--warehouse", wh)
    if point == "gc":  # the files the merge replaced: a record listed them, a later one dropped them
        assert code == 1 and len(out.strip().splitlines()) == 1 and "replaced by a later commit" in out, out
    else:  # views: rewritten by the command itself once the disk had room; release: this process's lease
        assert code == 0, out + err
    code, out, err = run_cli("validate", "--warehouse", wh, "--fix")  # the default grace: proven garbage moves
    assert code == 0, out + err
    assert run_cli("validate", "--warehouse", wh)[0] == 0 and unlisted(wh) == []


def test_the_fault_point_from_the_environment(clean, tmp_path):
    """The same through ISO_FAULT_ACTION=enospc in a process of its own."""
    wh = build(tmp_path / "wh", pending=1)
    proc = cli("merge", "--warehouse", wh, env={"ISO_FAULT": "views", "ISO_FAULT_ACTION": "enospc"})
    assert proc.returncode == 0, proc.stderr
    (line,) = warnings_of(proc.stderr)
    assert line.startswith("warning: committed (generation 4)") and "[Errno 28]" in line
    assert all_views(wh) == clean["views"]


def test_validate_writes_nothing_without_fix_and_works_on_a_full_disk(clean, tmp_path, monkeypatch):
    """After a failure between a record and its derived files, `validate` reports (a note: they are
    caches) and writes nothing — on a full disk too; `--fix` rewrites them."""
    from warehouse.storage import local

    wh = build(tmp_path / "wh", pending=1)
    full_disk_at(monkeypatch, "views")
    with pytest.warns(store.AfterRecord, match=r"committed \(generation 4\)"):
        merge.fold_pending(wh)  # the record lands; manifest.json, runs.parquet, views.sql stay behind
    monkeypatch.undo()
    before = tree(wh)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    for name in ("replace", "create_if_absent", "output", "move", "delete"):
        real = getattr(local.LocalStorage, name)
        monkeypatch.setattr(local.LocalStorage, name, lambda self, *a, real=real, **k: (
            full() if str(self.root).startswith(str(wh)) else real(self, *a, **k)))
    code, out, err = run_cli("validate", "--warehouse", wh)
    assert code == 0, out + err
    assert "behind the commit log" in err
    assert tree(wh) == before
    monkeypatch.undo()
    code, out, err = run_cli("validate", "--warehouse", wh, "--fix")
    assert code == 0 and "rewrote" in err, out + err
    assert tree(wh) != before and store.companion_generations(wh) == (4, 4)
    assert all_views(wh) == clean["views"]


# ---------------------------------------------------------------- derived files ahead of the log


def test_a_copy_taken_during_a_merge_is_repaired_by_fix(clean, tmp_path):
    """`_log/` copied before a merge's record, the derived files and tables/ after it: one line
    pointing to --fix (no "restore a backup": every record and partial is there); --fix rebuilds the
    derived files from the log and says so; a merge then gives every view of a clean run."""
    wh = build(tmp_path / "wh", pending=1)
    log_before = tmp_path / "log-before"
    shutil.copytree(wh / "_log", log_before)
    assert run_cli("merge", "--warehouse", wh)[0] == 0
    copy = tmp_path / "copy"
    shutil.copytree(wh, copy)
    shutil.rmtree(copy / "_log")
    shutil.copytree(log_before, copy / "_log")
    before = tree(copy)
    for args in (["sql", "SELECT count(*) FROM runs"], ["validate"], ["merge"]):
        code, _, err = run_cli(*args, "--warehouse", copy)
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and "validate --fix" in lines[0], err
        assert "ahead of the log" in lines[0] and "restore" not in lines[0], err
    assert tree(copy) == before
    code, out, err = run_cli("validate", "--warehouse", copy, "--fix")
    assert "rebuilt manifest.json, runs.parquet and views.sql from the commit log (generation 3)" in err, err
    problems = out.strip().splitlines()  # the merge's files: unlisted now, kept while younger than the grace
    assert code == 1 and problems and all("younger than the grace period" in p for p in problems), out + err
    code, _, err = run_cli("merge", "--warehouse", copy)
    assert code == 0, err
    assert all_views(copy) == clean["views"]
    assert run_cli("validate", "--warehouse", copy, "--fix", "--grace", "0")[0] == 0
    assert run_cli("validate", "--warehouse", copy)[0] == 0


def test_a_lost_record_whose_files_are_gone_still_says_restore(clean, tmp_path):
    """Companions ahead of a log whose latest state misses a partial: a lost record, never rebuilt."""
    wh = build(tmp_path / "wh")
    latest = sorted((wh / "_log").glob("*.json"))[-1]
    latest.unlink()
    victim = next(e for e in store.read_state(wh, ahead_ok=True)[1]["entries"].values() if e["kind"] == "data")
    (wh / victim["files"]["layer_sums"]).unlink()
    before = tree(wh)
    for args in (["validate"], ["validate", "--fix", "--grace", "0"]):
        code, _, err = run_cli(*args, "--warehouse", wh)
        assert code == 2 and "lost" in err and "restore it from a backup" in err, err
    assert tree(wh) == before


# ---------------------------------------------------------------- paths are data


ODD = "wh run*?[ab]{x,y}'q\"ü"  # every glob character DuckDB knows, braces, quotes, a space, unicode
DECOY = "wh run-backup-Xa{x,y}'q\"ü"  # what ODD matches as a pattern


def test_glob_characters_in_the_warehouse_path_read_exactly_its_files(clean, tmp_path):
    wh = build(tmp_path / ODD / "wh")
    shutil.copytree(wh.parent, tmp_path / DECOY)  # the same files: a pattern would read both
    assert all_views(wh) == clean["views"]
    code, out, err = run_cli("sql", "SELECT count(*) AS rows, sum(n) AS n FROM layer_totals", "--warehouse", wh,
                             "--format", "csv")
    assert code == 0, err
    want = connect(clean["wh"]).execute("SELECT count(*), sum(n) FROM layer_totals").fetchone()
    assert out.splitlines()[1] == f"{want[0]},{want[1]}"
    shell = shutil.which("duckdb") or str(Path(sys.executable).parent / "duckdb")
    r = subprocess.run([shell, "-init", str(wh / "views.sql"), "-csv", "-noheader", "-c",
                        "SELECT count(*), sum(n) FROM layer_totals; SELECT count(*) FROM runs"],
                       capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 0 and "Error" not in r.stderr, r.stderr
    runs = connect(clean["wh"]).execute("SELECT count(*) FROM runs").fetchone()[0]
    assert r.stdout.split() == [f"{want[0]},{want[1]}", str(runs)]
    opened = next(line for line in (wh / "views.sql").read_text().splitlines() if "Open with" in line)
    assert subprocess.run(["sh", "-c", opened.split("Open with:", 1)[1].replace("duckdb -init", "test -f")]
                          ).returncode == 0  # the line a user copies names the file, quoted for the shell
    assert validate(wh) == []
    with pytest.raises(UserError) as e:  # DuckDB's errors are the project's one line
        sql("SELECT no_such_column FROM layer_totals", wh)
    assert "\n" not in str(e.value) and "no_such_column" in str(e.value)
    moved = tmp_path / "plain" / "wh"  # views.sql written for the odd path: validate knows a move
    shutil.copytree(wh, moved)
    assert validate(moved) == []
    data = (moved / "views.sql").read_bytes()
    (moved / "views.sql").write_bytes(data.replace(b"init '", b"init  '", 1))  # a changed byte: not a move
    assert any("views.sql: differs" in p for p in validate(moved))


# ---------------------------------------------------------------- the read-only wrapper


def test_the_read_only_wrapper_refuses_every_attribute_off_its_allow_list(clean, tmp_path):
    wh = tmp_path / "wh"
    shutil.copytree(clean["wh"], wh)
    listed = next((wh / "tables" / "token_stats").rglob("*.parquet"))
    copy = f"COPY (SELECT 42 AS x) TO '{listed}' (FORMAT parquet, USE_TMP_FILE false)"
    before = tree(wh)
    con = connect(wh)
    rel = con.sql("SELECT 42 AS x")
    attempts = {
        "con._submit": lambda: con._submit(copy),
        "rel._write": lambda: rel._write("COPY (", f") TO '{listed}' (FORMAT parquet, USE_TMP_FILE false)"),
        "rel._con": lambda: rel._con.execute(copy),
        "rel._submit": lambda: rel._submit(copy),
        "con._prepare_script": lambda: con._prepare_script(copy),
        "con._register_source": lambda: con._register_source("t", None),
        "con.install_extension": lambda: con.install_extension("httpfs"),
        "con.load_extension": lambda: con.load_extension("httpfs"),
        "con.append": lambda: con.append("token_stats", None),
        "con.appender": lambda: con.appender("token_stats"),
        "con.query_appender": lambda: con.query_appender("t", None),
        "con.checkpoint": lambda: con.checkpoint(),
        "con.enable_profiling": lambda: con.enable_profiling(),
        "con.register_filesystem": lambda: con.register_filesystem(None),
        "con.table_function": lambda: con.table_function("read_text", [str(wh / "manifest.json")]),
        "rel.create_view": lambda: rel.create_view("v"),
        "rel.to_view": lambda: rel.to_view("v"),
        "rel.to_parquet": lambda: rel.to_parquet(str(listed)),
        "rel.write_parquet": lambda: rel.write_parquet(str(listed)),
        "rel.insert_into": lambda: rel.insert_into("token_stats"),
        "rel.update": lambda: rel.update({"x": 1}),
        "setattr": lambda: setattr(con, "_raw", None),
        "con.cursor()._submit": lambda: con.cursor()._submit(copy),
        "relation of a relation": lambda: rel.filter("x > 0")._write("COPY (", f") TO '{listed}'"),
    }
    for name, attempt in attempts.items():
        with pytest.raises((UserError, duckdb.Error)):
            attempt()
        assert tree(wh) == before, name
    assert con.execute("SELECT count(*) FROM inter_sim").fetchall()[0][0] > 0  # reading still works
    assert rel.filter("x > 0").pl()["x"][0] == 42 and con.table("layer_totals").df().shape[0] > 0
    assert isinstance(con._raw, duckdb.DuckDBPyConnection)  # the documented raw connection
    con.close()
    # the two private ways were real: on the raw objects they overwrite a listed file
    raw = connect(wh)._raw
    raw._submit(copy)
    assert tree(wh) != before


def test_every_allowed_attribute_exists():
    from warehouse.query import ReadOnlyConnection, ReadOnlyRelation

    con = duckdb.connect()
    rel = con.sql("SELECT 1")
    assert {n for n in ReadOnlyConnection.ALLOWED if not hasattr(con, n)} == set()
    assert {n for n in ReadOnlyRelation.ALLOWED if not hasattr(rel, n)} <= {"fetchone", "fetchmany"}
