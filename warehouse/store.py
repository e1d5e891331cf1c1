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
that never committed, by `validate --fix`.

Above storage.py (bytes and names), this knows files and the manifest, not what the tables mean
(merge.py folds partials, query.py makes views; neither is imported here).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import secrets
import socket
from urllib.parse import quote

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from isotropy_warehouse import faults
from isotropy_warehouse.errors import UserError

from . import schema
from .storage import Storage, open_storage

MANIFEST = "manifest.json"  # a copy of the current state (companion); the commit log is authoritative
LOG_DIR = "_log"
SNAPSHOT_EVERY = 32  # every 32nd record holds the whole manifest; the others only their changes
RUNS_FILE = "runs.parquet"
VIEWS_FILE = "views.sql"
_RECORD = re.compile(r"\d{20}\.json")
_WRITER = {"host": socket.gethostname(), "pid": os.getpid()}


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
        self._out = self.storage.output(self.rel)
        self._writer = pq.ParquetWriter(self._out.stream, self.schema, **schema.write_options(table, self.schema))

    def write(self, columns: dict) -> None:
        self._writer.write_table(pa.table(columns, schema=self.schema))
        faults.hit("write")

    def close(self) -> str:
        self._writer.close()
        faults.hit("close")
        self._out.commit()
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


def _read_record(st: Storage, seq: int) -> dict:
    rel = f"{LOG_DIR}/{_record_name(seq)}"
    try:
        return json.loads(st.read_bytes(rel))
    except (OSError, ValueError) as e:
        raise UserError(f"{st.display(rel)}: unreadable commit record ({e})") from None


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
    seqs = _seqs(st)
    if not seqs:
        legacy = st.display(MANIFEST)
        if st.exists(MANIFEST):  # a warehouse of an earlier version: no commit log, only manifest.json
            try:
                manifest = json.loads(st.read_bytes(MANIFEST))
            except (OSError, ValueError) as e:
                raise UserError(f"{legacy}: unreadable manifest ({e})") from None
            _check_version(manifest, legacy)
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


def publish(root, base_seq: int, manifest: dict, entries: list[dict], remove: list[str] = ()
            ) -> list[str] | None:
    """Commit `entries` (added or replacing entries of the same key) and drop `remove`, on top of
    `manifest`, the state of record `base_seq`: create record base_seq + 1 if absent (no lock).
    Returns the files no entry lists any more (deleted), or None if another writer took that
    record first — the caller re-reads the state and tries again."""
    st = open_storage(root)
    new = {**manifest, "entries": dict(manifest["entries"])}
    old_files = {f for e in manifest["entries"].values() for f in e["files"].values()}
    _apply(new, list(entries), list(remove))
    live = {f for e in new["entries"].values() for f in e["files"].values()}
    seq = base_seq + 1
    record = {"seq": seq, "nonce": secrets.token_hex(8), "time": _dt.datetime.now(_dt.timezone.utc).isoformat(), "writer": _WRITER,
              "put": list(entries), "remove": list(remove)}
    if seq == 1 or seq % SNAPSHOT_EVERY == 0:
        record["manifest"] = {**new, "generation": seq}
    faults.hit("manifest")
    if not st.create_if_absent(f"{LOG_DIR}/{_record_name(seq)}", json.dumps(record, sort_keys=True).encode()):
        return None
    new["generation"] = seq
    manifest.clear()
    manifest.update(new)
    faults.hit("views")
    write_companions(st, manifest)
    stale = sorted(old_files - live)
    faults.hit("gc")
    for rel in stale:
        st.delete(rel)
    return stale


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


def runs_table(manifest: dict) -> pa.Table:
    """One row per manifest entry (the `runs` view), tagged with the manifest's generation."""
    rows = []
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
                "stats": json.dumps(stats, sort_keys=True),
            }
        )
    return pa.Table.from_pylist(rows, schema=schema.RUNS.with_metadata(
        {"generation": str(manifest.get("generation", 0))}))
