"""Checks shared by the fold's adversarial tests (test_fold_adversarial.py, test_fold_cache.py): a
warehouse's views with pending-partial warnings silenced, its data entries and unlisted files, a clean
one-shot fold of what it lists, views compared to a tolerance, the invariants that hold at every moment,
and this process's verified-files memory forgotten."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import numpy as np

from test_merge import rounded_views
from warehouse import merge, store
from warehouse.query import PendingPartials, connect


def quiet_snapshot(root: Path) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PendingPartials)
        return rounded_views(root)


def data(root: Path) -> list[dict]:
    return [e for e in store.read_manifest(root)["entries"].values() if e["kind"] == "data"]


def unlisted(root: Path, keep: list[dict] = ()) -> set[str]:
    """Parquet files under tables/ that no manifest entry lists (nor the uncommitted entries `keep`)."""
    listed = {f for e in [*store.read_manifest(root)["entries"].values(), *keep] for f in e["files"].values()}
    return {str(p.relative_to(root)) for p in (root / "tables").rglob("*.parquet")} - listed


def drop_files(root: Path, entry: dict) -> None:
    for rel in entry["files"].values():
        (root / rel).unlink(missing_ok=True)


def one_shot_fold(root: Path, dest: Path) -> Path:
    """A fresh warehouse at `dest` holding the partials `root` lists now, committed in one folding
    commit (their files copied to the same paths): the one-shot fold every sequence must equal."""
    entries = data(root)
    for e in entries:
        for rel in e["files"].values():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / rel, dest / rel)
    merge.commit(dest, entries)
    return dest


def views_close(a: Path, b: Path, rtol: float = 1e-9) -> None:
    """Every view of `a` equals `b`'s: integers and strings exactly, floats to rtol."""
    sa, sb = quiet_snapshot(a), quiet_snapshot(b)
    assert sa.keys() == sb.keys()
    for view in sa:
        ra, rb = sa[view], sb[view]
        assert len(ra) == len(rb), view
        for x, y in zip(ra, rb):
            for u, v in zip(x, y):
                if isinstance(u, float) and isinstance(v, float):
                    assert (np.isnan(u) and np.isnan(v)) or abs(u - v) <= rtol * max(abs(v), 1.0), (view, x, y)
                else:
                    assert u == v, (view, x, y)


def invariants(root: Path) -> None:
    """At every moment: no merged entry holds a partial the manifest does not list, every merged table
    equals a fresh merge of what it holds, no file is left unlisted, runs.folded agrees with pending."""
    manifest = store.read_manifest(root)
    assert merge.stale_groups(manifest) == ([], [])
    assert merge.check(root, manifest) == []
    assert unlisted(root) == set()
    pending_ids = {merge.partial_id(e) for todo in merge.pending(manifest).values() for e in todo}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PendingPartials)
        con = connect(root, views=["runs"])
    rows = con.execute("SELECT run_id, model, checkpoint, source, shard, folded FROM runs WHERE kind = 'data'").fetchall()
    con.close()
    by_run = {e["run_id"]: e for e in manifest["entries"].values() if e["kind"] == "data"}
    for run_id, *_, folded in rows:
        assert folded == (merge.partial_id(by_run[run_id]) not in pending_ids)


def forget_this_process(monkeypatch):
    """This process's memory of the files it wrote and verified, forgotten (as a fresh process has none)."""
    from warehouse.store import verified

    monkeypatch.setattr(verified, "_WRITTEN", {})
    monkeypatch.setattr(verified, "_WRITTEN_KEY", {})
    monkeypatch.setattr(verified, "_VERIFIED", {})
