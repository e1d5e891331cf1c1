"""Where a warehouse lives: a local directory or `s3://bucket/prefix` on any S3-compatible store.

Every file the warehouse reads or writes goes through a `Storage`, by a path relative to the
warehouse root ("tables/token_sums/…/run.parquet", "_log/000…1.json").  The two kinds differ only
in how the three operations the commit protocol needs are made atomic:

    operation            local directory (also NFS)                   S3
    write a data file    temporary name, fsync, rename               one PUT (multipart: the object
                                                                      appears only when complete)
    replace a companion  temporary name, fsync, rename               one PUT
    create if absent     hard link of a complete temporary file      PUT with `If-None-Match: *`
                         (link() fails on an existing name)          (412 when the key exists)

S3 is reached through pyarrow.fs (data files) and, for the conditional PUT that pyarrow does not
expose, boto3.  Endpoint, keys and region come from the standard variables AWS_ENDPOINT_URL,
AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (AWS_SESSION_TOKEN), AWS_REGION (or AWS_DEFAULT_REGION).
Every S3 failure becomes one UserError line: cannot reach the endpoint, no such bucket, access
denied, or the store's own message.

This module knows bytes and names only (not tables, not the manifest); store.py builds on it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import time
from pathlib import Path
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from common import faults
from common.errors import UserError

_OPEN: dict[str, "Storage"] = {}  # one probed S3 storage per URL and process


def open_storage(where, must_exist: bool = False) -> "Storage":
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
            base = self.path(prefix)
            if self.fs.get_file_info(base).type == pafs.FileType.NotFound:
                return []
            infos = self.fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
        strip = len(self.path("")) + (0 if self.path("").endswith("/") else 1)
        return sorted((i.path[strip:], i.size, i.mtime.timestamp() if i.mtime is not None else time.time())
                      for i in infos if i.type == pafs.FileType.File)

    def parquet_file(self, rel: str, **kwargs) -> pq.ParquetFile:
        with self._errors(rel):
            return pq.ParquetFile(self.fs.open_input_file(self.path(rel)), **kwargs)

    def read_table(self, rel: str, columns=None, filters=None) -> pa.Table:
        with self._errors(rel):
            return pq.read_table(self.path(rel), columns=columns, filters=filters, filesystem=self.fs)

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


class Output:
    stream: pa.NativeFile

    def commit(self) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError


# ---------------------------------------------------------------- local directory


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


# ---------------------------------------------------------------- S3


def _env(*names: str) -> str | None:
    return next((os.environ[n] for n in names if os.environ.get(n)), None)


class S3Storage(Storage):
    local = False

    def __init__(self, url: str):
        parsed = urlparse(url)
        if not parsed.netloc or parsed.query or parsed.fragment:
            raise UserError(f"--warehouse {url!r}: expected s3://bucket or s3://bucket/prefix")
        self.url = url.rstrip("/")
        self.bucket, self.prefix = parsed.netloc, parsed.path.strip("/")
        self.endpoint = _env("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
        self.region = _env("AWS_REGION", "AWS_DEFAULT_REGION") or "us-east-1"
        kwargs = {"region": self.region, "connect_timeout": 10, "request_timeout": 60,
                  "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=3)}
        if self.endpoint:
            kwargs["endpoint_override"] = self.endpoint
        key, secret = _env("AWS_ACCESS_KEY_ID"), _env("AWS_SECRET_ACCESS_KEY")
        self._keys = {}  # the same credentials for boto3 (its default session would keep the first ones it saw)
        if key and secret:
            kwargs.update(access_key=key, secret_key=secret, session_token=_env("AWS_SESSION_TOKEN"))
            self._keys = {"aws_access_key_id": key, "aws_secret_access_key": secret,
                          "aws_session_token": _env("AWS_SESSION_TOKEN")}
        try:
            self.fs = pafs.S3FileSystem(**kwargs)
        except (OSError, ValueError, pa.ArrowException) as e:
            raise UserError(f"{self.url}: cannot set up S3 ({_first_line(e)})") from None
        self._client = None
        self.probe()

    def probe(self) -> None:
        """Fail with one line unless the bucket exists and these credentials can list it."""
        with self._errors(""):
            if self.fs.get_file_info(self.bucket).type == pafs.FileType.NotFound:
                raise UserError(f"{self.url}: bucket {self.bucket!r} does not exist (create it first)")
            self.fs.get_file_info(pafs.FileSelector(self.path(""), recursive=False, allow_not_found=True))

    def _key(self, rel: str) -> str:
        return "/".join(p for p in (self.prefix, rel) if p)

    def path(self, rel: str) -> str:
        return f"{self.bucket}/{self._key(rel)}".rstrip("/")

    def uri(self, rel: str) -> str:
        return f"s3://{self.path(rel)}"

    @contextlib.contextmanager
    def _errors(self, rel: str):
        try:
            yield
        except UserError:
            raise
        except (OSError, pa.ArrowException) as e:
            if isinstance(e, FileNotFoundError):
                raise
            raise UserError(describe_s3_error(e, self.url, self.endpoint)) from None

    def _s3(self):
        """boto3 client for the one call pyarrow.fs lacks (conditional PUT)."""
        if self._client is None:
            import boto3
            from botocore.config import Config

            self._client = boto3.session.Session(**self._keys).client(  # a session of its own, not boto3's default
                "s3", endpoint_url=self.endpoint, region_name=self.region,
                config=Config(retries={"max_attempts": 3, "mode": "standard"}, connect_timeout=10, read_timeout=60))
        return self._client

    def replace(self, rel: str, data: bytes) -> None:
        with self._errors(rel), self.fs.open_output_stream(self.path(rel)) as f:
            f.write(data)

    def create_if_absent(self, rel: str, data: bytes) -> bool:
        import botocore.exceptions as bx

        key = self._key(rel)
        try:
            self._s3().put_object(Bucket=self.bucket, Key=key, Body=data, IfNoneMatch="*")
            return True
        except bx.ClientError as e:
            code = e.response.get("Error", {}).get("Code", "")
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code == "PreconditionFailed" or status == 412:
                # lost the race — unless a retried PUT of ours was the one that created it
                return self.read_bytes(rel) == data
            if code == "ConditionalRequestConflict" or status == 409:  # a concurrent conditional PUT
                return self.exists(rel) and self.read_bytes(rel) == data
            raise UserError(describe_s3_error(e, self.url, self.endpoint)) from None
        except (bx.BotoCoreError, OSError) as e:
            raise UserError(describe_s3_error(e, self.url, self.endpoint)) from None

    def delete(self, rel: str) -> None:
        # boto3, not fs.delete_file: pyarrow leaves an empty "directory" object for the parent
        import botocore.exceptions as bx

        try:
            self._s3().delete_object(Bucket=self.bucket, Key=self._key(rel))  # no error if absent
        except (bx.BotoCoreError, bx.ClientError) as e:
            raise UserError(describe_s3_error(e, self.url, self.endpoint)) from None

    def output(self, rel: str) -> Output:
        with self._errors(rel):
            return _S3Output(self, rel)

    def move(self, rel: str, dest: str) -> None:
        import botocore.exceptions as bx

        try:  # managed copy: CopyObject, or UploadPartCopy above its 5 GB limit (server side either way)
            self._s3().copy({"Bucket": self.bucket, "Key": self._key(rel)}, self.bucket, self._key(dest))
        except (bx.BotoCoreError, bx.ClientError) as e:
            raise UserError(describe_s3_error(e, self.url, self.endpoint)) from None
        faults.hit("move")  # copied, not yet deleted: a kill leaves both (the original is moved again)
        self.delete(rel)


class _S3Output(Output):
    """A multipart upload straight to the final key: the object exists only once it completes (a
    killed process leaves an incomplete upload, never a partial object); abort deletes it."""

    def __init__(self, storage: S3Storage, rel: str):
        self.storage, self.rel = storage, rel
        self.stream = storage.fs.open_output_stream(storage.path(rel))

    def commit(self) -> None:
        with self.storage._errors(self.rel):
            self.stream.close()

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self.stream.close()
        with contextlib.suppress(Exception):
            self.storage.delete(self.rel)


# ---------------------------------------------------------------- checksums

HASH = "blake2b"  # hashlib.blake2b, 64-byte digest: ~1 GB/s on one core (docs/reliability.md)
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


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:300]


def describe_s3_error(e: BaseException, url: str, endpoint: str | None) -> str:
    """One line for an S3 failure: what went wrong and which setting to look at."""
    text = str(e)
    where = endpoint or "the AWS default endpoint"
    if any(s in text for s in ("NETWORK_CONNECTION", "curlCode", "Could not connect", "EndpointConnectionError",
                               "Could not connect to the endpoint", "Connect timeout")) or \
            type(e).__name__ in ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError"):
        return f"{url}: cannot reach the S3 endpoint {where} (check AWS_ENDPOINT_URL and the network)"
    if any(s in text for s in ("INVALID_ACCESS_KEY_ID", "InvalidAccessKeyId", "SIGNATURE_DOES_NOT_MATCH",
                               "SignatureDoesNotMatch", "ACCESS_DENIED", "AccessDenied", "Forbidden",
                               "NoCredentialsError", "Unable to locate credentials")) or \
            type(e).__name__ == "NoCredentialsError":
        return f"{url}: access denied by {where} (check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)"
    if "NoSuchBucket" in text or "NO_SUCH_BUCKET" in text:
        return f"{url}: the bucket does not exist (create it first)"
    return f"{url}: S3 error: {_first_line(e)}"
