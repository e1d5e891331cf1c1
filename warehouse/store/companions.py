"""The companions: manifest.json (the current state, for people and scripts), runs.parquet (the
`runs` view: one row per entry) and views.sql (written by warehouse.query).  They carry no
checksum: derived from the commit log, written only after their record, and rewritten whenever
they are behind it; each names the generation it was written from, so a companion ahead of the
latest record reveals a lost record.
"""

from __future__ import annotations

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq

from .. import schema
from ..storage import Storage, open_storage
from .entries import Entry, Manifest, entry_key, partial_id
from .paths import MANIFEST, RUNS_FILE, VIEWS_FILE
from .tables import atomic_write_bytes


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


def write_companions(root, manifest: Manifest) -> None:
    """manifest.json (the current state, for people and scripts; the log is authoritative) and
    runs.parquet; a reader that finds them behind the log rewrites them."""
    atomic_write_bytes(root, MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    write_runs_table(root, manifest)


def generation_tag(manifest: Manifest) -> str:
    """The line views.sql carries to say which manifest it was written from."""
    return f"-- generation {manifest.get('generation', 0)}\n"


def write_runs_table(root, manifest: Manifest) -> None:
    sink = pa.BufferOutputStream()
    pq.write_table(runs_table(manifest), sink, compression="zstd")
    atomic_write_bytes(root, RUNS_FILE, sink.getvalue().to_pybytes())


def runs_table(manifest: Manifest) -> pa.Table:
    """One row per manifest entry (the `runs` view), tagged with the manifest's generation."""
    rows = []
    inputs = {k: set(e.get("inputs") or ()) for k, e in manifest["entries"].items() if e["kind"] == "merged"}

    def folded(e: Entry) -> bool | None:  # (as warehouse.merge: pending until both its groups hold it)
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
