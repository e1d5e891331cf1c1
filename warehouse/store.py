"""Atomic writes and the manifest.

A run writes its Parquet files under `tables/<table>/<partition dirs>/<run_id>.parquet`
(locally: a temporary name, fsynced, renamed; on S3: one upload that appears when complete — see
storage.py).  Files become visible to queries only when the manifest lists them, and the manifest
is a commit log without locks: `_log/<seq>.json`, one immutable record per commit, created only if
absent (a hard link of a complete file on local disks and NFS, a PUT with `If-None-Match: *` on
S3).  A record holds the entries it adds or replaces
and the keys it removes (every 32nd also the whole manifest); the state is the latest record's.
Two writers that read the same state race for the same next record: exactly one creates it, the
other re-reads and tries again on top of it (`publish` returns None).  So a killed run leaves
nothing that a view can see, and a re-run of the same key replaces the earlier entry instead of
adding to it.  Files that no entry lists any more are deleted after the commit; files of runs
that never committed are moved to `_quarantine/` by `validate --fix` (never deleted there).

Checksums: every file a TableWriter writes is hashed (blake2b) and counted while its bytes go out,
and `publish` records {"size", "blake2b"} of every file of every entry it puts in
entry["checksums"][rel] (a file written by another process is hashed by reading it once).
Companions (manifest.json, runs.parquet, views.sql) carry no checksum: they are derived from the
log and rewritten from it whenever they are behind.

Generations are contiguous (record n is created only on top of record n − 1): `read_state` refuses
a log with a gap, a damaged record, or a companion written from a newer generation than the latest
record (a lost record) — one line each, never a silent rollback.

Leases: before a process writes the first file of a run id it creates `_inflight/<run_id>.json`
(host, pid, heartbeat, refreshed every HEARTBEAT_S by a thread), and removes it once a commit
record lists those files (or at exit).  `validate --fix` never quarantines a file of a run id whose
lease is live (see `lease_alive`).

Above storage.py (bytes and names), this knows files and the manifest, not what the tables mean
(merge.py folds partials, query.py makes views; neither is imported here).
"""

from __future__ import annotations

import atexit
import datetime as _dt
import json
import os
import re
import secrets
import socket
import threading
import time
from pathlib import Path
from urllib.parse import quote

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from common import faults
from common.errors import UserError

from . import schema
from .storage import HASH, HashingStream, Storage, checksum, open_storage

MANIFEST = "manifest.json"  # a copy of the current state (companion); the commit log is authoritative
LOG_DIR = "_log"
SNAPSHOT_EVERY = 32  # every 32nd record holds the whole manifest; the others only their changes
RUNS_FILE = "runs.parquet"
VIEWS_FILE = "views.sql"
INFLIGHT_DIR = "_inflight"  # leases of writers in flight: <run_id>.json
QUARANTINE_DIR = "_quarantine"  # what validate --fix moved away: <stamp>/<original rel path>
HEARTBEAT_S = 60.0  # a lease's heartbeat is refreshed this often while it is held
_RECORD = re.compile(r"\d{20}\.json")
_RUN_ID = re.compile(r"\d{8}T\d{6}-[0-9a-f]{8}")
_HOST = socket.gethostname()
_WRITER = {"host": _HOST, "pid": os.getpid()}
_WRITTEN: dict[str, dict] = {}  # storage path of a file this process wrote → its checksum
_WRITTEN_KEY: dict[str, list] = {}  # … → its file_key right after the rename (local files)


def new_run_id() -> str:
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
    return f"{stamp}-{secrets.token_hex(4)}"


def partition_dir(table: str, values: dict[str, str]) -> str:
    """Relative directory of one partition; values are percent-encoded (no '/' or '..' escape)."""
    keys = (schema.DATA_PARTITIONS if table in schema.DATA_TABLES else
            schema.MERGED_PARTITIONS if table in schema.MERGED_TABLES else schema.PARAM_PARTITIONS)
    parts = [f"{k}={quote(str(values[k]), safe='')}" for k in keys]
    return "/".join(["tables", table, *parts])


