"""The Storage interface: a warehouse root and the operations the commit protocol needs.

Every file the warehouse reads or writes goes through a `Storage`, by a path relative to the
warehouse root ("tables/token_sums/…/run.parquet", "_log/000…1.json").  Reading is the same for
both kinds (pyarrow.fs); local.py and s3.py make writing atomic each in their own way.
"""

from __future__ import annotations

import contextlib
import time

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from common.errors import UserError


class Storage:
    """A warehouse root.  `rel` arguments are '/'-separated paths below it."""

    url: str  # as the user gave it, for messages
    fs: pafs.FileSystem
    local: bool

    def __str__(self) -> str:
        return self.url

    def path(self, rel: str) -> str:
        """The path of `rel` in self.fs (for pyarrow's filesystem= arguments)."""
        raise NotImplementedError

    def uri(self, rel: str) -> str:
        """`rel` as DuckDB's read_parquet names it: an absolute local path or an s3:// URL."""
        raise NotImplementedError

    def display(self, rel: str) -> str:
        return self.uri(rel)

    # ---- reading (pyarrow.fs for both kinds: the local root is a LocalFileSystem path)
    @contextlib.contextmanager
    def input_stream(self, rel: str):
        """A sequential reader of `rel` (failures as one-line errors on S3)."""
        with self._errors(rel), self.fs.open_input_stream(self.path(rel)) as f:
            yield f

    def read_bytes(self, rel: str, limit: int = -1) -> bytes:
        """The bytes of `rel` (only the first `limit` if limit >= 0)."""
        with self.input_stream(rel) as f:
            return f.read() if limit < 0 else f.read(limit)

    def exists(self, rel: str) -> bool:
        with self._errors(rel):
            return self.fs.get_file_info(self.path(rel)).type == pafs.FileType.File

    def size(self, rel: str) -> int:
        with self._errors(rel):
            return self.fs.get_file_info(self.path(rel)).size

    def list_files(self, prefix: str) -> list[str]:
        """Every file below directory `prefix`, as rel paths (empty if there is none)."""
        return [rel for rel, _, _ in self.list_infos(prefix)]

    def list_infos(self, prefix: str) -> list[tuple[str, int, float]]:
        """(rel path, size, modification time in seconds since the epoch) of every file below `prefix`."""
        with self._errors(prefix):
            infos = self._below(self.path(prefix))
        strip = len(self.path("")) + (0 if self.path("").endswith("/") else 1)
        return sorted((i.path[strip:], i.size, i.mtime.timestamp() if i.mtime is not None else time.time())
                      for i in infos if i.type == pafs.FileType.File)

    def _below(self, base: str) -> list[pafs.FileInfo]:
        """Everything below directory `base` (a path in self.fs), [] if there is no such directory."""
        if self.fs.get_file_info(base).type == pafs.FileType.NotFound:
            return []
        return self.fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))

    def parquet_file(self, rel: str, **kwargs) -> pq.ParquetFile:
        with self._errors(rel):
            return pq.ParquetFile(self.fs.open_input_file(self.path(rel)), **kwargs)

    def read_table(self, rel: str, columns=None, filters=None) -> pa.Table:
        """`rel`'s rows (the `columns` asked for, all by default) that match every (column, "=", value)
        of `filters`; row groups whose statistics rule a value out are not read."""
        with self._errors(rel):
            return read_parquet(pq.ParquetFile(self.fs.open_input_file(self.path(rel))), columns, filters)

    def read_schema(self, rel: str) -> pa.Schema:
        with self._errors(rel):
            return pq.read_schema(self.path(rel), filesystem=self.fs)

    # ---- writing
    def replace(self, rel: str, data: bytes) -> None:
        """Write `data` to `rel` atomically: readers see the old or the new bytes, never a part."""
        raise NotImplementedError

    def create_if_absent(self, rel: str, data: bytes) -> bool:
        """Write `data` to `rel` unless it exists (atomically); False if it existed."""
        raise NotImplementedError

    def delete(self, rel: str) -> None:
        """Remove `rel`; nothing if it is already gone."""
        raise NotImplementedError

    def output(self, rel: str) -> "Output":
        """A stream for one new file that appears at `rel` only when `commit()` returns."""
        raise NotImplementedError

    def move(self, rel: str, dest: str) -> None:
        """Move `rel` to `dest` (which must not exist): a rename on a local disk; on S3 a copy, then
        the delete of the original (a kill between the two leaves both, never neither)."""
        raise NotImplementedError

    @contextlib.contextmanager
    def _errors(self, rel: str):
        yield


def read_parquet(pf: pq.ParquetFile, columns=None, filters=None) -> pa.Table:
    """What pq.read_table(path, columns, filters) reads from one file, without building a dataset
    (which costs several milliseconds a call: a fold reads each table layer by layer).  `filters`:
    (column, "=", value) triples, all of which a row must match."""
    names = pf.schema_arrow.names
    want = list(names if columns is None else columns)
    if not filters:
        return pf.read(columns=want)
    for col, op, _ in filters:
        if op not in ("=", "==") or col not in names:
            raise ValueError(f"unsupported filter {(col, op)!r}")
    meta = pf.metadata
    paths = [meta.schema.column(i).path for i in range(meta.num_columns)]  # leaf columns
    leaf = {col: paths.index(col) for col, _, _ in filters}
    groups = []
    for g in range(meta.num_row_groups):
        rg = meta.row_group(g)
        keep = True
        for col, _, value in filters:
            stats = rg.column(leaf[col]).statistics
            if stats is not None and stats.has_min_max and not (stats.min <= value <= stats.max):
                keep = False
        if keep and rg.num_rows:
            groups.append(g)
    read = want + [col for col, _, _ in filters if col not in want]
    t = pf.read_row_groups(groups, columns=read) if groups else pf.schema_arrow.empty_table().select(read)
    mask = None
    for col, _, value in filters:
        m = pc.equal(t.column(col), pa.scalar(value, t.schema.field(col).type))
        mask = m if mask is None else pc.and_(mask, m)
    return t.filter(mask).select(want)


class StorageFault(UserError):
    """The storage failed (after its retries): unreachable, refusing, or failing again and again — a
    fault of the store, not of the file asked for (a check reports it as such, not as damage)."""


class UncertainWrite(StorageFault):
    """A create-if-absent that failed without a definite answer: an attempt may still land.  Whoever
    would list files in it keeps them (orphans, which `validate --fix` removes once the grace is over)."""


class Output:
    stream: pa.NativeFile

    def commit(self) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError
