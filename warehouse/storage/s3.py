"""A warehouse at `s3://bucket/prefix` on any S3-compatible store.

Data files go through pyarrow.fs (one PUT, or a multipart upload for a file larger than a part: the
object appears only when complete); the conditional PUT that create-if-absent needs (`If-None-Match:
*`, 412 when the key exists), deletes and server-side copies go through boto3.  Endpoint, keys and region come from the standard variables
AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (AWS_SESSION_TOKEN), AWS_REGION (or
AWS_DEFAULT_REGION); both clients retry transient faults by the policy of s3_retry.py.  Every S3
failure left after the retries becomes one UserError line: cannot reach the endpoint, no such
bucket, access denied, the store kept failing, or the store's own message.  A conditional PUT whose
outcome is unknown (its answer lost) is settled by reading the record back.  Within a command each
committed object is read at most once (s3_reads.py); a rewritable Parquet object (a companion) whose
read another writer's replace tore is read again (`_parquet`).
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from common import faults
from common.errors import UserError

from .base import Output, Storage, StorageFault, UncertainWrite, read_parquet
from .s3_reads import ObjectCache, budget_bytes, immutable
from .s3_retry import UNRETRIED_READ, describe_s3_error, first_line, is_transient, retry_policy


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
        self.policy = retry_policy()
        # allow_delayed_open: a file smaller than a part is one PUT when closed, not a multipart upload
        kwargs = {"region": self.region, "allow_delayed_open": True, **self.policy.arrow_options()}
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
            raise UserError(f"{self.url}: cannot set up S3 ({first_line(e)})") from None
        self._client = None
        self._cache = ObjectCache(self.fs, budget_bytes(), scoped=True)  # committed objects, per read scope
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

    def _fail(self, e: BaseException) -> StorageFault:
        return StorageFault(describe_s3_error(e, self.url, self.endpoint, self.policy))

    @contextlib.contextmanager
    def _errors(self, rel: str):
        try:
            yield
        except UserError:
            raise
        except (OSError, pa.ArrowException) as e:
            if isinstance(e, FileNotFoundError):
                raise
            if UNRETRIED_READ in str(e):
                raise _UnretriedRead(describe_s3_error(e, self.url, self.endpoint, self.policy)) from None
            if isinstance(e, OSError):
                raise self._fail(e) from None
            raise UserError(describe_s3_error(e, self.url, self.endpoint, self.policy)) from None  # e.g. not Parquet

    def _again(self, read):
        """read() once more, with backoff, each time pyarrow gave up at once on a fault its SDK does not
        retry (a 5xx whose error body is larger than the buffer of a small ranged read): the policy's
        attempts in all, as the SDK would have made."""
        for attempt in range(1, self.policy.max_attempts + 1):
            try:
                return read()
            except _UnretriedRead:
                if attempt == self.policy.max_attempts:
                    raise
            time.sleep(random.random() * min(2.0 ** (attempt - 1), 20.0))

    # ---- reading: a committed object whole from this read scope's cache (s3_reads.py), else as stored
    def _whole(self, rel: str) -> pa.Buffer | None:
        """`rel` whole (fetched now, once per read scope), or None: not a committed object, no scope
        open, or larger than the budget left — read it the usual way."""
        if not immutable(rel):
            return None

        def fetch():
            with self._errors(rel):
                return self._cache.whole(self.path(rel))

        return self._again(fetch)

    @contextlib.contextmanager
    def input_stream(self, rel: str):
        buf = self._whole(rel)
        if buf is None:
            with super().input_stream(rel) as f:
                yield f
        else:
            yield pa.BufferReader(buf)

    def read_bytes(self, rel: str, limit: int = -1) -> bytes:
        buf = self._whole(rel)
        if buf is not None:
            return memoryview(buf)[: None if limit < 0 else limit].tobytes()
        return self._again(lambda: super(S3Storage, self).read_bytes(rel, limit))

    def exists(self, rel: str) -> bool:
        try:
            if self._whole(rel) is not None or self._cache.size(self.path(rel)) is not None:
                return True
        except FileNotFoundError:
            return False
        return self._again(lambda: super(S3Storage, self).exists(rel))

    def size(self, rel: str) -> int:
        known = self._cache.size(self.path(rel)) if immutable(rel) else None
        if known is not None:
            return known
        return self._again(lambda: super(S3Storage, self).size(rel))

    def list_infos(self, prefix: str) -> list[tuple[str, int, float]]:
        return self._again(lambda: super(S3Storage, self).list_infos(prefix))

    def _below(self, base: str) -> list[pafs.FileInfo]:  # one listing (no HEAD and LIST to ask whether it exists)
        return self.fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))

    def _parquet(self, rel: str, parse):
        """parse(pyarrow's file of `rel`) as stored; a rewritable object (a companion, `replace`) up to
        TORN_READS times while pyarrow finds no Parquet in it: another writer's `replace` between
        pyarrow's HEAD (the size) and its ranged GETs tears one read (the stored object is whole);
        a damaged object stays damaged, and the last failure is the error."""
        tries = 1 if immutable(rel) else self.TORN_READS

        def read():
            with self._errors(rel):
                for attempt in range(1, tries + 1):
                    try:
                        return parse(self.fs.open_input_file(self.path(rel)))
                    except pa.ArrowInvalid:
                        if attempt == tries:
                            raise
        return self._again(read)

    TORN_READS = 3  # reads of a rewritable Parquet object before "not Parquet" is believed (`_parquet`)

    def parquet_file(self, rel: str, **kwargs):
        buf = self._whole(rel)
        if buf is not None:
            with self._errors(rel):
                return pq.ParquetFile(pa.BufferReader(buf), **kwargs)
        return self._parquet(rel, lambda f: pq.ParquetFile(f, **kwargs))

    def read_table(self, rel: str, columns=None, filters=None) -> pa.Table:
        buf = self._whole(rel)
        if buf is not None:
            with self._errors(rel):
                return read_parquet(pq.ParquetFile(pa.BufferReader(buf)), columns, filters)
        return self._parquet(rel, lambda f: read_parquet(pq.ParquetFile(f), columns, filters))

    def read_schema(self, rel: str) -> pa.Schema:
        buf = self._whole(rel)
        if buf is not None:
            with self._errors(rel):
                return pq.read_schema(pa.BufferReader(buf))
        return self._parquet(rel, pq.read_schema)

    def _s3(self):
        """boto3 client for what pyarrow.fs lacks (conditional PUT, delete without a directory marker, copy)."""
        if self._client is None:
            import boto3

            self._client = boto3.session.Session(**self._keys).client(  # a session of its own, not boto3's default
                "s3", endpoint_url=self.endpoint, region_name=self.region, config=self.policy.boto_config())
        return self._client

    def replace(self, rel: str, data: bytes) -> None:
        self._cache.forget(self.path(rel))
        with self._errors(rel), self.fs.open_output_stream(self.path(rel)) as f:
            f.write(data)

    def create_if_absent(self, rel: str, data: bytes) -> bool:
        import botocore.exceptions as bx

        try:
            self._s3().put_object(Bucket=self.bucket, Key=self._key(rel), Body=data, IfNoneMatch="*")
            return True
        except bx.ClientError as e:
            code = e.response.get("Error", {}).get("Code", "")
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code == "PreconditionFailed" or status == 412:
                # lost the race — unless a retried PUT of ours was the one that created it
                return self.read_bytes(rel) == data
            if code == "ConditionalRequestConflict" or status == 409:  # a concurrent conditional PUT
                return self.exists(rel) and self.read_bytes(rel) == data
            if not is_transient(e):
                raise self._fail(e) from None
            return self._settle(rel, data, e)
        except (bx.ConnectionError, bx.HTTPClientError) as e:  # sent or not, answered or not: unknown
            return self._settle(rel, data, e)
        except (bx.BotoCoreError, OSError) as e:
            raise self._fail(e) from None

    def _settle(self, rel: str, data: bytes, e: BaseException) -> bool:
        """After a conditional PUT failed without a definite answer (its response lost, a 5xx, a timeout
        — possibly after an earlier attempt was stored): the object as the store now has it decides.
        Ours: created (True); another writer's: lost the race (False); none: the PUT failed, though an
        attempt still in flight might yet land (UncertainWrite: the caller keeps what it would list)."""
        try:
            return self.read_bytes(rel) == data
        except FileNotFoundError:
            raise UncertainWrite(describe_s3_error(e, self.url, self.endpoint, self.policy)) from None
        except UserError as again:
            raise UncertainWrite(f"{describe_s3_error(e, self.url, self.endpoint, self.policy)}; reading "
                                 f"{rel} back failed too ({again}), so whether it was written is unknown "
                                 "(`cli.py validate` tells)") from None

    def delete(self, rel: str) -> None:
        # boto3, not fs.delete_file: pyarrow leaves an empty "directory" object for the parent
        import botocore.exceptions as bx

        self._cache.forget(self.path(rel))
        try:
            self._s3().delete_object(Bucket=self.bucket, Key=self._key(rel))  # no error if absent
        except (bx.BotoCoreError, bx.ClientError) as e:
            raise self._fail(e) from None

    def output(self, rel: str) -> Output:
        self._cache.forget(self.path(rel))
        with self._errors(rel):
            return _S3Output(self, rel)

    def move(self, rel: str, dest: str) -> None:
        import botocore.exceptions as bx

        self._cache.forget(self.path(dest))
        try:  # managed copy: CopyObject, or UploadPartCopy above its 5 GB limit (server side either way)
            self._s3().copy({"Bucket": self.bucket, "Key": self._key(rel)}, self.bucket, self._key(dest))
        except (bx.BotoCoreError, bx.ClientError) as e:
            raise self._fail(e) from None
        faults.hit("move")  # copied, not yet deleted: a kill leaves both (the original is moved again)
        self.delete(rel)


class _UnretriedRead(StorageFault):
    """A read that pyarrow's SDK failed without retrying (S3Storage retries it)."""


class _S3Output(Output):
    """One PUT when closed, or (a file larger than a part) a multipart upload, straight to the final
    key: the object exists only once it completes (a killed process leaves no object, or an incomplete
    upload, never a partial object); abort deletes it."""

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
