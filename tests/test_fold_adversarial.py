"""Adversarial tests of appended partials and one fold per group: random sequences of
appends, folds, re-runs, covering shards and --replace across two sources against a clean one-shot
fold; races decided in-process (a writer's publish interleaved with another's commit); kill -9 in
`cli.py merge` and `extract --no-fold`; validate --fix beside pending partials (the verified-files
cache and real extracts with every merged table: test_fold_cache.py).

Tests marked `# Was a bug (fixed):` failed on the code they were written against; each says
what went wrong."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from conftest import call_all, run_cli
from fold_checks import (data, drop_files, forget_this_process, invariants, one_shot_fold, quiet_snapshot,
                         unlisted, views_close)
from common.errors import UserError
from test_merge import check_against, oracle, random_partial
from test_reliability import run_subprocess
from warehouse import merge, store
from warehouse.validate import validate


# ---------------------------------------------------------------- (1) random sequences of operations

_OPS = hs.lists(hs.one_of(
    hs.tuples(hs.just("add"), hs.sampled_from(["s0", "s1"]), hs.sampled_from(["1-of-2", "2-of-2"]),
              hs.booleans(), hs.booleans()),          # a shard of 2 (a re-run if present), fold?, --replace?
    hs.tuples(hs.just("cover"), hs.sampled_from(["s0", "s1"]), hs.booleans()),  # --shard 1/1, fold?
    hs.tuples(hs.just("thirds"), hs.sampled_from(["s0", "s1"]), hs.booleans()),  # 1/3 --replace (re-shard)
    hs.tuples(hs.just("both"), hs.sampled_from(["1-of-2", "2-of-2"]), hs.booleans()),  # s0 and s1 in one commit
    hs.tuples(hs.just("fold"),),
), min_size=2, max_size=7)


@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(ops=_OPS)
def test_random_sequences_equal_a_clean_one_shot_fold(ops):
    """Any sequence of appending / folding commits, re-runs, covering shards, re-shards with --replace
    and folds keeps every merged entry exact for what it holds, and once folded every view equals a
    clean one-shot fold of the partials listed at the end (then compact keeps them)."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "wh"
        rng = np.random.default_rng(len(ops) * 7919 + sum(len(str(o)) for o in ops))
        for op in ops:
            if op[0] == "fold":
                merge.fold_pending(root)
            elif op[0] == "both":
                es = [random_partial(root, rng, source, op[1]) for source in ("s0", "s1")]
                try:
                    merge.commit(root, es, fold=op[2])
                except UserError as err:
                    assert "shares documents" in str(err), err
                    for e in es:
                        drop_files(root, e)
            else:
                if op[0] == "add":
                    _, source, shard, fold, replace = op
                elif op[0] == "cover":
                    (_, source, fold), shard, replace = op, "1-of-1", False
                else:
                    (_, source, fold), shard, replace = op, "1-of-3", True
                e = random_partial(root, rng, source, shard)
                try:
                    merge.commit(root, [e], fold=fold, replace=replace)
                except UserError as err:  # a shard of 2 beside 1/1 or 1/3 without --replace
                    assert "shares documents" in str(err), err
                    drop_files(root, e)
            if (root / store.LOG_DIR).exists():
                invariants(root)
        if not data(root):
            return
        merge.fold_pending(root)
        assert merge.pending(store.read_manifest(root)) == {}
        invariants(root)
        check_against(root, oracle(root, data(root)))
        clean = one_shot_fold(root, Path(tmp) / "clean")
        views_close(root, clean)
        merge.compact(root)
        views_close(root, clean)
        assert validate(root) == []


def test_covering_shard_after_folded_and_pending_halves_then_replace_back(tmp_path):
    """--shard 1/1 appended over 1/2 (folded) and 2/2 (pending), then a re-shard 1/2 + 2/2 with
    --replace appended, across two sources (the other source folded and pending too)."""
    root = tmp_path / "wh"
    rng = np.random.default_rng(3)
    a1, a2 = random_partial(root, rng, "s0", "1-of-2"), random_partial(root, rng, "s0", "2-of-2")
    b1, b2 = random_partial(root, rng, "s1", "1-of-2"), random_partial(root, rng, "s1", "2-of-2")
    merge.commit(root, [a1])
    merge.commit(root, [b1])
    merge.commit(root, [a2], fold=False)
    merge.commit(root, [b2], fold=False)
    invariants(root)
    cover = random_partial(root, rng, "s0", "1-of-1")
    merge.commit(root, [cover], fold=False)  # a1 held: un-folded; a2 pending: dropped
    invariants(root)
    assert {e["key"] for e in data(root)} == {cover["key"], b1["key"], b2["key"]}
    again = random_partial(root, rng, "s0", "1-of-2")
    merge.commit(root, [again], fold=False, replace=True)  # conflicts with 1/1, which s0 holds since: un-folded
    invariants(root)
    merge.fold_pending(root)
    invariants(root)
    check_against(root, oracle(root, data(root)))
    views_close(root, one_shot_fold(root, tmp_path / "clean"))