def entry_key(kind: str, model: str, checkpoint: str, source: str | None = None,
              shard: str | None = None) -> str:
    return json.dumps([kind, model, checkpoint, source, shard])


def atomic_write_bytes(root, rel: str, data: bytes) -> None:
    open_storage(root).replace(rel, data)


def list_array(M) -> pa.ListArray:
    """Rows of a (m, d) numpy array as an Arrow list column (the vector columns' layout)."""
    m, d = M.shape
    return pa.ListArray.from_arrays(pa.array(np.arange(0, (m + 1) * d, d, dtype=np.int32)), pa.array(M.reshape(-1)))


class TableWriter:
    """Streams record batches of one table into one Parquet file that appears (under its final
    name) only when `close` returns."""

    def __init__(self, root, table: str, values: dict[str, str], run_id: str,
                 arrow_schema: pa.Schema | None = None):
        self.storage = open_storage(root)
        self.rel = f"{partition_dir(table, values)}/{run_id}.parquet"
        self.schema = arrow_schema or schema.TABLES[table]
        hold_lease(self.storage, run_id)  # before the first byte: validate --fix leaves the file alone
        self._out = self.storage.output(self.rel)
        self._hash = HashingStream(self._out.stream)  # the checksum, computed while the bytes go out
        self._writer = pq.ParquetWriter(pa.PythonFile(self._hash, mode="w"), self.schema,
                                        **schema.write_options(table, self.schema))

    def write(self, columns: dict) -> None:
        self._writer.write_table(pa.table(columns, schema=self.schema))
        faults.hit("write")

    def close(self) -> str:
        self._writer.close()
        faults.hit("close")
        self._out.commit()
        _WRITTEN[self.storage.path(self.rel)] = self._hash.checksum()
        if self.storage.local:
            key = file_key(os.path.abspath(self.storage.path(self.rel)), _WRITTEN[self.storage.path(self.rel)])
            if key is not None:
                _WRITTEN_KEY[self.storage.path(self.rel)] = key
        return self.rel

    def abort(self) -> None:
        try:
            self._writer.close()
        except Exception:
            pass
        self._out.abort()


def _record_name(seq: int) -> str:
    return f"{seq:020d}.json"


def _seqs(st: Storage) -> list[int]:
    names = (rel.rsplit("/", 1)[-1] for rel in st.list_files(LOG_DIR))
    return sorted(int(n[:-5]) for n in names if _RECORD.fullmatch(n))


_RESTORE = "restore it from a backup (nothing was changed; validate --fix does not touch a damaged log)"


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


def record_digest(rec: dict) -> str:
    """blake2b of a record's canonical JSON without its "digest" field."""
    import hashlib

    body = json.dumps({k: v for k, v in rec.items() if k != "digest"}, sort_keys=True).encode()
    return hashlib.blake2b(body, digest_size=16).hexdigest()


def record_bytes(rec: dict) -> bytes:
    """A record as `publish` writes it (validate compares the stored bytes with this)."""
    return json.dumps(rec, sort_keys=True).encode()


def _read_record(st: Storage, seq: int) -> dict:
    rel = f"{LOG_DIR}/{_record_name(seq)}"
    try:
        rec = json.loads(st.read_bytes(rel))
    except FileNotFoundError:
        raise UserError(f"{st.display(rel)}: commit record vanished while reading the log; {_RESTORE}") from None
    except (OSError, ValueError) as e:
        raise UserError(f"{st.display(rel)}: damaged commit record (not JSON: {str(e)[:120]}); {_RESTORE}") from None
    problem = _record_problem(rec)
    if not problem and "digest" in rec and rec["digest"] != record_digest(rec):
        problem = "its content does not match its digest"
    if problem:
        raise UserError(f"{st.display(rel)}: damaged commit record ({problem}); {_RESTORE}")
    return rec


