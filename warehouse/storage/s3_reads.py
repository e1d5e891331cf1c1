"""Each committed object on S3 read at most once per command: a byte-bounded cache of whole objects.

A command reads the same committed files again and again — validate hashes a file, opens its footer
and reads its partition columns; a fold reads every partial layer by layer; a query's views scan the
same merged tables once per view.  On S3 each of those is a HEAD and one or more GETs.  Committed
objects never change: data files are named by their run and written once, commit records are
created only if absent.  So within a *read scope* (`reads_once()`, opened by each command's entry
point) an S3Storage fetches such an object whole, once (a HEAD and a GET), and serves every later
read of it from memory.  (A query's DuckDB scans read through pyarrow's own S3 filesystem.)

What is never cached: the companions and leases (rewritten in place), anything outside `tables/`
and `_log/`, the absence of an object, and objects larger than what is left of the budget
(ISO_S3_READ_CACHE_MB, default 256; 0 turns caching off) — those are read as before, by ranged
GETs.  Checks are unchanged: a verification hashes the very bytes the command then uses.  A delete,
move or write of a path by this process drops it from the cache; the scope ends with the outermost
`reads_once()`, so the next command sees the store as it is then.
"""

from __future__ import annotations

import contextlib
import os
import threading

import pyarrow as pa
import pyarrow.fs as pafs

from common.errors import UserError

IMMUTABLE = ("tables/", "_log/")  # what a commit writes once and never rewrites (relative to the root)
DEFAULT_MB = 256

_LOCK = threading.Lock()
_SCOPE = {"depth": 0, "id": 0}  # how deep in nested scopes; which outermost scope (a new id each)
_OPEN_CACHES: list["ObjectCache"] = []  # the caches that hold something in the current scope


def budget_bytes(env=None) -> int:
    """The cache budget of one scope or connection (ISO_S3_READ_CACHE_MB, in MiB; 0: off)."""
    env = os.environ if env is None else env
    text = (env.get("ISO_S3_READ_CACHE_MB") or str(DEFAULT_MB)).strip()
    try:
        mb = float(text)
    except ValueError:
        mb = -1.0
    if not mb >= 0 or mb == float("inf"):
        raise UserError(f"ISO_S3_READ_CACHE_MB={text!r}: expected a number of MiB ≥ 0 (0 turns the cache off)")
    return int(mb * (1 << 20))


def scope_id() -> int | None:
    """The current read scope (None: outside every scope)."""
    with _LOCK:
        return _SCOPE["id"] if _SCOPE["depth"] else None


@contextlib.contextmanager
def reads_once():
    """Within: each committed S3 object read whole at most once (nested scopes share the outermost)."""
    with _LOCK:
        if not _SCOPE["depth"]:
            _SCOPE["id"] += 1
        _SCOPE["depth"] += 1
    try:
        yield
    finally:
        with _LOCK:
            _SCOPE["depth"] -= 1
            caches = [] if _SCOPE["depth"] else list(_OPEN_CACHES)
            if not _SCOPE["depth"]:
                _OPEN_CACHES.clear()
        for cache in caches:
            cache.clear()


def reading_once(func):
    """`func` run inside `reads_once()` (for a command's entry point)."""
    import functools

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        with reads_once():
            return func(*args, **kwargs)

    return wrapper


def immutable(rel: str) -> bool:
    """Whether `rel` (relative to a warehouse root) is a committed-once object: a data file or a record."""
    return rel.startswith(IMMUTABLE) and not rel.rsplit("/", 1)[-1].startswith(".")


class ObjectCache:
    """Whole objects by their path in `fs`, within a byte budget: an object is admitted if it fits in
    what is left, never evicted (a fold reads its files in turns: evicting would fetch them again
    and again); the sizes of those that did not fit are remembered."""

    def __init__(self, fs: pafs.FileSystem, budget: int, scoped: bool):
        """scoped: holds objects only within a read scope, and only for that scope; else for as
        long as it lives."""
        self.fs, self.budget, self.scoped = fs, budget, scoped
        self.used, self.scope = 0, None
        self.data: dict[str, pa.Buffer] = {}
        self.sizes: dict[str, int] = {}
        self.lock = threading.Lock()

    def _current(self) -> bool:
        """(under self.lock) Whether this cache may hold objects now; what an earlier scope left is dropped."""
        if not self.scoped:
            return True
        scope = scope_id()
        if scope != self.scope:
            self.data.clear()
            self.sizes.clear()
            self.used, self.scope = 0, scope
            if scope is not None:
                with _LOCK:
                    _OPEN_CACHES.append(self)
        return scope is not None

    def whole(self, path: str) -> pa.Buffer | None:
        """The object's bytes (one HEAD and one GET the first time), or None when it does not fit or
        no scope is open: read it the usual way.  FileNotFoundError when it is gone."""
        with self.lock:
            if not self.budget or not self._current():
                return None
            buf = self.data.get(path)
            if buf is not None or path in self.sizes:
                return buf
        with self.fs.open_input_file(path) as f:  # a HEAD (its size), then one GET of every byte
            size = f.size()
            with self.lock:
                if self.budget - self.used < size:
                    self.sizes[path] = size
                    return None
            buf = f.read_buffer(size) if size else pa.py_buffer(b"")
        with self.lock:
            if not self._current():  # the scope ended while it was read
                return buf
            if path not in self.data:  # (racing threads: the first one kept)
                self.data[path] = buf
                self.used += size
            return self.data[path]

    def size(self, path: str) -> int | None:
        """The size of an object read or sized in this scope (None: not yet)."""
        with self.lock:
            if not self._current():
                return None
            buf = self.data.get(path)
            return buf.size if buf is not None else self.sizes.get(path)

    def forget(self, path: str) -> None:
        with self.lock:
            buf = self.data.pop(path, None)
            if buf is not None:
                self.used -= buf.size
            self.sizes.pop(path, None)

    def clear(self) -> None:
        with self.lock:
            self.data.clear()
            self.sizes.clear()
            self.used, self.scope = 0, None
