"""A warehouse in a local directory (also NFS): atomic writes by a temporary name, fsync and rename;
create-if-absent by a hard link of a complete temporary file (link() fails on an existing name)."""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs

from .base import Output, Storage


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def durable_temp(path: Path, data: bytes) -> Path:
    """`data` in a fsynced temporary file beside `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return tmp


class LocalStorage(Storage):
    local = True

    def __init__(self, root: Path):
        self.root = Path(root)
        self.url = str(root)
        self.fs = pafs.LocalFileSystem()
        self._base = str(self.root.resolve())

    def path(self, rel: str) -> str:
        return os.path.join(self._base, rel) if rel else self._base

    def uri(self, rel: str) -> str:
        return self.path(rel)

    def display(self, rel: str) -> str:
        return str(self.root / rel)

    def replace(self, rel: str, data: bytes) -> None:
        path = self.root / rel
        os.replace(durable_temp(path, data), path)
        _fsync_dir(path.parent)

    def create_if_absent(self, rel: str, data: bytes) -> bool:
        # a complete temporary file hard-linked to the name: link() fails if the name exists
        path = self.root / rel
        tmp = durable_temp(path, data)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)
        _fsync_dir(path.parent)
        return True

    def delete(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.root / rel).unlink()

    def output(self, rel: str) -> Output:
        return _LocalOutput(self.root / rel)

    def move(self, rel: str, dest: str) -> None:
        src, dst = self.root / rel, self.root / dest
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.rename(src, dst)
        _fsync_dir(dst.parent)
        _fsync_dir(src.parent)


class _LocalOutput(Output):
    """Written under a temporary name beside the target, fsynced and renamed on commit."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.tmp = path, path.with_name(f".{path.name}.tmp")
        self.stream = pa.OSFile(str(self.tmp), "wb")

    def commit(self) -> None:
        self.stream.close()
        with open(self.tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(self.tmp, self.path)
        _fsync_dir(self.path.parent)

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self.stream.close()
        for p in (self.tmp, self.path):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