def check_contiguous(st: Storage, seqs: list[int]) -> None:
    """Generations are 1, 2, …, n: a gap is a lost record."""
    if seqs and seqs != list(range(1, seqs[-1] + 1)):
        have = set(seqs)
        missing = [s for s in range(1, seqs[-1] + 1) if s not in have]
        raise UserError(f"{st.display(LOG_DIR)}: commit record(s) {', '.join(map(str, missing[:3]))}"
                        f"{' …' if len(missing) > 3 else ''} missing before the latest ({seqs[-1]}): a lost "
                        f"record; {_RESTORE}")


def views_generation(st: Storage) -> int | None:
    """The generation views.sql's first line names (None: no views.sql or no tag)."""
    try:
        head = st.read_bytes(VIEWS_FILE, 64).decode("utf-8", "replace")
    except (OSError, ValueError):
        return None
    m = re.match(r"-- generation (\d+)", head)
    return int(m.group(1)) if m else None


def companions_ahead(st: Storage, latest: int, full: bool = False) -> tuple[str, int] | None:
    """(companion, generation) of a companion written from a generation newer than `latest`, or None.
    Companions are written only after their record, so once the log is re-listed this means a lost
    record.  Cheap: runs.parquet's footer and views.sql's first line; full: manifest.json too."""
    found = {}
    try:
        meta = st.read_schema(RUNS_FILE).metadata or {}
        found[RUNS_FILE] = int(meta.get(b"generation", b"-1"))
    except (OSError, ValueError, pa.ArrowException):
        pass
    found[VIEWS_FILE] = views_generation(st)
    if full:
        try:
            found[MANIFEST] = int(json.loads(st.read_bytes(MANIFEST)).get("generation", -1))
        except (OSError, ValueError, TypeError, AttributeError):
            pass
    ahead = {k: g for k, g in found.items() if g is not None and g > latest}
    return max(ahead.items(), key=lambda kv: kv[1]) if ahead else None


def latest_seqs(st: Storage, full: bool = False) -> list[int]:
    """The log's record numbers, checked: contiguous from 1, and no companion ahead of the latest
    (re-listed once in case a writer committed between the listing and the companions' read)."""
    for attempt in range(3):
        seqs = _seqs(st)
        check_contiguous(st, seqs)
        latest = seqs[-1] if seqs else 0
        ahead = companions_ahead(st, latest, full)
        if ahead is None:
            return seqs
        if attempt < 2 and (_seqs(st) or [0])[-1] >= ahead[1]:
            continue  # a writer committed meanwhile
        name, gen = ahead
        raise UserError(f"{st.display(LOG_DIR)}: the latest commit record is {latest} but {name} was written "
                        f"from generation {gen}: record(s) {latest + 1}…{gen} lost; {_RESTORE}")
    return _seqs(st)


def _empty() -> dict:
    return {"schema_version": schema.SCHEMA_VERSION, "entries": {}, "generation": 0}


def _check_version(manifest: dict, path: str) -> None:
    version = manifest.get("schema_version")
    if version != schema.SCHEMA_VERSION:
        raise UserError(
            f"{path}: warehouse schema version {version}, this tool writes version "
            f"{schema.SCHEMA_VERSION}; use another --warehouse"
        )


