"""Groups of partials: which merged entry a partial folds into, what each merged entry covers, and the
checks every fold makes on its inputs (their checksums, a compacted checkpoint).

A data partial is one (model, checkpoint, source, shard) run's sums; its groups are its source (that
source's shards merged) and 'all' (every partial of the checkpoint).  A group's merged entry lists the
partials folded into it (`inputs`, "run_id:key"); partials committed since are *pending* (folded later,
in one pass: commits.fold_pending).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable

from common.errors import UserError

from .. import store
from ..storage import Checked, open_storage
from ..store import Entry, Manifest, partial_id

ALL = "all"


def group_key(model: str, checkpoint: str, group: str) -> str:
    return store.entry_key("merged", model, checkpoint, group)


def in_group(entry: Entry, group: str) -> bool:
    """Whether data entry `entry` belongs to `group` (its own source, or 'all')."""
    return group == ALL or entry["source"] == group


def data_by_pair(manifest: Manifest) -> dict[tuple[str, str], list[Entry]]:
    """The manifest's data entries (partials) by (model, checkpoint)."""
    out = defaultdict(list)
    for e in manifest["entries"].values():
        if e["kind"] == "data":
            out[(e["model"], e["checkpoint"])].append(e)
    return out


def inputs_of(entries: Iterable[Entry]) -> list[str]:
    """The `inputs` of a merged entry that holds exactly `entries`: their partial ids, sorted."""
    return sorted(partial_id(e) for e in entries)


def repair_hint(entry: Entry) -> str:
    """What to do about a damaged or lost file of `entry`."""
    where = f"{entry['model']}@{entry['checkpoint']}"
    if entry["kind"] == "merged":
        return "`python cli.py validate --fix` rebuilds it from its partials"
    if entry["kind"] == "data":
        shard = f" --shard {entry['shard'].replace('-of-', '/')}" if entry.get("shard") not in (None, "1-of-1") else ""
        return (f"it cannot be rebuilt: re-extract {where} --source {entry['source']}{shard} "
                f"(python cli.py extract …), which replaces it")
    return f"it cannot be rebuilt: re-extract {where} (its parameter tables)"


def checked(root, entries: Iterable[Entry | None]) -> Checked:
    """`root` whose reads of the entries' files verify them against their commit records' checksums
    first (each file once per fold, and not at all when this process wrote or verified that very file
    version, or connect() did: store.known_good): a fold never reads a byte its record did not write."""
    st = open_storage(root)
    cache = store.read_verified_cache(st)[0] if st.local else {}
    expected = {}
    for e in entries:
        if e is None:
            continue
        sums = e.get("checksums") or {}
        for rel in e["files"].values():  # (a partial not yet committed: as this process wrote it)
            want = sums.get(rel) or store.written_checksum(st, rel)
            if not store.known_good(st, rel, want, cache):  # (written or verified before, unchanged since)
                expected[rel] = (want, repair_hint(e))
    return Checked(st, expected, on_verified=lambda rel, want: store.note_verified(st, rel, want))


def is_compacted(manifest: Manifest, model: str, checkpoint: str) -> bool:
    return bool(manifest["entries"].get(group_key(model, checkpoint, ALL), {}).get("compacted"))


def check_open(manifest: Manifest, model: str, checkpoint: str) -> None:
    """A compacted checkpoint takes no new partial: its per-token vectors are gone."""
    if is_compacted(manifest, model, checkpoint):
        raise UserError(
            f"{model}@{checkpoint} was compacted (its per-token vectors were dropped), so a new or re-run "
            f"partial cannot be merged exactly; extract into another --warehouse")


# ---------------------------------------------------------------- what each group holds


def expected_groups(manifest: Manifest) -> dict[str, tuple[str, str, str, list[Entry]]]:
    """Merged entry key → (model, checkpoint, group, member data entries) the data calls for."""
    out = {}
    for (model, checkpoint), entries in data_by_pair(manifest).items():
        for group in sorted({e["source"] for e in entries}) + [ALL]:
            out[group_key(model, checkpoint, group)] = (model, checkpoint, group,
                                                        [e for e in entries if in_group(e, group)])
    return out


def folded_members(manifest: Manifest, key: str, members: list[Entry]) -> list[Entry]:
    """The members of group `key` that its merged entry holds (none without one)."""
    inputs = set(manifest["entries"].get(key, {}).get("inputs") or ())
    return [e for e in members if partial_id(e) in inputs]


def pending(manifest: Manifest) -> dict[str, list[Entry]]:
    """Merged entry key → the group's partials committed but not folded into it yet (only groups that
    have some): `commit(..., fold=False)` appends partials, `fold_pending` folds them in one pass."""
    out = {}
    for k, (*_, members) in expected_groups(manifest).items():
        inputs = set(manifest["entries"].get(k, {}).get("inputs") or ())
        todo = [e for e in members if partial_id(e) not in inputs]
        if todo:
            out[k] = todo
    return out


def pending_pairs(manifest: Manifest) -> list[tuple[str, str]]:
    """(model, checkpoint) pairs with a partial not folded into every group it belongs to."""
    return sorted({(m["model"], m["checkpoint"]) for todo in pending(manifest).values() for m in todo})


def stale_groups(manifest: Manifest) -> tuple[list[str], list[str]]:
    """(merged keys whose entry holds a partial the manifest no longer lists — it was dropped without
    being un-folded: a hand-edited manifest or a warehouse restored in parts —, merged keys left over
    with no partial).  A group that holds fewer partials than it has is not stale but pending."""
    want = expected_groups(manifest)
    have = {k: e for k, e in manifest["entries"].items() if e["kind"] == "merged"}
    stale = [k for k, (*_, members) in want.items()
             if k in have and not set(have[k].get("inputs") or ()) <= {partial_id(e) for e in members}]
    return stale, [k for k in have if k not in want]
