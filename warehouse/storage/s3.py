"""A warehouse at `s3://bucket/prefix` on any S3-compatible store.

Data files go through pyarrow.fs (one multipart upload that appears only when complete); the
conditional PUT that create-if-absent needs (`If-None-Match: *`, 412 when the key exists), deletes
and server-side copies go through boto3.  Endpoint, keys and region come from the standard variables
AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (AWS_SESSION_TOKEN), AWS_REGION (or
AWS_DEFAULT_REGION).  Every S3 failure becomes one UserError line: cannot reach the endpoint, no
such bucket, access denied, or the store's own message.
"""

from __future__ import annotations

import contextlib
import os
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.fs as pafs

from common import faults
from common.errors import UserError

from .base import Output, Storage


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
