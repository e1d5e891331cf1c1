"""`cli.py validate`: check a warehouse's files against the schema and the manifest, and its merged
tables against a fresh merge of their partials."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from . import merge, query, schema, store
from .storage import Storage, open_storage


def _same_type(got: pa.DataType, want: pa.DataType, table: str, column: str) -> bool:
    if table in ("token_sums",) and column == "vec":  # --vector-dtype: float16/32/64 lists
        return pa.types.is_list(got) and pa.types.is_floating(got.value_type)
    return got == want


def check_file(st: Storage, rel: str, table: str, entry: dict) -> list[str]:
    if not st.exists(rel):
        return [f"{rel}: listed in the manifest but missing"]
    try:
        pf = st.parquet_file(rel)
        got = pf.schema_arrow
    except Exception as e:  # pyarrow raises several types for a damaged file
        return [f"{rel}: not a readable Parquet file ({str(e)[:200]})"]
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
        t = pf.read(columns=keys)
        for k in keys:
            values = set(pc.unique(t.column(k)).to_pylist())
            if values - {entry[k]}:
                problems.append(f"{rel}: column {k} holds {sorted(values)}, the manifest says {entry[k]!r}")
    except Exception as e:
        problems.append(f"{rel}: unreadable data ({str(e)[:200]})")
    return problems


def validate(root, fix: bool = False) -> list[str]:
    """Problems found (after fixing what `fix` can: orphans, temp files, stale companions)."""
    root = open_storage(root, must_exist=True)
    manifest = store.read_manifest(root)
    problems = []
    listed = set()
    for entry in manifest["entries"].values():
        for table, rel in entry["files"].items():
            listed.add(rel)
            problems += check_file(root, rel, table, entry)
    orphans = [rel for rel in root.list_files("tables") if rel not in listed]
    orphans += [rel for rel in root.list_files(store.LOG_DIR) if rel.rsplit("/", 1)[-1].startswith(".")]
    for rel in orphans:
        if fix:
            root.delete(rel)
        else:
            problems.append(f"{rel}: not listed in the manifest (left by an interrupted run; --fix removes it)")
    if not problems:  # the merged tables are checked by re-merging readable partials
        bad = merge.check(root, manifest)
        if bad and fix:
            merge.rebuild(root, sorted({k for k, _ in bad}))
            manifest = store.read_manifest(root)
            bad = merge.check(root, manifest)
        problems += [msg for _, msg in bad]
    query.refresh_companions(root)  # runs.parquet and views.sql are caches of the manifest, as in connect()
    return problems