def test_one_commit_of_two_overlapping_shards_of_a_source_is_refused(tmp_path):
    # Was a bug (fixed; library API only: one extract commits one shard per source): coverage.replacements
    # compared each new entry only with the committed ones, never with the other new entries of the same
    # commit, so merge.commit(root, [s0 1/1, s0 1/2]) was accepted and the documents of shard 1/2 counted
    # twice in s0 and 'all'.  Expected: the one-line conflict error.
    root = tmp_path / "wh"
    rng = np.random.default_rng(19)
    whole, half = random_partial(root, rng, "s0", "1-of-1"), random_partial(root, rng, "s0", "1-of-2")
    with pytest.raises(UserError, match="shares documents"):
        merge.commit(root, [whole, half], fold=False)


# ---------------------------------------------------------------- (2) races decided in-process


def _race(monkeypatch, other):
    """Patch store.publish so that the first publish runs `other()` first (which wins the record)."""
    real, raced = store.publish, []

    def publish(root_, seq, manifest, new, remove=()):
        if not raced:
            raced.append(True)
            monkeypatch.setattr(store, "publish", real)
            other()
            monkeypatch.setattr(store, "publish", publish)
        return real(root_, seq, manifest, new, remove)

    monkeypatch.setattr(store, "publish", publish)
    return raced


def test_a_folding_commit_that_lost_to_compact_leaves_no_files_behind(tmp_path, monkeypatch):
    # Was a bug (fixed): commit() folds the new shard into the checkpoint's groups, loses the record to a `compact` of
    # that checkpoint, and on the retry check_open() raises "was compacted" from inside the retry loop
    # (warehouse/commits.py, the `check_open(manifest, model, checkpoint)` at the top of commit's loop)
    # without discard(root, merged): the merged files it folded stay under tables/, listed by no entry,
    # and their lease is never released (validate only notes them as "in flight" while this process
    # lives).  Expected: the UserError, and no unlisted file except the new partial's own.
    root = tmp_path / "wh"
    rng = np.random.default_rng(5)
    a, b = random_partial(root, rng, "s0", "1-of-2"), random_partial(root, rng, "s0", "2-of-2")
    merge.commit(root, [a])
    raced = _race(monkeypatch, lambda: merge.compact(root))
    with pytest.raises(UserError, match="compacted"):
        merge.commit(root, [b])
    assert raced
    assert unlisted(root, keep=[b]) == set()


def test_an_appending_rerun_that_lost_to_a_fold_of_its_partial_unfolds_it(tmp_path, monkeypatch):
    """A re-run appended while its old partial is pending; before its record lands, a fold folds the
    old partial: the retry must un-fold it (held now), not just drop it."""
    root = tmp_path / "wh"
    rng = np.random.default_rng(6)
    a, b = random_partial(root, rng, "s0", "1-of-2"), random_partial(root, rng, "s1", "1-of-1")
    merge.commit(root, [b])
    merge.commit(root, [a], fold=False)
    a2 = random_partial(root, rng, "s0", "1-of-2")
    raced = _race(monkeypatch, lambda: merge.fold_pending(root))
    merge.commit(root, [a2], fold=False)
    assert raced
    invariants(root)
    assert {e["key"]: e["run_id"] for e in data(root)}[a["key"]] == a2["run_id"]
    merge.fold_pending(root)
    check_against(root, oracle(root, [a2, b]))


def test_a_fold_that_lost_to_a_rerun_of_its_pending_partial_folds_the_rerun(tmp_path, monkeypatch):
    """fold_pending folded pending {a, c}; an appending re-run of `a` lands first: the fold must not
    publish a merged entry holding the old `a`, and the views end up exact for what is held."""
    root = tmp_path / "wh"
    rng = np.random.default_rng(7)
    a, c = random_partial(root, rng, "s0", "1-of-2"), random_partial(root, rng, "s0", "2-of-2")
    merge.commit(root, [a], fold=False)
    merge.commit(root, [c], fold=False)
    a2 = random_partial(root, rng, "s0", "1-of-2")
    raced = _race(monkeypatch, lambda: merge.commit(root, [a2], fold=False))
    merge.fold_pending(root)
    assert raced
    invariants(root)
    merge.fold_pending(root)
    check_against(root, oracle(root, [a2, c]))


