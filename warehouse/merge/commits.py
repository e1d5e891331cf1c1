"""Commits: publishing partials and merged entries in records of the commit log, with the retry that
lets writers race without a lock; folding pending partials; rebuilding groups.

A commit's cost is its partial's: `commit(..., fold=False)` appends partials (their files and one
record) and reads no group state.  The groups they belong to are then *pending* (groups.pending): each
merged entry still holds exactly the partials its `inputs` list, so every view is exact for the
partials it names, and the `runs` view says which are folded.  `fold_pending` (`cli.py merge`; `cli.py
sweep` when a checkpoint's units are all in; `compact`; `extract` at the end of its commit unless
--no-fold) folds every pending partial of a group in one k-way pass over the group's state
(fold_tokens): the state is read and written once per fold, not once per partial.

Races: a commit that only appends never redoes anything.  A fold whose groups another writer left
alone (it appended partials, or touched other checkpoints) is published on top as it is; only a group
another writer folded meanwhile is folded again — and not at all if that fold already holds ours.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Iterable


from common import faults
from common.errors import UserError

from .. import store
from ..storage import UncertainWrite, open_storage, reading_once
from ..store import Entry, Manifest
from .coverage import check_disjoint, conflict_line, replacements
from .fold import fold_group, relabel_group
from .identity import check_settings
from .groups import (ALL, check_open, data_by_pair, expected_groups, group_key, in_group, partial_id, pending,
                     stale_groups)

# ---------------------------------------------------------------- folds


def held(manifest: Manifest) -> set[str]:
    """Partials (partial_id) that some merged entry holds."""
    return {i for e in manifest["entries"].values() if e["kind"] == "merged" for i in e.get("inputs") or ()}


def fold_groups(root, manifest: Manifest, data: list[Entry], dropped: Iterable[Entry] = (),
         pairs: Iterable[tuple[str, str]] = ()) -> list[dict]:
    """New merged entries, their files written but not committed, for every group of the (model,
    checkpoint) pairs of `data`, of `dropped` and of `pairs` that does not hold exactly its partials
    once the data entries `data` are in (replacing entries of the same key) and the data entries
    `dropped` are out (partials `replacements` found covered or conflicting).  Each such group is
    folded in one pass: every partial it lacks added, every partial it holds that is going un-folded
    (one it never held is just dropped).  A group left without partials gets no entry
    (`empty_groups` names it for removal).  A source group whose partials were made with different
    values of a setting that changes the numbers is refused (identity.check_settings), never folded."""
    by_pair = defaultdict(list)
    for e in data:
        by_pair[(e["model"], e["checkpoint"])].append(e)
    gone = defaultdict(list)
    for e in dropped:
        if e["kind"] != "data":
            continue
        gone[(e["model"], e["checkpoint"])].append(e)
        by_pair.setdefault((e["model"], e["checkpoint"]), [])
    for pair in pairs:
        by_pair.setdefault(tuple(pair), [])
    current_all = data_by_pair(manifest)
    out: list[Entry] = []
    try:
        for (model, checkpoint), new in sorted(by_pair.items()):
            check_open(manifest, model, checkpoint)
            current = {e["key"]: e for e in current_all.get((model, checkpoint), [])}
            replaced = [current[e["key"]] for e in new  # (the very same partial again: not a replacement)
                        if e["key"] in current and partial_id(current[e["key"]]) != partial_id(e)]
            replaced += [e for e in gone[(model, checkpoint)] if e["key"] in current and e not in replaced]
            after = {k: e for k, e in current.items() if k not in {r["key"] for r in replaced}}
            after.update({e["key"]: e for e in new})
            folded: dict[frozenset, dict] = {}  # the partials of a group folded here → its merged entry
            for group in sorted({e["source"] for e in [*after.values(), *replaced]}) + [ALL]:
                inside = [e for e in after.values() if in_group(e, group)]
                if not inside:  # every partial of the group dropped: its merged entry goes (empty_groups)
                    continue
                key = group_key(model, checkpoint, group)
                old = manifest["entries"].get(key)
                inputs = set(old.get("inputs") or ()) if old else set()
                adds = [e for e in inside if partial_id(e) not in inputs]
                removes = [e for e in replaced if in_group(e, group) and partial_id(e) in inputs]
                if inputs - {partial_id(e) for e in [*inside, *removes]}:
                    raise UserError(f"{key}: its merged tables hold a partial the manifest no longer lists "
                                    "(run `python cli.py validate --fix`)")
                if not adds and not removes:
                    continue  # the group holds exactly its partials already
                if adds and group != ALL:
                    check_settings(inside)  # one source's partials: made with the same settings
                members = frozenset(partial_id(e) for e in inside)
                if members in folded:  # the same partials (one source: 'all'): copied, not folded again
                    out.append(relabel_group(root, folded[members], group))
                    continue
                out.append(fold_group(root, model, checkpoint, group, old, adds, removes, inside))
                folded[members] = out[-1]
    except BaseException:
        discard(root, out)
        raise
    return out


def _bases(manifest: Manifest, merged: list[Entry]) -> dict[str, str | None]:
    """The run of the merged entry each new one was folded on (None: from nothing)."""
    return {m["key"]: manifest["entries"].get(m["key"], {}).get("run_id") for m in merged}


def _leaves_stale(manifest: Manifest, put: list[Entry], remove: list[str]) -> bool:
    """Whether the state after putting `put` and removing `remove` would have a merged entry holding
    a partial it no longer lists (the guard that keeps every record exact)."""
    gone = set(remove)
    after = {**manifest, "entries": {k: e for k, e in manifest["entries"].items() if k not in gone}}
    after["entries"].update({e["key"]: e for e in put})
    return bool(stale_groups(after)[0])


def _still_valid(manifest: Manifest, merged: list[Entry], bases: dict, entries: list[Entry] = (),
                 drop: Iterable[str] = ()) -> bool:
    """Whether merged entries folded on an older state can be published on `manifest` as they are:
    no other writer replaced the merged entries they were folded on, and every partial they hold is
    still listed once `entries` are in and the keys `drop` are out."""
    gone = set(drop) | {e["key"] for e in entries}
    listed = {partial_id(e) for e in manifest["entries"].values() if e["kind"] == "data" and e["key"] not in gone}
    listed |= {partial_id(e) for e in entries if e["kind"] == "data"}
    return all(manifest["entries"].get(m["key"], {}).get("run_id") == bases.get(m["key"])
               and set(m["inputs"]) <= listed for m in merged)


def empty_groups(manifest: Manifest, entries: list[Entry], dropped: list[Entry]) -> list[str]:
    """Merged entries left without partials once `dropped` go and `entries` come."""
    keys = {e["key"] for e in dropped} - {e["key"] for e in entries}
    after = [e for e in manifest["entries"].values() if e["kind"] == "data" and e["key"] not in keys] + \
        [e for e in entries if e["kind"] == "data"]
    live = {(e["model"], e["checkpoint"], g) for e in after for g in (e["source"], ALL)}
    out = []
    for e in dropped:
        if e["kind"] != "data":
            continue
        for g in (e["source"], ALL):
            k = group_key(e["model"], e["checkpoint"], g)
            if (e["model"], e["checkpoint"], g) not in live and k in manifest["entries"] and k not in out:
                out.append(k)
    return out


def discard(root, entries: list[Entry]) -> None:
    """Remove the entries' files (uncommitted ones); a storage fault leaves them as orphans, which are
    invisible and removed by `validate --fix`."""
    st = open_storage(root)
    for e in entries:
        for rel in e["files"].values():
            with contextlib.suppress(Exception):
                st.delete(rel)
    store.release_leases(st, {store.run_of(rel) for e in entries for rel in e["files"].values()})


def committed_files(root, entries: list[Entry]) -> set[str] | None:
    """The files of those `entries` that the current state lists (their record was created); None if
    the state cannot be read now (a store failing): whether it landed is unknown."""
    try:
        live = store.read_manifest(root)["entries"]
    except Exception:
        return None
    return {f for e in entries if live.get(e["key"], {}).get("run_id") == e["run_id"] for f in e["files"].values()}


def _discard_unless_committed(root, entries: list[Entry], exc: BaseException) -> None:
    """After an exception around publishing: remove the entries' new files unless the record that
    lists them was created (an interrupt while writing the companions comes after it) or may still
    be (UncertainWrite: they stay, and their leases go, so that `validate --fix` moves them only once
    the grace period is over — long after an attempt still in flight could land)."""
    keep = None if isinstance(exc, UncertainWrite) else committed_files(root, entries)
    if keep is None:  # landed or not, unknown: every file stays
        with contextlib.suppress(Exception):  # (a store failing: the leases stay, as after a kill)
            runs = {store.run_of(rel) for e in entries for rel in e["files"].values()}
            store.release_leases(open_storage(root), runs)
        return
    discard(root, [{**e, "files": {t: f for t, f in e["files"].items() if f not in keep}} for e in entries])


@reading_once
def commit(root, entries: list[Entry], max_tries: int = 1000, replace: bool = False, fold: bool = True) -> list[str]:
    """Publish params and data entries in one commit record, with (`fold`) the merged entries of every
    group of their checkpoints, each holding all its partials — the pending ones of earlier commits
    folded in the same pass; returns the files no entry lists any more (deleted).  With fold=False
    the partials are appended and pending (`fold_pending` folds them): the commit reads no group
    state.  Partials the new ones cover are replaced (`replacements`); one that conflicts (an
    overlapping shard, another version of the source file, other weights under the model's name)
    stops the commit with one line, or with `replace` is dropped in the same record.  A dropped or
    re-run partial that a group holds is un-folded in the same record, whatever `fold` says.  No
    lock: when another writer committed first, the merged entries are published on top of its state
    if it left their groups as they were, else folded again."""
    root = open_storage(root)
    data = [e for e in entries if e["kind"] == "data"]
    pairs = sorted({(e["model"], e["checkpoint"]) for e in data})
    seq, manifest = store.read_state(root)
    merged: list[Entry] = []
    bases: dict = {}
    check_disjoint(entries)
    for _ in range(max_tries):
        try:
            for e in entries:
                store.check_compatible(manifest, e["model"], e["hidden_size"])
            for model, checkpoint in pairs:
                check_open(manifest, model, checkpoint)  # a compacted checkpoint: that line first
            dropped, conflicts = replacements(manifest, entries)
            if conflicts and not replace:
                raise UserError(conflict_line(conflicts))
        except UserError:
            discard(root, merged)  # folded on a state that another writer closed meanwhile
            raise
        dropped += [x for x, _ in conflicts]
        remove = sorted({x["key"] for x in dropped} - {e["key"] for e in entries}) + \
            empty_groups(manifest, entries, dropped)
        if merged and not _still_valid(manifest, merged, bases, entries, remove):
            discard(root, merged)  # another writer folded one of these groups meanwhile
            merged = []
        rerun = [manifest["entries"][e["key"]] for e in data if e["key"] in manifest["entries"]
                 and partial_id(manifest["entries"][e["key"]]) != partial_id(e)]
        unfold = held(manifest) & {partial_id(x) for x in [*dropped, *rerun] if x["kind"] == "data"}
        if not merged and (fold or unfold):
            try:
                merged = fold_groups(root, manifest, data, dropped)
                bases = _bases(manifest, merged)
            except FileNotFoundError as e:  # a writer that committed meanwhile replaced a merged file
                latest, _ = store.changes_since(root, seq)
                if latest == seq:
                    raise UserError(f"{e.filename or e}: listed in the manifest but missing "
                                    "(run `python cli.py validate`)") from None
                seq, manifest = store.read_state(root)
                continue
        if _leaves_stale(manifest, entries + merged, remove):  # a held partial would go without its un-fold
            if not merged and not unfold:
                raise UserError("the merged tables hold partials the manifest no longer lists "
                                "(run `python cli.py validate --fix`)")
            discard(root, merged)
            merged = fold_groups(root, manifest, data, dropped)
            bases = _bases(manifest, merged)
            if _leaves_stale(manifest, entries + merged, remove):
                discard(root, merged)
                raise UserError("the merged tables hold partials the manifest no longer lists "
                                "(run `python cli.py validate --fix`)")
        try:
            faults.hit("merge")  # merged files written, commit record not yet
            stale = store.publish(root, seq, manifest, entries + merged, remove)
        except BaseException as exc:
            _discard_unless_committed(root, merged, exc)
            raise
        if stale is not None:
            return stale
        seq, manifest = store.read_state(root)
    discard(root, merged)
    raise UserError(f"{root}: gave up committing after {max_tries} tries (other writers kept committing first)")


@reading_once
def fold_pending(root, model: str | None = None, checkpoint: str | None = None, max_tries: int = 1000) -> int:
    """Fold every partial pending when it starts (of `model` / `checkpoint` if given) into its groups:
    one pass per group, one commit record; returns how many of them are folded at its end (by it or by
    a writer that raced it), re-runs that replaced one meanwhile included.  Racing with another fold: a
    group it folded first is not folded again; with appending commits: its fold is published on top of
    them (their partials stay pending); with a writer that replaced what it folded: it folds what is
    pending then.  A stale group of another checkpoint does not stop it."""
    root = open_storage(root)
    match = lambda e: (model is None or e["model"] == model) and (checkpoint is None or e["checkpoint"] == checkpoint)  # noqa: E731
    want: set[str] | None = None
    merged: list[Entry] = []
    bases: dict = {}
    for _ in range(max_tries):
        seq, manifest = store.read_state(root)
        stale = [k for k in stale_groups(manifest)[0] if match(manifest["entries"][k])]
        if stale:
            discard(root, merged)
            raise UserError(f"{stale[0]}: its merged tables hold a partial the manifest no longer lists "
                            "(run `python cli.py validate --fix`)")
        todo = [e for group in pending(manifest).values() for e in group if match(e)]
        if merged and not _still_valid(manifest, merged, bases):
            discard(root, merged)  # another writer folded or replaced what it holds: fold what is pending now
            merged = []
            want = (want or set()) | {partial_id(e) for e in todo}
        if want is None:
            want = {partial_id(e) for e in todo}
        if not want & {partial_id(e) for e in todo}:  # all folded into every group (here or by another writer)
            discard(root, merged)
            return len(want & held(manifest))  # (not those another writer replaced meanwhile)
        if not merged:
            pairs = sorted({(e["model"], e["checkpoint"]) for e in todo if partial_id(e) in want})
            try:
                merged = fold_groups(root, manifest, [], [], pairs)
            except FileNotFoundError as e:  # another writer replaced a file this fold was reading
                if store.changes_since(root, seq)[0] == seq:
                    raise UserError(f"{e.filename or e}: listed in the manifest but missing "
                                    "(run `python cli.py validate`)") from None
                continue
            bases = _bases(manifest, merged)
        try:
            faults.hit("merge")
            ok = store.publish(root, seq, manifest, merged, [])
        except BaseException as exc:
            _discard_unless_committed(root, merged, exc)
            raise
        if ok is not None:
            merged = []
    discard(root, merged)
    raise UserError(f"{root}: gave up folding after {max_tries} tries (other writers kept committing first)")


def publish_retrying(root, make) -> object:
    """Run make(manifest) → (entries, remove, result) and publish it; on a lost race, discard its new
    entries' files and run it again on the newer state."""
    while True:
        seq, manifest = store.read_state(root)
        entries, remove, result = make(manifest)
        if not entries and not remove:
            return result
        new = [e for e in entries if e["kind"] == "merged" and not e.get("compacted")]  # files written by make
        try:
            ok = store.publish(root, seq, manifest, entries, remove)
        except BaseException as exc:
            _discard_unless_committed(root, new, exc)
            raise
        if ok is not None:
            return result
        discard(root, new)


@reading_once
def rebuild(root, keys: list[str] | None = None) -> int:
    """Re-merge the given groups (default: every stale one) from their partials and commit them;
    returns how many were rebuilt.  Compacted checkpoints cannot be rebuilt (their vectors are gone)."""
    root = open_storage(root)

    def make(manifest):
        stale, extra = stale_groups(manifest)
        want = expected_groups(manifest)
        todo = [k for k in (stale if keys is None else keys) if k in want]
        new: list[dict] = []
        try:
            for k in todo:
                model, checkpoint, group, members = want[k]
                if any(e.get("compacted") for e in members):
                    raise UserError(f"{model}@{checkpoint}: compacted, its merged tables cannot be rebuilt")
                new.append(fold_group(root, model, checkpoint, group, None, members, [], members))
            faults.hit("merge")
        except BaseException:
            discard(root, new)
            raise
        return new, extra, len(new)

    return publish_retrying(root, make)
