"""Checksums of stored files: blake2b hashed while a file is written (HashingStream) or by one
sequential read (checksum), a file verified against its commit record's checksum (verify), and a
Storage whose reads verify each listed file first (Checked)."""

from __future__ import annotations

import contextlib
import hashlib

import pyarrow as pa
import pyarrow.parquet as pq

from common.errors import UserError

from .base import Storage

HASH = "blake2b"  # hashlib.blake2b, 64-byte digest
HASH_CHUNK = 8 << 20


class HashingStream:
    """A file-like sink that hashes (blake2b) and counts the bytes on their way to `inner`, so a
    file's checksum costs no second read (wrapped in pa.PythonFile for pyarrow writers)."""

    def __init__(self, inner: pa.NativeFile):
        self.inner, self.size, self._h = inner, 0, hashlib.blake2b()
        self.closed = False

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self._h.update(view)
        self.size += len(view)
        self.inner.write(view)
        return len(view)

    def flush(self) -> None:
        pass

    def tell(self) -> int:
        return self.size

    def writable(self) -> bool:
        return True

    def close(self) -> None:  # the inner stream is committed (or aborted) by its Output
        self.closed = True

    def checksum(self) -> dict:
        return {"size": self.size, HASH: self._h.hexdigest()}


def checksum(st: "Storage", rel: str) -> dict:
    """{"size", "blake2b"} of the stored bytes of `rel` (one sequential read)."""
    h, size = hashlib.blake2b(), 0
    with st.input_stream(rel) as f:
        while True:
            chunk = f.read(HASH_CHUNK)
            if not chunk:
                break
            h.update(chunk)
            size += len(chunk)
    return {"size": size, HASH: h.hexdigest()}


class MissingFile(UserError, FileNotFoundError):
    """A file a commit record lists is gone: one line for the user, and a FileNotFoundError for a
    committer that may have lost a race to a writer that replaced it (merge.commit re-reads)."""

    def __init__(self, message: str, filename: str):
        super().__init__(message)
        self.filename = filename

    def __str__(self) -> str:
        return self.args[0]


def verify(st: "Storage", rel: str, want: dict | None, hint: str = "") -> None:
    """Raise one UserError line unless `rel` exists with the size and hash `want` (its commit
    record's checksum; None: recorded before checksums existed, not verified): one sequential read."""
    if not want:
        return
    try:
        size = st.size(rel) if st.exists(rel) else None
    except FileNotFoundError:
        size = None
    tail = f"; {hint}" if hint else ""
    if size is None:
        raise MissingFile(f"{st.display(rel)}: listed in the commit log but missing{tail}", st.display(rel))
    if size != want["size"]:
        raise UserError(f"{st.display(rel)}: {size} bytes, its commit record says {want['size']} "
                        f"(the file changed since it was committed){tail}")
    got = checksum(st, rel)
    if got[HASH] != want[HASH]:
        raise UserError(f"{st.display(rel)}: content differs from its commit record's checksum "
                        f"(blake2b {got[HASH][:16]}…, recorded {want[HASH][:16]}…){tail}")


class Checked(Storage):
    """`inner` whose reads of the files in `expected` (rel → (checksum, hint)) first verify them
    (once per file and Checked: a fold reads a file layer by layer): what a fold reads is what its
    commit record wrote, or the fold stops with one line."""

    def __init__(self, inner: "Storage", expected: dict[str, tuple[dict | None, str]], on_verified=None):
        self.inner, self.expected, self._done = inner, expected, set()
        self.url, self.fs, self.local = inner.url, inner.fs, inner.local
        self._on_verified = on_verified  # called with (rel, checksum) after each file verified

    def _check(self, rel: str) -> None:
        if rel in self.expected and rel not in self._done:
            verify(self.inner, rel, *self.expected[rel])
            self._done.add(rel)
            if self._on_verified is not None:
                self._on_verified(rel, self.expected[rel][0])

    @contextlib.contextmanager
    def input_stream(self, rel: str):
        self._check(rel)
        with self.inner.input_stream(rel) as f:
            yield f

    def parquet_file(self, rel: str, **kwargs) -> pq.ParquetFile:
        self._check(rel)
        return self.inner.parquet_file(rel, **kwargs)

    def read_table(self, rel: str, columns=None, filters=None) -> pa.Table:
        self._check(rel)
        return self.inner.read_table(rel, columns=columns, filters=filters)

    def read_schema(self, rel: str) -> pa.Schema:
        self._check(rel)
        return self.inner.read_schema(rel)

    def path(self, rel):
        return self.inner.path(rel)

    def uri(self, rel):
        return self.inner.uri(rel)

    def display(self, rel):
        return self.inner.display(rel)

    def exists(self, rel):
        return self.inner.exists(rel)

    def size(self, rel):
        return self.inner.size(rel)

    def list_infos(self, prefix):
        return self.inner.list_infos(prefix)

    def replace(self, rel, data):
        return self.inner.replace(rel, data)

    def create_if_absent(self, rel, data):
        return self.inner.create_if_absent(rel, data)

    def delete(self, rel):
        return self.inner.delete(rel)

    def output(self, rel):
        return self.inner.output(rel)

    def move(self, rel, dest):
        return self.inner.move(rel, dest)