def test_a_merge_whose_only_pending_partial_was_rerun_meanwhile_folds_the_rerun(tmp_path, monkeypatch):
    # Was a bug (fixed): fold_pending remembered the partials pending when it started by run_id:key; when
    # an appending re-run replaced the only one before the fold's record landed, the retry found none of
    # them pending and returned 1 ("folded 1 pending partial(s)" from `cli.py merge`) having folded
    # nothing: the re-run of that very shard was still pending after the merge returned.  Expected: the
    # re-run (same key) folded, as the merge was asked to fold that shard's data.
    root = tmp_path / "wh"
    rng = np.random.default_rng(16)
    a = random_partial(root, rng, "s0", "1-of-1")
    merge.commit(root, [a], fold=False)
    a2 = random_partial(root, rng, "s0", "1-of-1")
    raced = _race(monkeypatch, lambda: merge.commit(root, [a2], fold=False))
    n = merge.fold_pending(root)
    assert raced
    invariants(root)
    assert merge.pending_pairs(store.read_manifest(root)) == [], f"fold_pending returned {n}, folded nothing"
    check_against(root, oracle(root, [a2]))


@pytest.mark.parametrize("fold", [True, False])
def test_committing_the_same_partial_again_keeps_it_counted_once(tmp_path, fold):
    # Was a bug (fixed): merge.commit(root, [e]) with an entry that is already committed and held (the same run_id and
    # key: a caller retrying a commit whose record landed before an exception) is taken as a re-run of
    # itself: commits.fold_groups computes `removes` = [e] (held, "replaced") but `adds` = [] (its
    # partial_id is already in the old entry's inputs), so fold_group un-folds e and never adds it back
    # while the new merged entry's `inputs` still list e (fold_groups, the `adds = …` / `removes = …`
    # lines).  Expected: every view as before (e counted once) — or a refusal; got: the group's
    # token_stats without e's rows/counts, silently, with inputs claiming e (validate finds it later).
    root = tmp_path / "wh"
    rng = np.random.default_rng(17)
    a, b = random_partial(root, rng, "s0", "1-of-2"), random_partial(root, rng, "s0", "2-of-2")
    merge.commit(root, [a])
    merge.commit(root, [b])
    merge.commit(root, [dict(a)], fold=fold)
    assert validate(root) == []
    check_against(root, oracle(root, [a, b]))


@pytest.mark.parametrize("other", ["folding commit", "merge", "compact"])
def test_a_fold_whose_old_state_another_writer_replaced_meanwhile_retries(tmp_path, monkeypatch, other):
    # Was a bug (fixed): fold_pending (warehouse/commits.py, `merged = fold_groups(root, manifest, [], [], pairs)` in its
    # loop) does not catch a file that vanished under it: while it streams a group's old merged state,
    # another writer's fold (a folding commit, another `cli.py merge`, `compact`, which folds first and
    # then drops token_vectors/token_sums) publishes and deletes those files (store.publish's gc), and the
    # fold dies with FileNotFoundError (the file opened by fold_tokens._Sorted; here) or
    # storage.MissingFile "…listed in the commit log but missing; `python cli.py validate --fix`
    # rebuilds it" (when its checksum is verified first: seen across processes) — a traceback /
    # a wrong repair hint from `cli.py merge`, `compact`, and a sweep's finish_checkpoints, which the
    # docs call "safe beside running extracts and other merges".  commit() has this retry (`except
    # FileNotFoundError` re-reads the state when it changed); fold_pending has none.  Expected: the fold
    # re-reads the state, finds its partials folded, and returns.  Seen in the racing-processes test too.
    from warehouse.merge import fold_tokens
    from warehouse.storage import checksums

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = tmp_path / "wh"
    rng = np.random.default_rng(20)
    a, b, c = (random_partial(root, rng, "s0", f"{i}-of-3") for i in (1, 2, 3))
    d = random_partial(root, rng, "s1", "1-of-1")
    merge.commit(root, [a])
    merge.commit(root, [b])
    merge.commit(root, [c], fold=False)
    want = oracle(root, [a, b, c] + ([d] if other == "folding commit" else []))
    forget_this_process(monkeypatch)  # (as if another process had written them)
    done = []

    def run_other():
        if not done:
            done.append(True)
            if other == "folding commit":
                merge.commit(root, [d])
            elif other == "merge":
                merge.fold_pending(root)
            else:
                merge.compact(root)

    real_open, real_verify = fold_tokens._Sorted.__init__, checksums.verify

    def spy_open(self, *args, **kw):
        run_other()
        real_open(self, *args, **kw)

    def spy_verify(*args, **kw):
        run_other()
        return real_verify(*args, **kw)

    monkeypatch.setattr(fold_tokens._Sorted, "__init__", spy_open)
    monkeypatch.setattr(checksums, "verify", spy_verify)
    merge.fold_pending(root)
    assert done
    manifest = store.read_manifest(root)
    assert merge.pending(manifest) == {}
    check_against(root, want)


