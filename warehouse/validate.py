"""`cli.py validate`: check a warehouse's files against the schema, the manifest and their commit
records' checksums, and every merged table against a fresh merge of its partials; `--fix` repairs
what can be repaired without destroying anything, `--purge` empties the quarantine.

What `--fix` does, and what it never does:

* It rebuilds a missing, corrupt or wrong merged table from its partials (`merge.rebuild`, one new
  commit record).  A damaged partial or parameter table cannot be rebuilt: one line names it and
  what to re-extract.
* A file no entry lists (left by a killed run) is *moved* to `_quarantine/<stamp>/<rel path>`, never
  deleted: at once when it is proven orphaned (its writer proven gone, a replaced file, a temporary
  without a lease), else once older than the grace period (`grace_s`, default 1 hour) — never while
  its run's lease (`_inflight/<run_id>.json`) is live.  The verdicts: warehouse/orphans.py.
* The derived files (manifest.json, runs.parquet, views.sql) are rewritten from the log only by
  --fix: without it validate writes nothing to the warehouse (it works on a full disk).  Derived
  files ahead of a complete log (a copy taken during a commit: `store.DerivedAhead`) are rebuilt from
  the log by --fix, which says so.
* It touches nothing when the commit log is unreadable, damaged, has a gap, or a record is lost (a
  companion ahead of a log that misses files): those are one-line errors (exit 2) for every
  command.  A folder with `tables/` but no commit record is refused too, unless every file there
  belongs to a run whose lease shows it never committed (a first extract killed before its record).

`--purge` deletes what is in `_quarantine/` (the only deletion here), printing each path.
"""

from __future__ import annotations

import datetime as _dt
import json
import re
import secrets
import shlex
import time
from typing import Callable

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from common import faults
from common.errors import UserError

from . import merge, orphans, query, schema, store
from .storage import Storage, StorageFault, open_storage, reading_once, verify
from .store import Entry, Manifest

GRACE_S = 3600.0  # default grace period: a file not listed must be at least this old to be quarantined


def parse_duration(text: str) -> float:
    """Seconds of '90', '90s', '30m', '1h', '2d'."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", str(text))
    if not m:
        raise UserError(f"--grace {text!r}: expected a duration such as 0, 90s, 30m, 1h or 2d")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


def _same_type(got: pa.DataType, want: pa.DataType, table: str, column: str) -> bool:
    if table in ("token_sums",) and column == "vec":  # --vector-dtype: float16/32/64 lists
        return pa.types.is_list(got) and pa.types.is_floating(got.value_type)
    return got == want


def check_file(st: Storage, rel: str, table: str, entry: Entry) -> list[str]:
    """Problems of one listed file: missing, size or checksum unlike its record, unreadable, columns
    or types unlike the schema, partition values inside it unlike the manifest."""
    if not st.exists(rel):
        return [f"{rel}: listed in the manifest but missing; {merge.repair_hint(entry)}"]
    want_sum = (entry.get("checksums") or {}).get(rel)
    if want_sum:
        try:
            verify(st, rel, want_sum, merge.repair_hint(entry))
        except StorageFault:  # the store failed, not the file: one line, not a problem of the file
            raise
        except UserError as e:
            return [str(e)]
        store.note_verified(st, rel, want_sum)  # this version: the re-merges below need not hash it again
    try:
        pf = st.parquet_file(rel)
        got = pf.schema_arrow
    except StorageFault:
        raise
    except Exception as e:  # pyarrow raises several types for a damaged file
        return [f"{rel}: not a readable Parquet file ({str(e)[:200]}); {merge.repair_hint(entry)}"]
    want = schema.TABLES[table]
    problems = []
    if got.names != want.names:
        problems.append(f"{rel}: columns {got.names} differ from the schema's {want.names}")
    else:
        for f in want:
            if not _same_type(got.field(f.name).type, f.type, table, f.name):
                problems.append(f"{rel}: column {f.name} is {got.field(f.name).type}, the schema says {f.type}")
    keys = [k for k in ("model", "checkpoint", "source", "shard") if k in got.names and entry.get(k) is not None]
    try:
        t = st.read_table(rel, columns=keys)
        for k in keys:
            values = set(pc.unique(t.column(k)).to_pylist())
            if values - {entry[k]}:
                problems.append(f"{rel}: column {k} holds {sorted(values)}, the manifest says {entry[k]!r}")
    except StorageFault:
        raise
    except Exception as e:
        problems.append(f"{rel}: unreadable data ({str(e)[:200]})")
    return problems


def purge(root, say: Callable[[str], None] = print) -> list[str]:
    """Delete everything in the quarantine, printing each path; returns them."""
    st = open_storage(root, must_exist=True)
    gone = st.list_files(store.QUARANTINE_DIR)
    for rel in gone:
        say(f"deleted {st.display(rel)}")
        st.delete(rel)
    return gone


def _check_log(st: Storage, files: list[str], leases: dict, ahead_ok: bool = False) -> list[dict]:
    """The commit log's records, every one readable and well-formed (byte for byte as publish wrote
    it), contiguous, not behind a companion (unless `ahead_ok`); a folder with tables/ but no record
    only if its files are provably a killed first run's."""
    seqs = store.latest_seqs(st, full=True, ahead_ok=ahead_ok)  # a gap or a lost record: one line, nothing touched
    records = []
    for seq in seqs:
        rec = store.read_record(st, seq)  # a damaged record: one line naming it
        rel = f"{store.LOG_DIR}/{store.record_name(seq)}"
        if st.read_bytes(rel) != store.record_bytes(rec):  # e.g. a changed space: parses to the same
            raise UserError(f"{st.display(rel)}: damaged commit record (its bytes are not as written); "
                            f"{store.RESTORE_HINT}")
        records.append(rec)
    if not seqs and files and not all(store.run_of(rel) in leases for rel in files):
        raise UserError(f"{st}: holds tables/ but no readable commit log ({store.LOG_DIR}/ missing or empty): "
                        "not a complete warehouse (a partial copy or restore?); nothing was changed — "
                        "restore _log/ or point --warehouse at the complete copy")
    return records


