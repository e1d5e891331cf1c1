"""A cache of the partition-function table (the costly parameter table: 3·V·d² float64
multiply-adds per matrix) per checkpoint, across warehouses and runs: a second extract of the same
weights into another warehouse reads it instead of recomputing it.

Keyed on what the table's numbers depend on: the checkpoint's `model_identity` (its weights'
content, or a hub commit), the parameter tables' code and torch (`PARAMS_CODE`), the layout and
the device type the table is computed on (float64 sums in another order round differently).  No
identity, no caching.  One Arrow IPC file per key, named with the blake2b of its bytes, written to a
temporary name and renamed into place; a file whose bytes do not match its name is ignored and
removed.  Where: $ISO_PARAMS_CACHE (`off` disables it), else $XDG_CACHE_HOME or ~/.cache, under
isotropy-warehouse/params."""

from __future__ import annotations

import contextlib
import hashlib
import os
import uuid
from pathlib import Path

import pyarrow as pa

ENV = "ISO_PARAMS_CACHE"


def cache_dir() -> Path | None:
    """Where cached tables live, or None when $ISO_PARAMS_CACHE is `off`."""
    value = os.environ.get(ENV, "").strip()
    if value.lower() == "off":
        return None
    if value:
        return Path(value)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "isotropy-warehouse" / "params"


def cache_key(identity: str | None, params_code: str, layout: str, device: str) -> str | None:
    """The key of one checkpoint's table, or None (nothing to key on: not cached)."""
    if not identity:
        return None
    h = hashlib.blake2b(digest_size=16)
    for part in (identity, params_code, layout, device):
        h.update(str(part).encode() + b"\0")
    return h.hexdigest()


def read(key: str | None) -> dict[str, list] | None:
    """The cached table's columns, or None (no cache, no entry, or a damaged file, then removed)."""
    where = cache_dir()
    if key is None or where is None or not where.is_dir():
        return None
    for f in sorted(where.glob(f"{key}-*.arrow")):
        data = f.read_bytes()
        if hashlib.blake2b(data, digest_size=16).hexdigest() != f.stem.split("-", 1)[1]:
            with contextlib.suppress(OSError):
                f.unlink()
            continue
        with pa.ipc.open_file(pa.BufferReader(data)) as r:
            return r.read_all().to_pydict()
    return None


def write(key: str | None, rows: dict[str, list]) -> None:
    """Keep one checkpoint's table (best effort: a cache that cannot be written is skipped)."""
    where = cache_dir()
    if key is None or where is None or not rows:
        return
    sink = pa.BufferOutputStream()
    table = pa.table(rows)
    with pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    data = sink.getvalue().to_pybytes()
    final = where / f"{key}-{hashlib.blake2b(data, digest_size=16).hexdigest()}.arrow"
    tmp = where / f".{uuid.uuid4().hex}.tmp"
    try:
        where.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(data)
        os.replace(tmp, final)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
