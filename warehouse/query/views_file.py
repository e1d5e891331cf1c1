"""views.sql, the DuckDB shell's init file (`duckdb -init WAREHOUSE/views.sql`), and keeping every
companion (manifest.json, runs.parquet, views.sql) current with the commit log: each names the
generation it was written from, and views.sql also a digest of the queries/*.sql it was made of.
"""

from __future__ import annotations

import hashlib
import shlex

from common.errors import UserError

from .. import store
from ..storage import open_storage, reading_once
from ..store import Manifest
from .views import QUERIES_DIR, all_view_sql


def companions_current(root, manifest: Manifest) -> bool:
    """views.sql, runs.parquet and manifest.json all written from the latest record (two writers'
    companion writes may land in either order: the older one is then rewritten here)."""
    if not manifest["entries"]:
        return True
    st = open_storage(root)
    gen = manifest.get("generation", 0)
    tag = views_tag(manifest).encode()  # views.sql's first line: read only that much
    try:
        if st.read_bytes(store.VIEWS_FILE, len(tag)) != tag:
            return False
    except FileNotFoundError:
        return False
    return store.companion_generations(st) == (gen, gen)


@reading_once
def refresh_companions(root, strict: bool = True) -> Manifest:
    """Rewrite manifest.json, runs.parquet and views.sql if they are behind the commit log (a process
    died between the record and them, or two writers' companions landed out of order); returns the
    current manifest.  strict=False (queries): a warehouse the user may only read (read-only keys, a
    read-only mount) is queried without rewriting them — they are caches, the log is the state."""
    root = open_storage(root)
    manifest = store.read_manifest(root)
    if not companions_current(root, manifest):  # no lock: each file is replaced atomically
        try:
            store.write_companions(root, manifest)
            write_views_file(root, manifest)
        except (OSError, UserError):
            if strict:
                raise
    return manifest


def views_tag(manifest: Manifest) -> str:
    """views.sql's first line: the manifest generation it was written from and a digest of the
    queries/*.sql it was made of, so that a changed view definition (a new version of this tool)
    rewrites it as a new commit does."""
    h = hashlib.blake2b(digest_size=8)
    for path in sorted(QUERIES_DIR.glob("*.sql")):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return store.generation_tag(manifest).rstrip("\n") + f" queries {h.hexdigest()}\n"


def write_views_file(root, manifest: Manifest | None = None) -> str:
    """The init file for the DuckDB shell: `duckdb -init WAREHOUSE/views.sql`.  For a warehouse on
    S3 it names s3:// URLs, which the shell reads with its httpfs extension (see docs/scale-out.md)."""
    st = open_storage(root)
    manifest = manifest if manifest is not None else store.read_manifest(st)
    how = ("duckdb -init " + shlex.quote(st.uri(store.VIEWS_FILE)) if st.local else
           "duckdb (with httpfs and an S3 secret; see docs/scale-out.md), then .read " + st.uri(store.VIEWS_FILE) +
           " -- or `python cli.py pull` for a local copy")
    text = (
        views_tag(manifest)
        + "-- Views over this warehouse, regenerated at every commit (python cli.py views rewrites it).\n"
        "-- Open with:  " + how + "\n"
        + "\n".join(all_view_sql(st, manifest)) + "\n"
    )
    store.atomic_write_bytes(st, store.VIEWS_FILE, text.encode())
    return st.display(store.VIEWS_FILE)