def _rebuild_derived(root: Storage, say) -> None:
    """--fix on derived files ahead of a complete log (store.DerivedAhead): rewritten from its state."""
    seq, manifest = store.read_state(root, ahead_ok=True)
    ahead = store.companions_ahead(root, seq, full=True)
    store.write_companions(root, manifest)
    query.write_views_file(root, manifest)
    was = f" (written from generation {ahead[1]})" if ahead else ""
    say(f"rebuilt manifest.json, runs.parquet and views.sql from the commit log (generation {seq}): they were "
        f"ahead of it{was}, as in a copy taken during a commit")


def _move(root: Storage, rel: str, stamp: str) -> bool:
    """Move `rel` into the quarantine; False when it vanished meanwhile (a writer renamed it)."""
    faults.hit("quarantine")
    try:
        root.move(rel, f"{store.QUARANTINE_DIR}/{stamp}/{rel}")
    except FileNotFoundError:
        return False
    return True


@reading_once
def validate(root, fix: bool = False, grace_s: float = GRACE_S, say: Callable[[str], None] | None = None,
             now: float | None = None) -> list[str]:
    """Problems found (after fixing what `fix` can: lost or damaged merged tables, orphans (at once when
    proven, else older than the grace period), derived files behind, unlike or ahead of the log).
    `say` gets notes that are not problems (what was moved, files of writers in flight, files
    recorded without a checksum).  Without `fix` nothing in the warehouse is written."""
    say = say or (lambda line: None)
    root = open_storage(root, must_exist=True)
    # 1. the files, then the leases, then the state (in this order: see warehouse/orphans.py)
    infos = root.list_infos("tables")
    infos += [i for i in root.list_infos(store.LOG_DIR) if i[0].rsplit("/", 1)[-1].startswith(".")]
    lease_infos = root.list_infos(store.INFLIGHT_DIR)
    leases = store.read_leases(root)
    tables = [rel for rel, _, _ in infos if rel.startswith("tables/")]
    try:
        records = _check_log(root, tables, leases)
    except store.DerivedAhead:
        if not fix:
            raise
        _rebuild_derived(root, say)
        records = _check_log(root, tables, leases)
    manifest = store.read_manifest(root)
    now = time.time() if now is None else now

    # 2. every listed file
    problems: list[str] = []
    bad_entries: dict[str, dict] = {}  # key → entry with a missing or damaged file
    listed, unverified = set(), 0
    for entry in manifest["entries"].values():
        for table, rel in entry["files"].items():
            listed.add(rel)
            unverified += rel not in (entry.get("checksums") or {})
            found = check_file(root, rel, table, entry)
            if found:
                bad_entries[entry["key"]] = entry
            problems += found
    if unverified:
        say(f"note: {unverified} listed file(s) have no checksum in their commit record (written before "
            "checksums were recorded): size and content not verified")

    # 3. files no entry lists: quarantined when provably orphaned
    problems += _orphans(root, orphans.classify(infos, lease_infos, leases, listed,
                                                orphans.once_listed(records) - listed, grace_s, now),
                         fix, grace_s, say)

    # 4. merged tables: every one re-derived from its partials; --fix rebuilds the lost, damaged or wrong
    want = merge.expected_groups(manifest)
    damaged = {k for k, e in bad_entries.items() if e["kind"] != "merged"}  # partials: cannot be rebuilt

    def rebuildable(k: str) -> bool:
        return k not in want or not {m["key"] for m in want[k][3]} & damaged

    try:
        bad = merge.check(root, manifest)
    except OSError as e:  # the fresh merges go to a temporary directory: a full disk there
        problems.append(f"merged tables not re-derived from their partials: {' '.join(str(e).split())[:200]} "
                        "(the fresh merges are written to the temporary directory: free space there or set TMPDIR)")
        bad = []
    if fix:
        todo = sorted({k for k, _ in bad if rebuildable(k)})
        if todo:
            merge.rebuild(root, [k for k in todo if k in want])  # (groups without partials are dropped)
            for k in todo:
                say(f"rebuilt the merged tables of {k} from its partials" if k in want else f"removed {k}")
            query.refresh_companions(root)  # the rebuild's record: views.sql too
            return validate(root, fix=False, grace_s=grace_s, now=now)  # everything again, on the new record
    problems += [msg for k, msg in bad if k not in bad_entries]  # a damaged merged file: reported above
    problems += _companions(root, manifest, fix, say)
    return problems