def read_state(root) -> tuple[int, dict]:
    """(sequence number, manifest) of the latest commit record: the newest snapshot at or before it,
    with the later records' changes applied."""
    st = open_storage(root)
    seqs = latest_seqs(st)
    if not seqs:
        legacy = st.display(MANIFEST)
        if st.exists(MANIFEST):  # a warehouse of an earlier version: no commit log, only manifest.json
            try:
                manifest = json.loads(st.read_bytes(MANIFEST))
            except (OSError, ValueError) as e:
                raise UserError(f"{legacy}: unreadable manifest ({e})") from None
            _check_version(manifest, legacy)
            if isinstance(manifest, dict) and manifest.get("generation"):
                raise UserError(f"{st.display(LOG_DIR)}: commit log missing or empty but {MANIFEST} was written from "
                                f"generation {manifest['generation']}: the log was lost; {_RESTORE}")
            raise UserError(f"{legacy}: warehouse without a commit log (written by an earlier version); "
                            "use another --warehouse")
        return 0, _empty()
    deltas = []
    for seq in reversed(seqs):
        rec = _read_record(st, seq)
        if "manifest" in rec:
            manifest = rec["manifest"]
            break
        deltas.append(rec)
    else:
        raise UserError(f"{st.display(LOG_DIR)}: no snapshot record at or before {seqs[-1]} (damaged commit log)")
    _check_version(manifest, st.display(f"{LOG_DIR}/{_record_name(seqs[-1])}"))
    for rec in reversed(deltas):
        _apply(manifest, rec["put"], rec["remove"])
    manifest["generation"] = seqs[-1]
    return seqs[-1], manifest


def _apply(manifest: dict, put: list[dict], remove: list[str]) -> None:
    for key in remove:
        manifest["entries"].pop(key, None)
    for e in put:
        manifest["entries"][e["key"]] = e


def read_manifest(root) -> dict:
    """The current state: the manifest of the latest commit record."""
    return read_state(root)[1]


def changes_since(root, seq: int) -> tuple[int, list[dict]]:
    """(latest seq, the records after `seq`): what other writers committed since a base was read."""
    st = open_storage(root)
    seqs = [s for s in _seqs(st) if s > seq]
    return (seqs[-1] if seqs else seq), [_read_record(st, s) for s in seqs]


def check_compatible(manifest: dict, model: str, hidden_size: int) -> None:
    for e in manifest["entries"].values():
        if e["model"] == model and e.get("hidden_size") not in (None, hidden_size):
            raise UserError(
                f"warehouse already holds model {model!r} with hidden size {e['hidden_size']}, "
                f"this one has {hidden_size}; give it another name or use another --warehouse"
            )


VERIFIED_DIR = "verified"  # under cache_dir(): one append-only JSON-lines file per local warehouse


def cache_dir() -> Path:
    """The user's cache directory of this tool (the report's Vega bundle is kept there too)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "isotropy-warehouse"


def file_key(path: str, want: dict) -> list | None:
    """What identifies one version of a local file (absolute path → [size, mtime_ns, ctime_ns, inode,
    recorded blake2b]); None when it cannot be stat'ed (verify() then names it as missing).  Writing
    the file's bytes changes its mtime and ctime; ctime cannot be set back by hand (`touch -d`)."""
    try:
        s = os.stat(path)
    except OSError:
        return None
    return [s.st_size, s.st_mtime_ns, s.st_ctime_ns, s.st_ino, want[HASH]]


def verified_cache_file(st: Storage) -> Path:
    """The verified-files cache of the local warehouse `st`: cache_dir()/verified/<hash of its
    absolute path>.jsonl, each line [absolute path, file_key] — later lines win.  Appended to by each
    commit (O(its files), whatever the warehouse's history or the user's other warehouses hold) and
    by connect(), which rewrites it when it holds more than twice the lines it needs."""
    import hashlib

    where = os.path.abspath(st.path("")).encode()
    return cache_dir() / VERIFIED_DIR / (hashlib.blake2b(where, digest_size=10).hexdigest() + ".jsonl")


def read_verified_cache(st: Storage) -> tuple[dict, int]:
    """(absolute path → file_key, lines read) of `st`'s verified-files cache; a line that does not
    parse (a writer killed mid-line) is skipped: a file it named is hashed again, never trusted."""
    out, lines = {}, 0
    try:
        data = verified_cache_file(st).read_bytes()
    except OSError:
        return out, 0
    for line in data.splitlines():
        lines += 1
        try:
            path, key = json.loads(line)
        except (ValueError, TypeError):
            continue
        if isinstance(path, str) and isinstance(key, list):
            out[path] = key
    return out, lines


