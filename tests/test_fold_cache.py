"""The fold against the verified-files cache (a partial changed after it was cached, a torn last line, a
line naming another checksum) and real extracts of a tiny model with every merged table, appended,
re-run while pending and while held, against folding extracts."""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from conftest import run_cli
from common.errors import UserError
from fold_checks import forget_this_process, invariants, views_close
from test_merge import check_against, oracle, random_partial
from warehouse import merge, store
from warehouse.query import PendingPartials, connect
from warehouse.storage import open_storage
from warehouse.validate import validate


# ---------------------------------------------------------------- (5) the verified-files cache


def _flip_in_place(path: Path) -> None:
    """Change one byte in the middle of the file, same size, same inode (a bit flip on disk)."""
    time.sleep(0.02)  # (past the file system's timestamp granularity)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x55]))


@pytest.mark.parametrize("cached_by", ["this process", "connect"])
def test_a_partial_changed_after_it_was_cached_is_caught_by_the_fold(tmp_path, monkeypatch, cached_by):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = tmp_path / "wh"
    rng = np.random.default_rng(13)
    a, b = random_partial(root, rng, "s0", "1-of-2"), random_partial(root, rng, "s0", "2-of-2")
    merge.commit(root, [a])
    merge.commit(root, [b], fold=False)
    if cached_by == "connect":
        forget_this_process(monkeypatch)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PendingPartials)
            connect(root).close()
        cache = store.read_verified_cache(open_storage(root))[0]
        assert str((root / b["files"]["token_sums"]).resolve()) in cache
    _flip_in_place(root / b["files"]["token_sums"])
    with pytest.raises(UserError):
        merge.fold_pending(root)
    assert merge.pending(store.read_manifest(root))  # nothing folded from damaged bytes


def test_a_torn_last_line_in_the_cache_costs_only_that_line(tmp_path, monkeypatch):
    # Was a bug (fixed): store.append_verified (warehouse/store/) appends after a torn last line (a writer killed
    # mid-line) without starting a new line, so the next commit's first line is glued to the torn one
    # and unreadable too: that commit's first file is hashed again by every later fold/connect until
    # connect rewrites the cache.  Safe (never trusts a wrong file), but the torn line costs the next
    # writer's line as well.  Expected: every file of the commit after the torn line is in the cache.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = tmp_path / "wh"
    rng = np.random.default_rng(14)
    a = random_partial(root, rng, "s0", "1-of-2")
    merge.commit(root, [a], fold=False)
    st = open_storage(root)
    path = store.verified_cache_file(st)
    with open(path, "ab") as f:
        f.write(b'["' + str(root).encode() + b'/tables/token_sums/x.parquet", [12, 3')  # torn, no newline
    cache, _ = store.read_verified_cache(st)
    assert len(cache) == 2  # a's two files; the torn line skipped
    b = random_partial(root, rng, "s0", "2-of-2")
    merge.commit(root, [b], fold=False)
    cache, _ = store.read_verified_cache(st)
    want = {str((root / f).resolve()) for e in (a, b) for f in e["files"].values()}
    assert want <= set(cache), sorted(want - set(cache))
    forget_this_process(monkeypatch)
    merge.fold_pending(root)
    check_against(root, oracle(root, [a, b]))


def test_a_cache_line_naming_another_checksum_is_not_trusted(tmp_path, monkeypatch):
    """A cache line for the right file version but recorded with another checksum (the record was
    replaced: a re-run at the same path cannot happen, but a hand-made line can) is not trusted."""
    from warehouse.storage import checksums

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = tmp_path / "wh"
    rng = np.random.default_rng(15)
    a, b = random_partial(root, rng, "s0", "1-of-2"), random_partial(root, rng, "s0", "2-of-2")
    merge.commit(root, [a], fold=False)
    merge.commit(root, [b], fold=False)
    st = open_storage(root)
    forget_this_process(monkeypatch)
    path = str((root / b["files"]["token_sums"]).resolve())
    key = store.file_key(path, {"blake2b": "0" * 32, "size": 1})
    store.append_verified(st, {path: key})
    hashed = []
    real = checksums.checksum
    monkeypatch.setattr(checksums, "checksum", lambda s, rel: hashed.append(rel) or real(s, rel))
    merge.fold_pending(root)
    assert b["files"]["token_sums"] in hashed
    check_against(root, oracle(root, [a, b]))


# ---------------------------------------------------------------- (6) real extracts, every merged table


def test_no_fold_rerun_while_pending_and_while_held_equals_folding_extracts(tmp_path, sources, model_factory):
    """The user's path: shards 1/2 and 2/2 appended (`extract --no-fold`) with moments, cross moments,
    samples, sequences (massive rows too); `sql` says they are pending in one `note:` line; shard 1/2
    re-run while pending; `cli.py merge`; shard 2/2 re-run appended while held (un-folded in that
    record); every view and every merged table equals two folding extracts (the runs are deterministic)."""
    model = model_factory("gpt_neox", tied=False)

    def extract(wh, shard, *extra):
        code, _, err = run_cli("extract", "--model", model, "--source", f"alpha={sources['alpha']}",
                               "--source", f"beta={sources['beta']}", "--warehouse", wh, "--max-length", 32,
                               "--shard", shard, "--moments", "--cross-moments", "--sample", 40, "--sequences", *extra)
        assert code == 0, err

    a, b = tmp_path / "a", tmp_path / "b"
    for shard in ("1/2", "2/2"):
        extract(a, shard, "--no-fold")
        extract(b, shard)
    code, out, err = run_cli("sql", "SELECT count(*) FROM runs WHERE NOT folded", "--warehouse", a, "--format", "csv")
    assert code == 0 and out.splitlines()[1] == "4", (out, err)  # the user is told, in one line
    assert "note: 4 committed partial(s)" in err and "cli.py merge" in err and len(err.splitlines()) == 1
    extract(a, "1/2", "--no-fold")  # pending: just replaced
    invariants(a)
    code, _, err = run_cli("merge", "--warehouse", a)
    assert code == 0 and "folded 4 pending partial(s)" in err, err
    assert "note:" not in run_cli("sql", "SELECT 1", "--warehouse", a)[2]
    extract(a, "2/2", "--no-fold")  # held: un-folded and folded again in this record
    manifest = store.read_manifest(a)
    assert merge.pending(manifest) == {}
    invariants(a)
    views_close(a, b)
    ca, cb = connect(a), connect(b)
    for table in ("moments_merged", "samples_merged", "sequence_moments_merged", "massive_merged", "spectrum",
                  "layer_totals"):
        qa, qb = (c.execute(f"SELECT * FROM {table}").to_arrow_table() for c in (ca, cb))
        qa, qb = (t.drop_columns([c for c in t.column_names if c in ("run_id", "finished_at")]) for t in (qa, qb))
        assert qa.num_rows == qb.num_rows > 0, table
        why = merge.compare_tables(qa, qb, table)
        assert why is None, (table, why)
    ca.close()
    cb.close()
    assert validate(a) == []