def test_a_folding_commit_that_lost_to_an_appending_cover_refolds(tmp_path, monkeypatch):
    """commit(fold=True) of s1 folds the pending s0 shard 1/2 too; meanwhile an appending --shard 1/1
    of s0 drops that shard: the fold must be redone without it."""
    root = tmp_path / "wh"
    rng = np.random.default_rng(8)
    a, b = random_partial(root, rng, "s0", "1-of-2"), random_partial(root, rng, "s1", "1-of-1")
    merge.commit(root, [a], fold=False)
    cover = random_partial(root, rng, "s0", "1-of-1")
    raced = _race(monkeypatch, lambda: merge.commit(root, [cover], fold=False))
    merge.commit(root, [b])
    assert raced
    invariants(root)
    merge.fold_pending(root)
    check_against(root, oracle(root, [cover, b]))


def test_compact_that_lost_to_an_appending_commit_folds_it_then_compacts(tmp_path, monkeypatch):
    """A partial appended between compact's fold and its record: compact folds again (nothing lost,
    nothing pending), then compacts; the views equal the one-shot fold of all three."""
    root = tmp_path / "wh"
    rng = np.random.default_rng(18)
    a, b = random_partial(root, rng, "s0", "1-of-3"), random_partial(root, rng, "s1", "1-of-1")
    merge.commit(root, [a], fold=False)
    merge.commit(root, [b], fold=False)
    c = random_partial(root, rng, "s0", "2-of-3")
    want = oracle(root, [a, b, c])  # (before compact drops the token_sums)
    calls = []
    real = store.publish

    def publish(root_, seq, manifest, new, remove=()):
        if any(e.get("compacted") for e in new) and not calls:  # compact's own record
            calls.append(True)
            merge.commit(root_, [c], fold=False)
        return real(root_, seq, manifest, new, remove)

    monkeypatch.setattr(store, "publish", publish)
    merge.compact(root)
    monkeypatch.setattr(store, "publish", real)
    assert calls
    manifest = store.read_manifest(root)
    assert merge.pending(manifest) == {} and merge.is_compacted(manifest, "m", "c")
    assert {e["key"] for e in data(root)} == {a["key"], b["key"], c["key"]}
    check_against(root, want)
    assert validate(root) == []


def test_merge_and_compact_of_one_checkpoint_ignore_a_stale_group_of_another(tmp_path):
    # Was a bug (fixed): fold_pending (warehouse/commits.py, `stale, _ = stale_groups(manifest)` at the top of its loop)
    # refuses when ANY group of the warehouse is stale, even with model/checkpoint given, so
    # `cli.py merge --checkpoint c` and `cli.py compact --checkpoint c` fail because of checkpoint c2.
    # compact used to check staleness only of the checkpoints it compacts (compaction.py make() still
    # does), but now calls fold_pending first, which raises on c2.  Expected: c folded and compacted,
    # c2 left to `validate --fix`.  Got: UserError naming merged/…c2….
    root = tmp_path / "wh"
    rng = np.random.default_rng(9)
    c = [random_partial(root, rng, "s0", f"{i}-of-2") for i in (1, 2)]
    c2 = [random_partial(root, rng, "s0", f"{i}-of-2", checkpoint="c2") for i in (1, 2)]
    merge.commit(root, c2)
    for e in c:
        merge.commit(root, [e], fold=False)
    seq, manifest = store.read_state(root)  # c2's shard 2 dropped by hand: c2's groups are stale
    assert store.publish(root, seq, manifest, [], [c2[1]["key"]]) is not None
    assert merge.stale_groups(store.read_manifest(root))[0]
    code, _, err = run_cli("merge", "--warehouse", root, "--checkpoint", "c")
    assert code == 0, err
    assert merge.pending_pairs(store.read_manifest(root)) == []
    want = oracle(root, c)  # (before compact drops the partials' vectors)
    code, _, err = run_cli("compact", "--warehouse", root, "--checkpoint", "c")
    assert code == 0, err
    assert merge.is_compacted(store.read_manifest(root), "m", "c")
    assert run_cli("validate", "--warehouse", root, "--fix")[0] == 0  # c2: re-merged from its one shard left
    check_against(root, want)