def append_verified(st: Storage, items: dict) -> None:
    """Append verified files (absolute path → file_key) to `st`'s cache.  Best effort: a cache that
    cannot be written only means hashing them again later."""
    if not items:
        return
    path = verified_cache_file(st)
    text = "".join(json.dumps([p, k]) + "\n" for p, k in items.items()).encode()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":  # a torn last line: ours starts a new one
                text = b"\n" + text
            os.write(fd, text)  # one O_APPEND write: lines of racing writers do not interleave
        finally:
            os.close(fd)
    except OSError:
        pass


def rewrite_verified(st: Storage, items: dict) -> None:
    """Replace `st`'s cache by exactly `items` (connect(): the files listed now)."""
    path = verified_cache_file(st)
    try:
        atomic_write_bytes(path.parent, path.name,
                           "".join(json.dumps([p, k]) + "\n" for p, k in items.items()).encode())
    except (OSError, UserError):
        pass


_VERIFIED: dict[str, list] = {}  # absolute path → file_key of a local file this process verified


def known_good(st: Storage, rel: str, want: dict | None, cache: dict) -> bool:
    """Whether local file `rel` is known to hold the bytes `want` (its record's checksum) without
    reading it: this process wrote it or verified it, or the verified-files `cache` (as connect()
    keeps it) has it, and it is the same file version since (size, mtime, ctime, inode).  A fold
    then reads each partial for its folds only, not once more per group to hash it."""
    if not want or not st.local:
        return False
    path = os.path.abspath(st.path(rel))
    key = file_key(path, want)
    if key is None:
        return False
    return (_VERIFIED.get(path) == key or cache.get(path) == key
            or (_WRITTEN.get(st.path(rel)) == want and _WRITTEN_KEY.get(st.path(rel)) == key))


def note_verified(st: Storage, rel: str, want: dict | None) -> None:
    """Remember, in this process, that `rel` was just verified against `want`."""
    if want and st.local:
        path = os.path.abspath(st.path(rel))
        key = file_key(path, want)
        if key is not None:
            _VERIFIED[path] = key


def remember_written(st: Storage, entries: list[dict]) -> None:
    """After a commit: this process's own files (hashed while written, unchanged since: the same
    size, times and inode as right after their rename) go into the verified-files cache, so the
    first query after a large extract does not read them again.  Best effort: a cache that cannot
    be written only means that query hashes them."""
    if not st.local:
        return
    new = {}
    for e in entries:
        for rel in e["files"].values():
            path = os.path.abspath(st.path(rel))
            want, at_write = _WRITTEN.get(st.path(rel)), _WRITTEN_KEY.get(st.path(rel))
            if want and at_write and file_key(path, want) == at_write:
                new[path] = at_write
    append_verified(st, new)