def _orphans(root: Storage, found: orphans.Orphans, fix: bool, grace_s: float, say) -> list[str]:
    """Report the files not listed and, with `fix`, move the proven ones and those older than the grace."""
    problems = [f"{store.lease_rel(run)}: unreadable lease (it protects run {run}'s files; "
                "remove it if no writer of that run is running)" for run in found.unreadable]
    for run, rels in found.in_flight.items():
        say(f"note: {len(rels)} file(s) of run {run}, e.g. {rels[0]}: still in flight (live lease: "
            f"{found.in_flight_why[run]}): left alone")
    for rel in found.young:
        problems.append(f"{rel}: not listed in the manifest, younger than the grace period ({grace_s:g} s): "
                        "kept (a writer may still commit it; --fix quarantines it once older)")
    if not fix:
        leases = f" with their {len(found.leases_gone)} lease(s)" if found.leases_gone else ""
        if found.proven:
            problems.append(orphans.proven_line(found.proven) + f"; --fix moves them{leases} to "
                            f"{store.QUARANTINE_DIR}/ now")
        problems += [f"{rel}: not listed in the manifest (left by an interrupted run; --fix moves it "
                     f"to {store.QUARANTINE_DIR}/)" for rel in found.old]
        problems += [f"{rel}: lease of a writer that is gone (--fix moves it to {store.QUARANTINE_DIR}/)"
                     for rel in found.leases_old + (found.leases_gone if not found.proven else [])]
        return problems
    stamp = _stamp()
    moved = [rel for rel, _ in found.proven if _move(root, rel, stamp)]
    if moved:
        say(f"moved {len(moved)} file(s) not listed in the manifest, of writers that can no longer commit them, "
            f"to {store.QUARANTINE_DIR}/{stamp}/ ({orphans.proven_line(found.proven).split('(', 1)[1]}")
    for rel in found.old:
        if _move(root, rel, stamp):
            say(f"moved {rel} to {store.QUARANTINE_DIR}/{stamp}/{rel}")
    for rel in found.leases_gone + found.leases_old:
        _move(root, rel, stamp)
    return problems