# ---------------------------------------------------------------- (2b) racing processes


def _worker(args):
    op, root, seed = args
    root = Path(root)
    rng = np.random.default_rng(seed)
    try:
        if op == "fold":
            return ("fold", merge.fold_pending(root))
        if op == "compact":
            return ("compact", merge.compact(root, checkpoint="c2")["checkpoints"])
        source, shard, fold = {"a0": ("s0", "2-of-3", False), "a1": ("s1", "2-of-3", True),
                               "a2": ("s1", "3-of-3", False), "a3": ("s0", "3-of-3", True),
                               "r0": ("s0", "1-of-3", False)}[op]
        e = random_partial(root, rng, source, shard)
        merge.commit(root, [e], fold=fold)
        return ("commit", e)
    except UserError as err:
        return ("error", str(err))


def test_racing_folds_appends_folding_commits_and_compact_of_another_checkpoint(tmp_path):
    # Was a bug (fixed; intermittent, about 1 run in 2): a fold_pending / compact worker died with
    # FileNotFoundError or "…listed in the commit log but missing" when another worker's record deleted
    # the old merged files (or compact of c2 the token_sums) it was reading: the same cause as
    # test_a_fold_whose_old_state_another_writer_replaced_meanwhile_retries (deterministic there).
    """Eight processes at once: appending and folding commits (one a re-run of a folded shard), two
    fold_pending and a compact of checkpoint c2: every partial of c counted once, c2 compacted with
    its views intact, nothing left unlisted."""
    root = tmp_path / "wh"
    rng = np.random.default_rng(10)
    first = [random_partial(root, rng, s, "1-of-3") for s in ("s0", "s1")]
    merge.commit(root, first)
    c2 = [random_partial(root, rng, "s0", f"{i}-of-2", checkpoint="c2") for i in (1, 2)]
    merge.commit(root, [c2[0]])
    merge.commit(root, [c2[1]], fold=False)
    jobs = [(op, str(root), 300 + i) for i, op in enumerate(["a0", "fold", "a1", "compact", "a2", "fold", "a3", "r0"])]
    results = call_all([(_worker, [job]) for job in jobs], processes=4)
    assert not [r for r in results if r[0] == "error"], results
    merge.fold_pending(root)
    manifest = store.read_manifest(root)
    assert merge.pending(manifest) == {}
    assert merge.is_compacted(manifest, "m", "c2")
    rerun = next(r[1] for (op, *_), r in zip(jobs, results) if op == "r0")
    data = [first[1], rerun] + [r[1] for (op, *_), r in zip(jobs, results) if op in ("a0", "a1", "a2", "a3")]
    check_against(root, oracle(root, data))
    assert unlisted(root) == set()
    assert validate(root) == []


# ---------------------------------------------------------------- (3) kill -9 in `cli.py merge`


@pytest.mark.parametrize("point", ["close", "release", "gc"])
def test_kill_9_in_merge_at_more_points(tmp_path, point):
    """`cli.py merge` killed while writing the merged files (close), after its record (release,
    gc): as before or as after, validate --fix cleans, a rerun is exact; a re-run shard appended
    after the kill un-folds correctly."""
    root = tmp_path / "wh"
    rng = np.random.default_rng(11)
    entries = [random_partial(root, rng, s, f"{i}-of-2") for s in ("s0", "s1") for i in (1, 2)]
    merge.commit(root, entries[:1])
    for e in entries[1:]:
        merge.commit(root, [e], fold=False)
    before = quiet_snapshot(root)
    proc = run_subprocess(["merge", "--warehouse", str(root)], fault=f"{point}:1")
    assert proc.returncode == -9, proc.stderr[-2000:]
    landed = merge.pending(store.read_manifest(root)) == {}
    assert landed == (point in ("release", "gc"))
    if not landed:
        assert quiet_snapshot(root) == before
    assert run_cli("validate", "--warehouse", root, "--fix", "--grace", "0")[0] == 0
    assert unlisted(root) == set()
    assert run_cli("merge", "--warehouse", root)[0] == 0
    again = random_partial(root, rng, "s1", "1-of-2")
    merge.commit(root, [again], fold=False)  # held now: un-folded in this record
    entries[2] = again
    invariants(root)
    merge.fold_pending(root)
    check_against(root, oracle(root, entries))
    assert validate(root) == []