def publish(root, base_seq: int, manifest: dict, entries: list[dict], remove: list[str] = ()
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
    record = {"seq": seq, "nonce": secrets.token_hex(8), "time": _dt.datetime.now(_dt.timezone.utc).isoformat(), "writer": _WRITER,
              "put": list(entries), "remove": list(remove)}
    if seq == 1 or seq % SNAPSHOT_EVERY == 0:
        record["manifest"] = {**new, "generation": seq}
    record["digest"] = record_digest(record)  # a changed byte that still parses is a damaged record too
    faults.hit("manifest")
    if companions_ahead(st, base_seq) is not None:  # never create a record over a lost one
        if st.exists(f"{LOG_DIR}/{_record_name(seq)}"):
            return None  # only another writer's commit: re-read and try again
        latest_seqs(st)  # raises the lost-record line
    if not st.create_if_absent(f"{LOG_DIR}/{_record_name(seq)}", record_bytes(record)):
        return None
    new["generation"] = seq
    manifest.clear()
    manifest.update(new)
    faults.hit("views")
    write_companions(st, manifest)
    stale = sorted(old_files - live)
    release_leases(st, {run_of(f) for e in entries for f in e["files"].values()})  # the record lists them now
    remember_written(st, entries)  # the first query after this commit need not hash what was just written
    faults.hit("gc")
    for rel in stale:
        st.delete(rel)
    return stale


def with_checksums(st: Storage, entry: dict) -> dict:
    """`entry` with checksums[rel] = {"size", "blake2b"} for each of its files: as this process wrote
    it (hashed on the way out), as an earlier record had it (a file kept by compact), or else hashed
    by reading it once (a file another process wrote)."""
    old = entry.get("checksums") or {}
    sums = {}
    for rel in entry["files"].values():
        sums[rel] = _WRITTEN.get(st.path(rel)) or old.get(rel) or checksum(st, rel)
    return {**entry, "checksums": sums}


def written_checksum(st: Storage, rel: str) -> dict | None:
    """The checksum of `rel` as this process wrote it (None: another process did, or none)."""
    return _WRITTEN.get(st.path(rel))


def run_of(rel: str) -> str | None:
    """The run id a table file (or its temporary) was written under, from its name."""
    m = _RUN_ID.search(rel.rsplit("/", 1)[-1])
    return m.group(0) if m else None


# ---------------------------------------------------------------- leases of writers in flight

_LEASES: dict[tuple[str, str], tuple[Storage, float]] = {}  # (warehouse, run_id) → (storage, started)
_LEASE_LOCK = threading.Lock()
_HEARTBEAT: list[threading.Thread] = []


def lease_rel(run_id: str) -> str:
    return f"{INFLIGHT_DIR}/{run_id}.json"


def _lease_bytes(run_id: str, started: float) -> bytes:
    return json.dumps({"run_id": run_id, "host": _HOST, "pid": os.getpid(), "started": started,
                       "heartbeat": time.time()}).encode()


def hold_lease(st: Storage, run_id: str) -> None:
    """Create (once per process and run id) the lease that keeps validate --fix off this run's files."""
    key = (st.path(""), run_id)
    with _LEASE_LOCK:
        if key in _LEASES:
            return
        faults.hit("lease")
        started = time.time()
        st.replace(lease_rel(run_id), _lease_bytes(run_id, started))
        _LEASES[key] = (st, started)
        if not _HEARTBEAT or not _HEARTBEAT[0].is_alive():
            _HEARTBEAT[:] = [threading.Thread(target=_heartbeat, name="iso-lease-heartbeat", daemon=True)]
            _HEARTBEAT[0].start()


def release_leases(st: Storage, run_ids) -> None:
    """Remove the leases this process holds for `run_ids` (their files are committed or discarded)."""
    for run_id in run_ids:
        with _LEASE_LOCK:
            held = _LEASES.pop((st.path(""), run_id), None)
        if held is not None:
            faults.hit("release")
            try:
                held[0].delete(lease_rel(run_id))
            except Exception:  # left behind: stale once this process is gone
                pass


def _heartbeat() -> None:
    while True:
        time.sleep(HEARTBEAT_S)
        with _LEASE_LOCK:
            held = list(_LEASES.items())
        for (_, run_id), (st, started) in held:
            try:
                with _LEASE_LOCK:
                    if (st.path(""), run_id) in _LEASES:
                        st.replace(lease_rel(run_id), _lease_bytes(run_id, started))
            except Exception:
                pass


_OWNER = os.getpid()


@atexit.register
def _release_all() -> None:
    if os.getpid() != _OWNER:  # a forked child does not own its parent's leases
        return
    for (url, run_id), (st, _) in list(_LEASES.items()):
        release_leases(st, [run_id])


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed child not yet reaped is a zombie: dead
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True


def lease_alive(info: dict, grace_s: float, now: float | None = None) -> bool:
    """A lease protects its run's files while its writer may still commit them: on this host, while
    its pid is alive; from another host, while its heartbeat is younger than the grace period (at
    least 3 heartbeats)."""
    try:
        if info.get("host") == _HOST:
            return _pid_alive(int(info["pid"]))
        age = (now if now is not None else time.time()) - float(info["heartbeat"])
        return age < max(grace_s, 3 * HEARTBEAT_S)
    except (KeyError, TypeError, ValueError):
        return False


def read_leases(st: Storage) -> dict[str, dict | None]:
    """run id → lease contents (None: unreadable, e.g. being replaced) of every lease file."""
    out = {}
    for rel in st.list_files(INFLIGHT_DIR):
        name = rel.rsplit("/", 1)[-1]
        if not name.endswith(".json") or name.startswith("."):
            continue
        try:
            out[name[:-5]] = json.loads(st.read_bytes(rel))
        except FileNotFoundError:
            continue  # released meanwhile
        except (OSError, ValueError):
            out[name[:-5]] = None
    return out


def companion_generations(root) -> tuple[int | None, int | None]:
    """The generations manifest.json and runs.parquet were written from (None: missing/unreadable)."""
    st = open_storage(root)
    out = []
    try:
        out.append(json.loads(st.read_bytes(MANIFEST)).get("generation"))
    except (OSError, ValueError):
        out.append(None)
    try:
        meta = st.read_schema(RUNS_FILE).metadata or {}
        out.append(int(meta.get(b"generation", b"-1")))
    except (OSError, ValueError, pa.ArrowException):
        out.append(None)
    return out[0], out[1]


def write_companions(root, manifest: dict) -> None:
    """manifest.json (the current state, for people and scripts; the log is authoritative) and
    runs.parquet; a reader that finds them behind the log rewrites them."""
    atomic_write_bytes(root, MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    write_runs_table(root, manifest)


def generation_tag(manifest: dict) -> str:
    """The line views.sql carries to say which manifest it was written from."""
    return f"-- generation {manifest.get('generation', 0)}\n"


def write_runs_table(root, manifest: dict) -> None:
    sink = pa.BufferOutputStream()
    pq.write_table(runs_table(manifest), sink, compression="zstd")
    atomic_write_bytes(root, RUNS_FILE, sink.getvalue().to_pybytes())


def partial_id(entry: dict) -> str:
    """How a merged entry's `inputs` name a partial: its run and key (a re-run is another partial)."""
    return entry["run_id"] + ":" + entry["key"]


def runs_table(manifest: dict) -> pa.Table:
    """One row per manifest entry (the `runs` view), tagged with the manifest's generation."""
    rows = []
    inputs = {k: set(e.get("inputs") or ()) for k, e in manifest["entries"].items() if e["kind"] == "merged"}

    def folded(e: dict) -> bool | None:  # (groups.py: a partial is pending until both its groups hold it)
        if e["kind"] != "data":
            return None
        pid = partial_id(e)
        return all(pid in inputs.get(entry_key("merged", e["model"], e["checkpoint"], g), ()) for g in (e["source"], "all"))

    for e in manifest["entries"].values():
        stats, prov = e.get("stats", {}), e.get("provenance", {})
        rows.append(
            {
                "kind": e["kind"], "model": e["model"], "checkpoint": e["checkpoint"],
                "step": e.get("step"), "source": e.get("source"), "shard": e.get("shard"),
                "run_id": e["run_id"], "finished_at": e["finished_at"],
                "hidden_size": e.get("hidden_size"), "tokens": stats.get("tokens"),
                "documents": stats.get("documents"), "skipped": stats.get("skipped"),
                "nonfinite": stats.get("nonfinite"), "git_hash": prov.get("git_hash"),
                "model_revision": prov.get("model_revision"),
                "source_fingerprint": prov.get("source_fingerprint"),
                "settings": json.dumps(e.get("settings", {}), sort_keys=True),
                "provenance": json.dumps(prov, sort_keys=True),
                "stats": json.dumps(stats, sort_keys=True), "folded": folded(e),
            }
        )
    return pa.Table.from_pylist(rows, schema=schema.RUNS.with_metadata(
        {"generation": str(manifest.get("generation", 0))}))
