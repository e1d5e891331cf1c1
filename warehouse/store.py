"""Atomic writes and the manifest.

A run writes its Parquet files under `tables/<table>/<partition dirs>/<run_id>.parquet`
(each file written to a temporary name, fsynced, then renamed).  Files become visible to
queries only when the manifest lists them: `commit_locked()` replaces `manifest.json`
atomically (write + fsync + rename under an exclusive lock), so a killed run leaves nothing
that a view can see, and a re-run of the same key replaces the earlier entry instead of adding
to it.  Files that no entry lists any more are deleted after the commit (and by `validate --fix`).

This is the bottom of the warehouse: it knows files and the manifest, not what the tables mean
(merge.py folds partials, query.py makes views; neither is imported here).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import json
import os
import secrets
from pathlib import Path
from urllib.parse import quote

import pyarrow as pa
import pyarrow.parquet as pq

from common import faults
from common.errors import UserError

from . import schema

MANIFEST = "manifest.json"
RUNS_FILE = "runs.parquet"
VIEWS_FILE = "views.sql"
LOCK = "manifest.lock"


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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


class TableWriter:
    """Streams record batches of one table into one Parquet file, renamed into place on close."""

    def __init__(self, root: Path, table: str, values: dict[str, str], run_id: str,
                 arrow_schema: pa.Schema | None = None):
        self.rel = f"{partition_dir(table, values)}/{run_id}.parquet"
        self.path = root / self.rel
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = self.path.with_name(f".{self.path.name}.tmp")
        self.schema = arrow_schema or schema.TABLES[table]
        self._writer = pq.ParquetWriter(self.tmp, self.schema, **schema.write_options(table, self.schema))

    def write(self, columns: dict) -> None:
        self._writer.write_table(pa.table(columns, schema=self.schema))
        faults.hit("write")

    def close(self) -> str:
        self._writer.close()
        faults.hit("close")
        with open(self.tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(self.tmp, self.path)
        _fsync_dir(self.path.parent)
        return self.rel

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self._writer.close()
        for p in (self.tmp, self.path):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()


@contextlib.contextmanager
def locked(root: Path):
    """Exclusive lock on the warehouse's manifest (processes and machines sharing a POSIX fs)."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / LOCK, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def read_manifest(root: Path) -> dict:
    path = Path(root) / MANIFEST
    if not path.exists():
        return {"schema_version": schema.SCHEMA_VERSION, "entries": {}}
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: unreadable manifest ({e})") from None
    version = manifest.get("schema_version")
    if version != schema.SCHEMA_VERSION:
        raise UserError(
            f"{path}: warehouse schema version {version}, this tool writes version "
            f"{schema.SCHEMA_VERSION}; use another --warehouse"
        )
    return manifest


def check_compatible(manifest: dict, model: str, hidden_size: int) -> None:
    for e in manifest["entries"].values():
        if e["model"] == model and e.get("hidden_size") not in (None, hidden_size):
            raise UserError(
                f"warehouse already holds model {model!r} with hidden size {e['hidden_size']}, "
                f"this one has {hidden_size}; give it another name or use another --warehouse"
            )


def commit_locked(root: Path, manifest: dict, entries: list[dict], remove: list[str] = ()) -> list[str]:
    """Add or replace `entries` (and drop the keys in `remove`) in one atomic manifest write, then
    delete the files no entry lists any more; returns them.  The caller holds `locked(root)` and read
    `manifest` under it (warehouse/merge.py's `commit` is the one caller that adds data)."""
    old_files = {f for e in manifest["entries"].values() for f in e["files"].values()}
    for e in entries:
        manifest["entries"][e["key"]] = e
    for key in remove:
        manifest["entries"].pop(key, None)
    live = {f for e in manifest["entries"].values() for f in e["files"].values()}
    manifest["generation"] = manifest.get("generation", 0) + 1
    faults.hit("manifest")
    atomic_write_bytes(root / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    faults.hit("views")
    write_runs_table(root, manifest)
    stale = sorted(old_files - live)
    faults.hit("gc")
    for rel in stale:
        with contextlib.suppress(FileNotFoundError):
            (root / rel).unlink()
    return stale


def generation_tag(manifest: dict) -> str:
    """The line views.sql carries to say which manifest it was written from."""
    return f"-- generation {manifest.get('generation', 0)}\n"


def write_runs_table(root: Path, manifest: dict) -> None:
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
    table = pa.Table.from_pylist(rows, schema=schema.RUNS)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    atomic_write_bytes(root / RUNS_FILE, sink.getvalue().to_pybytes())
