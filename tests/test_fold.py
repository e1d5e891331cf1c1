"""Commits whose cost is the partial's (warehouse/commits.py): partials appended without a fold are
pending; one fold takes every pending partial of a group in a single pass; the views are exact for
what each merged entry holds at every moment; racing writers and kill -9 never double count or lose
a partial."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

from conftest import call_all, run_cli
from fold_checks import quiet_snapshot
from test_merge import check_against, oracle, random_partial, rounded_views
from test_reliability import run_subprocess
from warehouse import merge, store
from warehouse.merge import commits, fold_tokens
from warehouse.query import PendingPartials, connect
from warehouse.validate import validate


def _layout(root: Path, seed: int, sources: int = 2, shards: int = 3) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [random_partial(root, rng, f"s{s}", f"{k + 1}-of-{shards}") for s in range(sources) for k in range(shards)]


def _runs(root: Path) -> list[tuple]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PendingPartials)
        con = connect(root)
    rows = con.execute("SELECT source, shard, folded FROM runs WHERE kind = 'data' ORDER BY source, shard").fetchall()
    con.close()
    return rows


def test_appended_partials_are_pending_then_one_fold_equals_folding_each(tmp_path):
    """Six partials appended (fold=False) then folded by fold_pending give the tables of six folding
    commits (views to 1e-12, n exact), and of the pairwise definition.  Before the fold: every
    partial pending, `runs.folded` false, connect warns, and no group state was read or written."""
    a, b = tmp_path / "appended", tmp_path / "folded"
    ea = _layout(a, 3)
    eb = _layout(b, 3)
    for e in eb:
        merge.commit(b, [e])
    calls = []
    real = commits.fold_groups
    commits.fold_groups = lambda *x, **k: calls.append(1) or real(*x, **k)
    try:
        for e in ea:
            merge.commit(a, [e], fold=False)
    finally:
        commits.fold_groups = real
    assert calls == []  # an appending commit reads no group state
    manifest = store.read_manifest(a)
    assert not any(e["kind"] == "merged" for e in manifest["entries"].values())
    assert len(merge.pending(manifest)) == 3 and merge.pending_pairs(manifest) == [("m", "c")]
    assert [r[2] for r in _runs(a)] == [False] * 6
    with pytest.warns(PendingPartials, match="6 committed partial"):
        connect(a).close()
    assert validate(a) == []  # pending is not a problem
    assert merge.fold_pending(a) == 6
    assert [r[2] for r in _runs(a)] == [True] * 6
    assert store.read_manifest(a)["generation"] == 7  # six appends, one fold
    with warnings.catch_warnings():
        warnings.simplefilter("error", PendingPartials)
        assert rounded_views(a) == rounded_views(b)
    check_against(a, oracle(a, ea))
    assert validate(a) == []
    assert merge.fold_pending(a) == 0


def test_a_fold_reads_each_pending_partial_once_per_group_and_the_state_once(tmp_path, monkeypatch):
    """Folding k pending partials into a group that already holds some opens the group's state once
    and each partial once for its source group and once for 'all' — not once per partial."""
    root = tmp_path / "wh"
    first = _layout(root, 5, sources=2, shards=4)
    for e in first[:2] + first[4:6]:  # two shards of each source folded
        merge.commit(root, [e])
    for e in first[2:4] + first[6:]:
        merge.commit(root, [e], fold=False)
    manifest = store.read_manifest(root)
    states = {rel for e in manifest["entries"].values() if e["kind"] == "merged"
              for t, rel in e["files"].items() if t in ("token_stats", "token_vectors")}
    opened = []
    real = fold_tokens._Sorted.__init__

    def spy(self, st, rel, columns, batch_rows):
        opened.append(rel)
        real(self, st, rel, columns, batch_rows)

    monkeypatch.setattr(fold_tokens._Sorted, "__init__", spy)
    assert merge.fold_pending(root) == 4
    pending_files = [e["files"]["token_sums"] for e in first[2:4] + first[6:]]
    assert sorted(opened.count(f) for f in pending_files) == [2, 2, 2, 2]  # its source group and 'all'
    assert all(opened.count(f) == 1 for f in states)
    assert not {e["files"]["token_sums"] for e in first[:2] + first[4:6]} & set(opened)  # held: not re-read
    check_against(root, oracle(root, first))


def test_folding_commit_takes_the_pending_partials_in_the_same_pass(tmp_path):
    """A folding commit after appended ones folds every pending partial of the checkpoint too."""
    root = tmp_path / "wh"
    entries = _layout(root, 7)
    for e in entries[:-1]:
        merge.commit(root, [e], fold=False)
    merge.commit(root, [entries[-1]])
    assert merge.pending(store.read_manifest(root)) == {}
    check_against(root, oracle(root, entries))


def test_rerun_of_a_pending_partial_needs_no_unfold_of_a_folded_one_does(tmp_path):
    """Re-running a shard that is pending just replaces it; re-running one a group holds un-folds it
    in the same record, even with fold=False (its files leave the manifest)."""
    root = tmp_path / "wh"
    rng = np.random.default_rng(21)
    a = random_partial(root, rng, "s0", "1-of-2")
    merge.commit(root, [a], fold=False)
    a2 = random_partial(root, rng, "s0", "1-of-2")  # pending a replaced by a2: nothing to un-fold
    merge.commit(root, [a2], fold=False)
    assert not any(e["kind"] == "merged" for e in store.read_manifest(root)["entries"].values())
    b = random_partial(root, rng, "s0", "2-of-2")
    merge.commit(root, [b])  # folds a2 and b
    b2 = random_partial(root, rng, "s0", "2-of-2")
    merge.commit(root, [b2], fold=False)  # b is held: un-folded now, b2 folded in the same record
    manifest = store.read_manifest(root)
    assert merge.pending(manifest) == {}
    check_against(root, oracle(root, [a2, b2]))
    covering = random_partial(root, rng, "s0", "1-of-1")  # covers both shards, appended
    merge.commit(root, [covering], fold=False)
    check_against(root, oracle(root, [covering]))
    assert validate(root) == []


def test_a_fold_that_lost_the_race_to_another_fold_is_not_redone(tmp_path, monkeypatch):
    """Two folds of the same pending partials: the one that publishes second finds them folded and
    discards its files without folding again; a fold that lost to an appending commit is published
    on top as it is (the new partial stays pending)."""
    root = tmp_path / "wh"
    entries = _layout(root, 9, sources=1, shards=3)
    for e in entries[:2]:
        merge.commit(root, [e], fold=False)
    real_publish, raced, folds = store.publish, [], []
    real_fold = commits.fold_groups

    def publish(root_, seq, manifest, new, remove=()):
        if not raced:
            raced.append(True)
            monkeypatch.setattr(store, "publish", real_publish)
            assert merge.fold_pending(root_) == 2  # the other fold wins the record
            monkeypatch.setattr(store, "publish", publish)
        return real_publish(root_, seq, manifest, new, remove)

    monkeypatch.setattr(commits, "fold_groups", lambda *x: folds.append(1) or real_fold(*x))
    monkeypatch.setattr(store, "publish", publish)
    assert merge.fold_pending(root) == 2
    assert len(folds) == 2  # ours and the other's: ours was not redone
    assert store.read_manifest(root)["generation"] == 3
    check_against(root, oracle(root, entries[:2]))
    leftovers = {p.name for p in (root / "tables").rglob("*.parquet")} - {
        Path(f).name for e in [*store.read_manifest(root)["entries"].values(), entries[2]]
        for f in e["files"].values()}
    assert leftovers == set()  # the discarded fold's files are gone

    monkeypatch.setattr(store, "publish", real_publish)
    raced.clear()
    folds.clear()
    merge.commit(root, [entries[2]], fold=False)
    e4 = random_partial(root, np.random.default_rng(1), "s0", "1-of-1", checkpoint="c2")

    def publish2(root_, seq, manifest, new, remove=()):
        if not raced:
            raced.append(True)
            monkeypatch.setattr(store, "publish", real_publish)
            merge.commit(root_, [e4], fold=False)  # an appending commit wins the record
            monkeypatch.setattr(store, "publish", publish2)
        return real_publish(root_, seq, manifest, new, remove)

    monkeypatch.setattr(store, "publish", publish2)
    assert merge.fold_pending(root, checkpoint="c") == 1
    assert len(folds) == 1  # published on top without a second fold
    manifest = store.read_manifest(root)
    assert merge.pending_pairs(manifest) == [("m", "c2")]
    check_against(root, oracle(root, entries))


def _append_one(args):
    root, source, shard, seed = args
    entry = random_partial(Path(root), np.random.default_rng(seed), source, shard)
    merge.commit(Path(root), [entry], fold=False)
    return entry


def _fold_all(root):
    return merge.fold_pending(Path(root))


def test_racing_appends_and_folds_never_double_count(tmp_path):
    """Six processes append six partials while two others fold, all at once; a last fold; every
    partial is counted exactly once."""
    root = tmp_path / "wh"
    merge.commit(root, [random_partial(root, np.random.default_rng(99), "s0", "1-of-3")])
    first = store.read_manifest(root)["entries"]
    jobs = [(str(root), f"s{i % 2 + 1}", f"{i // 2 + 1}-of-3", 200 + i) for i in range(6)]
    # four processes at a time: the two folds first, then the appends
    entries = call_all([(_fold_all, [str(root)])] * 2 + [(_append_one, [job]) for job in jobs], processes=4)[2:]
    merge.fold_pending(root)
    manifest = store.read_manifest(root)
    assert merge.pending(manifest) == {}
    data = [e for e in first.values() if e["kind"] == "data"] + entries
    check_against(root, oracle(root, data))
    assert validate(root) == []


@pytest.mark.parametrize("point", ["merge", "manifest", "views"])
def test_kill_9_during_a_fold_leaves_nothing_half_visible(tmp_path, point):
    """`cli.py merge` killed before its record (merge: files written; manifest: record being made) or
    after it (views: the record landed, the companions not yet): the views answer as before or as after, and a rerun is exact."""
    root = tmp_path / "wh"
    entries = _layout(root, 13, sources=2, shards=2)
    merge.commit(root, entries[:1])
    for e in entries[1:]:
        merge.commit(root, [e], fold=False)
    before = quiet_snapshot(root)
    proc = run_subprocess(["merge", "--warehouse", str(root)], fault=f"{point}:1")
    assert proc.returncode == -9, proc.stderr[-2000:]
    now = quiet_snapshot(root)
    landed = merge.pending(store.read_manifest(root)) == {}
    assert landed == (point == "views")
    if not landed:
        assert now == before
    assert run_cli("validate", "--warehouse", root, "--fix", "--grace", "0")[0] == 0
    code, _, err = run_cli("merge", "--warehouse", root)
    assert code == 0, err
    check_against(root, oracle(root, entries))
    assert run_cli("validate", "--warehouse", root)[0] == 0


def test_compact_folds_pending_partials_first(tmp_path):
    root = tmp_path / "wh"
    entries = _layout(root, 15, sources=2, shards=2)
    for e in entries:
        merge.commit(root, [e], fold=False)
    want = oracle(root, entries)
    merge.compact(root)
    assert merge.pending(store.read_manifest(root)) == {}
    check_against(root, want)


def test_a_fold_hashes_each_partial_at_most_once(tmp_path, monkeypatch):
    """The fold verifies its inputs against their records; a file this process wrote (a sweep) is not
    read again to hash it, and one written elsewhere is hashed once, not once per group."""
    from warehouse.storage import checksums
    from warehouse.store import verified

    root = tmp_path / "wh"
    entries = _layout(root, 17, sources=2, shards=2)
    for e in entries:
        merge.commit(root, [e], fold=False)
    hashed = []
    real = checksums.checksum
    monkeypatch.setattr(checksums, "checksum", lambda st, rel: hashed.append(rel) or real(st, rel))
    merge.fold_pending(root)
    assert hashed == []  # written by this process, unchanged since
    other = tmp_path / "other"
    entries = _layout(other, 17, sources=2, shards=2)
    for e in entries:
        merge.commit(other, [e], fold=False)
    monkeypatch.setattr(verified, "_WRITTEN", {})  # as if another process had written them
    monkeypatch.setattr(verified, "_WRITTEN_KEY", {})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # and no query verified them
    merge.fold_pending(other)
    files = [f for e in entries for f in e["files"].values()]
    assert sorted(hashed) == sorted(files)  # each once, though each is read for two groups


def test_a_commit_appends_its_own_files_to_its_warehouses_cache_only(tmp_path, monkeypatch):
    """The verified-files cache is one file per warehouse, appended to: a commit writes a line per file
    it wrote (O(its files)), never the other warehouses' lines or its own history."""
    from warehouse.storage import open_storage

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    a, b = tmp_path / "a", tmp_path / "b"
    merge.commit(b, [_layout(b, 1, sources=1, shards=1)[0]])
    cb = store.verified_cache_file(open_storage(b))
    before_b = cb.read_bytes()
    entries = _layout(a, 2, sources=1, shards=3)
    ca = store.verified_cache_file(open_storage(a))
    sizes = []
    for e in entries:
        merge.commit(a, [e], fold=False)
        sizes.append(len(ca.read_bytes().splitlines()))
    assert sizes == [2, 4, 6]  # token_sums and layer_sums of each partial, appended
    assert cb.read_bytes() == before_b
    assert store.read_verified_cache(open_storage(a))[0] == {
        str((a / f).resolve()): store.file_key(str((a / f).resolve()), store.written_checksum(open_storage(a), f))
        for e in entries for f in e["files"].values()}