class _Capture(Storage):
    """`inner` for reading; what is written to it is kept in `written` instead (the bytes a companion
    should have)."""

    def __init__(self, inner: Storage):
        self.inner, self.written = inner, {}
        self.url, self.fs, self.local = inner.url, inner.fs, inner.local

    def __getattribute__(self, name):
        if name in ("inner", "written", "url", "fs", "local", "replace", "__class__", "__dict__"):
            return object.__getattribute__(self, name)
        return getattr(object.__getattribute__(self, "inner"), name)

    def replace(self, rel: str, data: bytes) -> None:
        self.written[rel] = data


def _generation_of(rel: str, data: bytes) -> int | None:
    """The generation a companion's bytes say they were written from (None: unreadable)."""
    try:
        if rel == store.MANIFEST:
            return int(json.loads(data)["generation"])
        if rel == store.RUNS_FILE:
            return int(pq.read_schema(pa.BufferReader(data)).metadata[b"generation"])
        m = re.match(rb"-- generation (\d+) ", data)
        return int(m.group(1)) if m else None
    except Exception:
        return None


_LOCATION = re.compile(rb"'((?:[^'\n]|'')*?/)(?:tables/|runs\.parquet)")


def _opened(location: bytes) -> bytes:
    """views.sql's "Open with" command for a warehouse whose files its paths name under `location`
    (as an SQL literal holds it: glob characters escaped, quotes doubled)."""
    raw = query.glob_unescaped(location.decode("utf-8", "replace").replace("''", "'"))
    return ("duckdb -init " + shlex.quote(raw + store.VIEWS_FILE)).encode()


def _moved_only(got: bytes, want: bytes) -> bool:
    """Whether views.sql `got` is `want` written for this warehouse at another location (copied or
    moved): every path in it names one and the same directory, and putting this warehouse's directory
    in its place everywhere (the "Open with" line too) gives `want` byte for byte — a changed byte
    anywhere else, inside one of the paths included, is not a move."""
    have, where = set(_LOCATION.findall(got)), set(_LOCATION.findall(want))
    if len(have) != 1 or len(where) != 1:
        return False
    old, new = have.pop(), where.pop()
    return got.replace(_opened(old), _opened(new)).replace(old, new) == want


def _companions(root: Storage, manifest: Manifest, fix: bool, say) -> list[str]:
    """manifest.json, runs.parquet and views.sql against what the log says they hold.  Missing or
    behind the log (a writer died or failed between its record and them): a note, and rewritten by
    --fix (a query rewrites them too).  Claiming the latest generation (or none) but differing:
    reported, and rewritten by --fix.  Compared byte for byte (runs.parquet too: a reader ignores
    e.g. its leading magic or its statistics; one written by another pyarrow version is reported once
    and rewritten by --fix).  Without --fix nothing is written."""
    if manifest["entries"]:
        cap = _Capture(root)
        store.write_companions(cap, manifest)
        query.write_views_file(cap, manifest)
        written = cap.written
    else:
        written = {}
    problems, behind = [], []
    for rel, want in written.items():
        try:
            got = root.read_bytes(rel)
        except FileNotFoundError:
            behind.append(rel)
            continue
        gen = _generation_of(rel, got)
        if got == want:
            continue
        if gen is not None and gen < manifest["generation"]:
            behind.append(rel)
            continue
        if rel == store.VIEWS_FILE and _moved_only(got, want):
            continue  # written for this warehouse at another path (copied or moved): `views` rewrites it
        if fix:
            root.replace(rel, want)
            say(f"rewrote {rel} from the commit log")
        else:
            problems.append(f"{rel}: differs from the commit log's state (a derived file; --fix rewrites it)")
    if behind and fix:
        query.refresh_companions(root)
        say(f"rewrote {', '.join(behind)} from the commit log (missing or behind it)")
    elif behind:
        say(f"note: {', '.join(behind)} missing or behind the commit log (a step after a commit's record "
            "failed or was cut short): the next query, `cli.py views` or --fix rewrites them")
    return problems


def _stamp() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S") + "-" + secrets.token_hex(3)
