"""The commit log: `_log/<seq>.json`, one immutable record per commit, created only if absent (no
lock: see warehouse.storage for how each kind of storage makes that atomic).  A record holds the
entries it adds or replaces and the keys it removes (every SNAPSHOT_EVERY-th also the whole
manifest); the state is the latest record's.  Two writers that read the same state race for the
same next record: exactly one creates it, the other re-reads and tries again on top of it
(`publish` returns None).  So a killed run leaves nothing that a view can see, and a re-run of the
same key replaces the earlier entry instead of adding to it.  Files that no entry lists any more
are deleted after the commit.

Generations are contiguous (record n is created only on top of record n − 1): `read_state` refuses
a log with a gap, a damaged record, or a companion written from a newer generation than the latest
record — one line each, never a silent rollback.  Companions ahead of a log whose records and files
are all present (a copy that took them after a commit's record but `_log/` before it) are derived
files ahead of the log (`DerivedAhead`): `validate --fix` rebuilds them from the log; otherwise the
newer record is lost (restore it from a backup).

A failure after the record (writing the companions, removing the lease or the replaced files) does
not undo the commit: `publish` finishes what it can and warns (`AfterRecord`, store/after_record.py).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import secrets
import warnings

from common import faults
from common.errors import UserError

from .. import schema
from ..storage import Storage, open_storage
from .after_record import AfterRecord
from .companions import companions_ahead, write_companions
from .entries import CommitRecord, Entry, Manifest
from .leases import HOST, release_leases
from .paths import LOG_DIR, MANIFEST, RECORD_NAME, record_name, run_of
from .verified import remember_written, with_checksums

SNAPSHOT_EVERY = 32  # every 32nd record holds the whole manifest; the others only their changes
RESTORE_HINT = "restore it from a backup (nothing was changed; validate --fix does not touch a damaged log)"


class DerivedAhead(UserError):
    """Companions written from a generation newer than the latest record, while every record and every
    file the log lists (or a merged table's partials, from which it is rebuilt) is present: derived
    files ahead of the log, which `validate --fix` rebuilds from it."""


def record_seqs(st: Storage) -> list[int]:
    """The sequence numbers of the records in the log, sorted (not checked: see latest_seqs)."""
    names = (rel.rsplit("/", 1)[-1] for rel in st.list_files(LOG_DIR))
    return sorted(int(n[:-5]) for n in names if RECORD_NAME.fullmatch(n))


def _record_problem(rec) -> str | None:
    """What is wrong with a parsed commit record (None: its shape is sound)."""
    if not isinstance(rec, dict):
        return "not a JSON object"
    for k in ("put", "remove"):
        if not isinstance(rec.get(k), list):
            return f"no {k!r} list"
    if not all(isinstance(e, dict) and isinstance(e.get("key"), str) and isinstance(e.get("files"), dict)
               for e in rec["put"]):
        return "an entry without key or files"
    if not all(isinstance(k, str) for k in rec["remove"]):
        return "a removed key that is not a string"
    if "manifest" in rec and not (isinstance(rec["manifest"], dict) and isinstance(rec["manifest"].get("entries"), dict)):
        return "a snapshot without entries"
    return None


def record_digest(rec: CommitRecord) -> str:
    """blake2b of a record's canonical JSON without its "digest" field."""
    body = json.dumps({k: v for k, v in rec.items() if k != "digest"}, sort_keys=True).encode()
    return hashlib.blake2b(body, digest_size=16).hexdigest()


def record_bytes(rec: CommitRecord) -> bytes:
    """A record as `publish` writes it (validate compares the stored bytes with this)."""
    return json.dumps(rec, sort_keys=True).encode()


def read_record(st: Storage, seq: int) -> CommitRecord:
    """Commit record `seq`, checked: one UserError line if it is gone, not JSON, malformed or unlike its digest."""
    rel = f"{LOG_DIR}/{record_name(seq)}"
    try:
        rec = json.loads(st.read_bytes(rel))
    except FileNotFoundError:
        raise UserError(f"{st.display(rel)}: commit record vanished while reading the log; {RESTORE_HINT}") from None
    except (OSError, ValueError) as e:
        raise UserError(f"{st.display(rel)}: damaged commit record (not JSON: {str(e)[:120]}); {RESTORE_HINT}") from None
    problem = _record_problem(rec)
    if not problem and "digest" in rec and rec["digest"] != record_digest(rec):
        problem = "its content does not match its digest"
    if problem:
        raise UserError(f"{st.display(rel)}: damaged commit record ({problem}); {RESTORE_HINT}")
    return rec


def check_contiguous(st: Storage, seqs: list[int]) -> None:
    """Generations are 1, 2, …, n: a gap is a lost record."""
    if seqs and seqs != list(range(1, seqs[-1] + 1)):
        have = set(seqs)
        missing = [s for s in range(1, seqs[-1] + 1) if s not in have]
        raise UserError(f"{st.display(LOG_DIR)}: commit record(s) {', '.join(map(str, missing[:3]))}"
                        f"{' …' if len(missing) > 3 else ''} missing before the latest ({seqs[-1]}): a lost "
                        f"record; {RESTORE_HINT}")


def latest_seqs(st: Storage, full: bool = False, ahead_ok: bool = False) -> list[int]:
    """The log's record numbers, checked: contiguous from 1, and no companion ahead of the latest
    (re-listed once in case a writer committed between the listing and the companions' read).
    `ahead_ok`: companions ahead are ignored (validate --fix, which rebuilds them)."""
    for attempt in range(3):
        seqs = record_seqs(st)
        check_contiguous(st, seqs)
        latest = seqs[-1] if seqs else 0
        ahead = None if ahead_ok else companions_ahead(st, latest, full)
        if ahead is None:
            return seqs
        if attempt < 2 and (record_seqs(st) or [0])[-1] >= ahead[1]:
            continue  # a writer committed meanwhile
        name, gen = ahead
        if seqs and _log_complete(st, seqs):
            raise DerivedAhead(
                f"{st.display(LOG_DIR)}: {name} was written from generation {gen} but the log ends at record "
                f"{latest}, and every record and file it lists is here (a copy that took the derived files after "
                f"a commit's record but {LOG_DIR}/ before it?): manifest.json, runs.parquet and views.sql are "
                f"ahead of the log; `python cli.py validate --fix` rebuilds them from it (generation {latest}); "
                "nothing was changed")
        raise UserError(f"{st.display(LOG_DIR)}: the latest commit record is {latest} but {name} was written "
                        f"from generation {gen}: record(s) {latest + 1}…{gen} lost; {RESTORE_HINT}")
    return record_seqs(st)


def _log_complete(st: Storage, seqs: list[int]) -> bool:
    """Whether every record of `seqs` is readable and every file its state lists is present — a
    merged table may be missing if it is not compacted (validate --fix rebuilds it from its partials)."""
    manifest = _state(st, seqs)
    for e in manifest["entries"].values():
        for rel in e["files"].values():
            if not st.exists(rel) and (e["kind"] != "merged" or e.get("compacted")):
                return False
    return True


def _empty() -> Manifest:
    return {"schema_version": schema.SCHEMA_VERSION, "entries": {}, "generation": 0}


def _check_version(manifest: dict, path: str) -> None:
    version = manifest.get("schema_version")
    if version != schema.SCHEMA_VERSION:
        raise UserError(
            f"{path}: warehouse schema version {version}, this tool writes version "
            f"{schema.SCHEMA_VERSION}; use another --warehouse"
        )


def read_state(root, ahead_ok: bool = False) -> tuple[int, Manifest]:
    """(sequence number, manifest) of the latest commit record: the newest snapshot at or before it,
    with the later records' changes applied.  `ahead_ok`: companions ahead of the log are ignored
    (validate --fix, to rebuild them)."""
    st = open_storage(root)
    seqs = latest_seqs(st, ahead_ok=ahead_ok)
    if not seqs:
        if not st.exists(MANIFEST):
            return 0, _empty()
        # manifest.json without a record: an earlier version's warehouse or a lost log — or the first commit's
        # record and manifest.json landed after the listing, which a second listing sees
        seqs = latest_seqs(st, ahead_ok=ahead_ok)
    if not seqs:
        legacy = st.display(MANIFEST)
        try:
            manifest = json.loads(st.read_bytes(MANIFEST))
        except (OSError, ValueError) as e:
            raise UserError(f"{legacy}: unreadable manifest ({e})") from None
        _check_version(manifest, legacy)
        if isinstance(manifest, dict) and manifest.get("generation"):
            raise UserError(f"{st.display(LOG_DIR)}: commit log missing or empty but {MANIFEST} was written from "
                            f"generation {manifest['generation']}: the log was lost; {RESTORE_HINT}")
        raise UserError(f"{legacy}: warehouse without a commit log (written by an earlier version); "
                        "use another --warehouse")
    return seqs[-1], _state(st, seqs)


def _state(st: Storage, seqs: list[int]) -> Manifest:
    """The manifest of record seqs[-1] (seqs contiguous and non-empty)."""
    deltas = []
    for seq in reversed(seqs):
        rec = read_record(st, seq)
        if "manifest" in rec:
            manifest = rec["manifest"]
            break
        deltas.append(rec)
    else:
        raise UserError(f"{st.display(LOG_DIR)}: no snapshot record at or before {seqs[-1]} (damaged commit log)")
    _check_version(manifest, st.display(f"{LOG_DIR}/{record_name(seqs[-1])}"))
    for rec in reversed(deltas):
        _apply(manifest, rec["put"], rec["remove"])
    manifest["generation"] = seqs[-1]
    return manifest


def _apply(manifest: Manifest, put: list[Entry], remove: list[str]) -> None:
    for key in remove:
        manifest["entries"].pop(key, None)
    for e in put:
        manifest["entries"][e["key"]] = e


def read_manifest(root) -> Manifest:
    """The current state: the manifest of the latest commit record."""
    return read_state(root)[1]


def changes_since(root, seq: int) -> tuple[int, list[CommitRecord]]:
    """(latest seq, the records after `seq`): what other writers committed since a base was read."""
    st = open_storage(root)
    seqs = [s for s in record_seqs(st) if s > seq]
    return (seqs[-1] if seqs else seq), [read_record(st, s) for s in seqs]


def publish(root, base_seq: int, manifest: Manifest, entries: list[Entry], remove: list[str] = ()
            ) -> list[str] | None:
    """Commit `entries` (added or replacing entries of the same key) and drop `remove`, on top of
    `manifest`, the state of record `base_seq`: create record base_seq + 1 if absent (no lock).
    Returns the files no entry lists any more (deleted), or None if another writer took that
    record first — the caller re-reads the state and tries again."""
    st = open_storage(root)
    entries = [with_checksums(st, e) for e in entries]
    new = {**manifest, "entries": dict(manifest["entries"])}
    old_files = {f for e in manifest["entries"].values() for f in e["files"].values()}
    _apply(new, list(entries), list(remove))
    live = {f for e in new["entries"].values() for f in e["files"].values()}
    seq = base_seq + 1
    record = {"seq": seq, "nonce": secrets.token_hex(8), "time": _dt.datetime.now(_dt.timezone.utc).isoformat(),
              "writer": {"host": HOST, "pid": os.getpid()}, "put": list(entries), "remove": list(remove)}
    if seq == 1 or seq % SNAPSHOT_EVERY == 0:
        record["manifest"] = {**new, "generation": seq}
    record["digest"] = record_digest(record)  # a changed byte that still parses is a damaged record too
    faults.hit("manifest")
    if companions_ahead(st, base_seq) is not None:  # never create a record over a lost one
        if st.exists(f"{LOG_DIR}/{record_name(seq)}"):
            return None  # only another writer's commit: re-read and try again
        latest_seqs(st)  # raises the lost-record line
    if not st.create_if_absent(f"{LOG_DIR}/{record_name(seq)}", record_bytes(record)):
        return None
    new["generation"] = seq
    manifest.clear()
    manifest.update(new)
    stale = sorted(old_files - live)
    _after_record(st, seq, manifest, entries, stale)
    return stale


def _after_record(st: Storage, seq: int, manifest: Manifest, entries: list[Entry], stale: list[str]) -> None:
    """What follows record `seq`: the companions, the writer's leases, the verified-files cache, the
    replaced files.  The commit has landed: each step that fails (OSError, a storage's one-line
    error) is an AfterRecord warning, and the next one still runs.  An interrupt is not caught."""

    def companions():
        faults.hit("views")
        write_companions(st, manifest)

    def gc():
        faults.hit("gc")
        for rel in stale:
            st.delete(rel)

    steps = (("companions", companions),
             ("release", lambda: release_leases(st, {run_of(f) for e in entries for f in e["files"].values()})),
             (None, lambda: remember_written(st, entries)),  # best effort: the first query need not hash them
             ("gc", gc))
    for step, run in steps:
        try:
            run()
        except (OSError, UserError) as e:
            if step is not None:
                warnings.warn(AfterRecord(seq, step, e), stacklevel=3)