# ---------------------------------------------------------------- (3b) kill -9 in `extract --no-fold`


@pytest.fixture(scope="module")
def no_fold_base(tmp_path_factory, sources, model_factory):
    """A warehouse holding shard 1/2 (folded), and one where shard 2/2 was then appended and merged."""
    model = model_factory("gpt_neox", tied=False)
    where = tmp_path_factory.mktemp("nofold")

    def args(wh, shard, *extra):
        return ["extract", "--model", model, "--source", f"alpha={sources['alpha']}", "--warehouse", str(wh),
                "--max-length", "32", "--shard", shard, "--moments", "--sample", "30", *extra]

    before, after = where / "before", where / "after"
    assert run_cli(*args(before, "1/2"))[0] == 0
    shutil.copytree(before, after)
    assert run_cli(*args(after, "2/2", "--no-fold"))[0] == 0
    assert run_cli("merge", "--warehouse", after)[0] == 0
    return {"args": args, "before": before, "after": after}


@pytest.mark.parametrize("point", ["manifest", "views"])
def test_kill_9_in_extract_no_fold(no_fold_base, tmp_path, point):
    """`extract --no-fold` killed before its record (manifest) or after it (views): before, the
    views and runs are as they were; after, the new shard is pending (views unchanged, runs.folded
    false); validate --fix then `merge` give the uninterrupted result."""
    wh = tmp_path / "wh"
    shutil.copytree(no_fold_base["before"], wh)
    before = quiet_snapshot(wh)
    proc = run_subprocess(no_fold_base["args"](wh, "2/2", "--no-fold"), fault=f"{point}:1")
    assert proc.returncode == -9, proc.stderr[-2000:]
    landed = len(data(wh)) == 2
    assert landed == (point != "manifest")
    assert quiet_snapshot(wh) == before  # appended or not: the merged tables are as they were
    assert (merge.pending_pairs(store.read_manifest(wh)) != []) == landed
    assert run_cli("validate", "--warehouse", wh, "--fix", "--grace", "0")[0] == 0
    assert unlisted(wh) == set()
    if not landed:
        assert run_cli(*no_fold_base["args"](wh, "2/2", "--no-fold"))[0] == 0
    assert run_cli("merge", "--warehouse", wh)[0] == 0
    views_close(wh, no_fold_base["after"])
    assert validate(wh) == []


# ---------------------------------------------------------------- (4) validate beside pending partials


def test_validate_fix_with_pending_partials_and_a_damaged_merged_table(tmp_path):
    """validate on a warehouse with pending partials reports nothing and --fix changes nothing; with a
    merged file damaged, --fix rebuilds it without destroying or mis-counting the pending partials."""
    root = tmp_path / "wh"
    rng = np.random.default_rng(12)
    entries = [random_partial(root, rng, s, f"{i}-of-2") for s in ("s0", "s1") for i in (1, 2)]
    merge.commit(root, [entries[0], entries[2]])
    merge.commit(root, [entries[1]], fold=False)
    merge.commit(root, [entries[3]], fold=False)
    gen = store.read_manifest(root)["generation"]
    assert validate(root) == []
    assert validate(root, fix=True, grace_s=0) == []
    assert store.read_manifest(root)["generation"] == gen
    assert len(merge.pending(store.read_manifest(root))) == 3
    manifest = store.read_manifest(root)
    stats = manifest["entries"][merge.group_key("m", "c", "s0")]["files"]["token_stats"]
    raw = bytearray((root / stats).read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    (root / stats).write_bytes(bytes(raw))
    assert validate(root)  # the damage is found
    assert validate(root, fix=True, grace_s=0) == []
    manifest = store.read_manifest(root)
    assert {e["key"] for e in data(root)} == {e["key"] for e in entries}  # nothing of the partials destroyed
    assert all((root / f).exists() for e in entries for f in e["files"].values())
    invariants(root)
    merge.fold_pending(root)
    check_against(root, oracle(root, entries))
    assert validate(root) == []
