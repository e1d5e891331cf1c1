"""Where a warehouse lives: a local directory or `s3://bucket/prefix` on any S3-compatible store.

`open_storage(where)` gives the `Storage` of a warehouse root; every file is then read and written by
a path relative to it.  The two kinds differ only in how the three operations the commit protocol
needs are made atomic:

    operation            local directory (also NFS)                   S3
    write a data file    temporary name, fsync, rename               one PUT (a large one multipart): the
                                                                      object appears only when complete
    replace a companion  temporary name, fsync, rename               one PUT
    create if absent     hard link of a complete temporary file      PUT with `If-None-Match: *`
                         (link() fails on an existing name)          (412 when the key exists)

- base.py       the Storage interface (reading is the same for both kinds: pyarrow.fs)
- local.py      a local directory
- s3.py         S3 (pyarrow.fs, and boto3 for the conditional PUT), its failures as one line each
- s3_retry.py   the retry policy of both S3 clients (environment variables) and the failure lines
- s3_reads.py   each committed S3 object read at most once per command (`reads_once`, `reading_once`)
- checksums.py  blake2b checksums of stored files, verification against a record, `Checked` reads

This package knows bytes and names only (not tables, not the manifest); warehouse.store builds on it.
"""

from __future__ import annotations

from pathlib import Path

from common.errors import UserError

from .base import Output, Storage, StorageFault, UncertainWrite
from .checksums import HASH, HASH_CHUNK, Checked, HashingStream, MissingFile, checksum, verify
from .local import LocalStorage, durable_temp
from .s3 import S3Storage
from .s3_reads import reading_once, reads_once
from .s3_retry import RetryPolicy, describe_s3_error, retry_policy

__all__ = ["open_storage", "Storage", "Output", "StorageFault", "UncertainWrite", "LocalStorage", "durable_temp",
           "S3Storage", "reads_once", "reading_once", "describe_s3_error", "RetryPolicy", "retry_policy",
           "HASH", "HASH_CHUNK", "HashingStream", "checksum", "MissingFile", "verify", "Checked"]

_OPEN: dict[str, Storage] = {}  # one probed S3 storage per URL and process


def open_storage(where, must_exist: bool = False) -> Storage:
    """The Storage of `where` (a Storage, a local path, or an s3:// URL).  must_exist: a local
    directory must already exist (queries); an S3 bucket must always exist and be reachable."""
    if isinstance(where, Storage):
        return where
    text = str(where)
    if text.startswith("s3://"):
        st = _OPEN.get(text)
        if st is None:
            st = _OPEN[text] = S3Storage(text)
        return st
    if "://" in text:
        raise UserError(f"--warehouse {text!r}: expected a directory or s3://bucket/prefix")
    st = LocalStorage(Path(text))
    if must_exist and not st.root.is_dir():
        raise UserError(f"{text}: no such warehouse directory")
    return st
