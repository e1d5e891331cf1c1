"""The shape of the manifest and its entries, in one place: what a commit record puts, what
`read_state` returns, what `manifest.json` shows.  These are plain dicts (JSON as written);
the TypedDicts below only name their keys for readers and type checkers.

An entry is one run's files of one key: a checkpoint's parameter tables ("params"), one
(model, checkpoint, source, shard) partial's sums ("data"), or a group's fold of partials ("merged").
"""

from __future__ import annotations

import json
from typing import Literal, TypedDict

from common.errors import UserError


class Checksum(TypedDict):
    size: int  # bytes of the file
    blake2b: str  # hex blake2b (64-byte digest) of its bytes


class EntryCore(TypedDict):
    """The keys every entry has."""
    key: str  # entry_key(kind, model, checkpoint, source, shard): the entry's key in the manifest
    kind: Literal["params", "data", "merged"]  # parameter tables / a partial's sums / a group's fold
    model: str  # the model's name in the warehouse
    checkpoint: str  # its checkpoint ("main", "step1000", …)
    step: int | None  # the training step of the checkpoint (None: not known)
    source: str | None  # data: the text source; merged: the group (a source or "all"); params: None
    shard: str | None  # data: "I-of-N", the share of the source's documents; otherwise None
    run_id: str  # the run that wrote the files (paths.new_run_id); a re-run is another partial
    finished_at: str  # when the run finished, "%Y-%m-%dT%H:%M:%S%z"
    hidden_size: int  # d; one per model across the warehouse (check_compatible)
    files: dict[str, str]  # table name → path of its Parquet file, relative to the root
    stats: dict  # data: what the run counted (tokens, documents, skipped, …); merged: {"partials": n}
    settings: dict  # data, params: the extract settings of the run; merged: {"sample": k or None}
    provenance: dict  # code, packages, weights and source fingerprints of the run ({} for merged)


class Entry(EntryCore, total=False):
    """A manifest entry: the keys above, and these where they apply."""
    checksums: dict[str, Checksum]  # file path → its checksum (publish adds it; older records lack it)
    inputs: list[str]  # merged: the partials folded into it, sorted partial_id()s
    compacted: bool  # True once `compact` dropped the checkpoint's per-token vectors


class Manifest(TypedDict):
    """The state of a warehouse: the latest commit record's, with every earlier change applied."""
    schema_version: int  # schema.SCHEMA_VERSION of the tool that wrote it
    entries: dict[str, Entry]  # entry key → entry
    generation: int  # the sequence number of the record it is the state of (0: no record yet)


class CommitRecord(TypedDict, total=False):
    """One `_log/<seq>.json` (every key but "manifest" is always there)."""
    seq: int  # its sequence number: 1, 2, … without a gap
    nonce: str  # random: a writer tells its own record from another's of the same seq (a retried PUT)
    time: str  # UTC, ISO 8601
    writer: dict  # {"host", "pid"} of the process that wrote it
    put: list[Entry]  # entries added, or replacing those of the same key
    remove: list[str]  # keys removed
    manifest: Manifest  # the whole state after it: record 1 and every SNAPSHOT_EVERY-th
    digest: str  # blake2b of the record's canonical JSON without this field


def entry_key(kind: str, model: str, checkpoint: str, source: str | None = None,
              shard: str | None = None) -> str:
    return json.dumps([kind, model, checkpoint, source, shard])


def partial_id(entry: Entry) -> str:
    """How a merged entry's `inputs` name a partial: its run and key (a re-run is another partial)."""
    return entry["run_id"] + ":" + entry["key"]


def check_compatible(manifest: Manifest, model: str, hidden_size: int) -> None:
    for e in manifest["entries"].values():
        if e["model"] == model and e.get("hidden_size") not in (None, hidden_size):
            raise UserError(
                f"warehouse already holds model {model!r} with hidden size {e['hidden_size']}, "
                f"this one has {hidden_size}; give it another name or use another --warehouse"
            )
