"""Which stored files are known to hold the bytes their commit record says, without reading them
again: files this process wrote (hashed on the way out) or verified, and the verified-files cache
that connect() and every commit keep per local warehouse (a file version is identified by its
size, times and inode).  Also the checksums `publish` records for each entry's files.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from common.append import append_lines
from common.errors import UserError

from ..storage import HASH, Storage, checksum, open_storage
from .entries import Checksum, Entry

VERIFIED_DIR = "verified"  # under cache_dir(): one append-only JSON-lines file per local warehouse
_WRITTEN: dict[str, dict] = {}  # storage path of a file this process wrote → its checksum
_WRITTEN_KEY: dict[str, list] = {}  # … → its file_key right after the rename (local files)
_VERIFIED: dict[str, list] = {}  # absolute path → file_key of a local file this process verified


def note_written(st: Storage, rel: str, written: Checksum) -> None:
    """Remember the checksum of a file this process just wrote (and, on a local disk, the version it
    has right after its rename): a commit records it, a fold and a query need not hash it again."""
    _WRITTEN[st.path(rel)] = written
    if st.local:
        key = file_key(os.path.abspath(st.path(rel)), written)
        if key is not None:
            _WRITTEN_KEY[st.path(rel)] = key


def written_checksum(st: Storage, rel: str) -> Checksum | None:
    """The checksum of `rel` as this process wrote it (None: another process did, or none)."""
    return _WRITTEN.get(st.path(rel))


def with_checksums(st: Storage, entry: Entry) -> Entry:
    """`entry` with checksums[rel] = {"size", "blake2b"} for each of its files: as this process wrote
    it (hashed on the way out), as an earlier record had it (a file kept by compact), or else hashed
    by reading it once (a file another process wrote)."""
    old = entry.get("checksums") or {}
    sums = {}
    for rel in entry["files"].values():
        sums[rel] = _WRITTEN.get(st.path(rel)) or old.get(rel) or checksum(st, rel)
    return {**entry, "checksums": sums}


# ---------------------------------------------------------------- the verified-files cache


def cache_dir() -> Path:
    """The user's cache directory of this tool (the report's Vega bundle is kept there too)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "isotropy-warehouse"


def file_key(path: str, want: Checksum) -> list | None:
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
        append_lines(path, text)
    except OSError:
        pass


def rewrite_verified(st: Storage, items: dict) -> None:
    """Replace `st`'s cache by exactly `items` (connect(): the files listed now)."""
    path = verified_cache_file(st)
    try:
        open_storage(path.parent).replace(
            path.name, "".join(json.dumps([p, k]) + "\n" for p, k in items.items()).encode())
    except (OSError, UserError):
        pass


def known_good(st: Storage, rel: str, want: Checksum | None, cache: dict) -> bool:
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


def note_verified(st: Storage, rel: str, want: Checksum | None) -> None:
    """Remember, in this process, that `rel` was just verified against `want`."""
    if want and st.local:
        path = os.path.abspath(st.path(rel))
        key = file_key(path, want)
        if key is not None:
            _VERIFIED[path] = key


def remember_written(st: Storage, entries: list[Entry]) -> None:
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
