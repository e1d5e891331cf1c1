"""How the two S3 clients ride out transient faults (5xx, SlowDown, reset connections, stalls): one retry
policy for both, read from the environment when a warehouse is opened, and the one-line description of
a failure once the retries have run out.

    ISO_S3_MAX_ATTEMPTS     attempts per request, the first included (default 5; else AWS_MAX_ATTEMPTS)
    ISO_S3_RETRY_MODE       boto3's retry mode, standard or adaptive (default standard; else AWS_RETRY_MODE)
    ISO_S3_CONNECT_TIMEOUT  seconds to open a connection (default 10)
    ISO_S3_READ_TIMEOUT     seconds a response may stall before the attempt is abandoned (default 60)

pyarrow.fs (every read and data file, the listings, the companions) gets AwsStandardS3RetryStrategy
with the same number of attempts and the two timeouts; boto3 (the conditional PUT of a commit record,
deletes, server-side copies) gets `Config(retries={"total_max_attempts": …, "mode": …})` and the
timeouts.  Both back off exponentially with jitter between attempts.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from common.errors import UserError

DEFAULTS = {"ISO_S3_MAX_ATTEMPTS": "5", "ISO_S3_RETRY_MODE": "standard", "ISO_S3_CONNECT_TIMEOUT": "10",
            "ISO_S3_READ_TIMEOUT": "60"}
FALLBACKS = {"ISO_S3_MAX_ATTEMPTS": "AWS_MAX_ATTEMPTS", "ISO_S3_RETRY_MODE": "AWS_RETRY_MODE"}
MODES = ("standard", "adaptive")

# pyarrow's answer when the body of an error response (a 503's XML) does not fit the buffer of a small
# ranged GET: the SDK calls it INTERNAL_FAILURE and does not retry it (S3Storage retries such reads).
UNRETRIED_READ = "Failed to flush response stream"
_TRANSIENT = ("SERVICE_UNAVAILABLE", "SLOW_DOWN", "SlowDown", "INTERNAL_FAILURE", "InternalError", "THROTTLING",
              "ServiceUnavailable", "RequestTimeout", "REQUEST_TIMEOUT", "Connection reset", "Connection was closed",
              "Read timeout", "timed out", "Timeout was reached", "curlCode: 18", "curlCode: 28", "curlCode: 52",
              "curlCode: 55", "curlCode: 56", "Connection broken", UNRETRIED_READ)
_UNREACHABLE = ("Could not connect", "Couldn't connect", "curlCode: 6,", "curlCode: 7,", "EndpointConnectionError",
                "Connect timeout", "Failed to connect")


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int
    mode: str
    connect_timeout: float
    read_timeout: float

    def arrow_options(self) -> dict:
        """The S3FileSystem arguments of this policy (request_timeout: on Linux curl's low-speed
        limit, which abandons an attempt that receives nothing for that many seconds)."""
        import pyarrow.fs as pafs

        return {"retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=self.max_attempts),
                "connect_timeout": self.connect_timeout, "request_timeout": self.read_timeout}

    def boto_config(self):
        from botocore.config import Config

        return Config(retries={"total_max_attempts": self.max_attempts, "mode": self.mode},
                      connect_timeout=self.connect_timeout, read_timeout=self.read_timeout)

    def settings(self) -> str:
        return (f"ISO_S3_MAX_ATTEMPTS={self.max_attempts}, ISO_S3_READ_TIMEOUT={self.read_timeout:g} s, "
                f"ISO_S3_CONNECT_TIMEOUT={self.connect_timeout:g} s")


def _setting(name: str, env) -> str:
    value = env.get(name) or env.get(FALLBACKS.get(name, ""), "") or DEFAULTS[name]
    return value.strip()


def retry_policy(env=None) -> RetryPolicy:
    """The policy the environment gives (one UserError line for a value that is not one)."""
    env = os.environ if env is None else env
    values = {}
    for name, kind in (("ISO_S3_MAX_ATTEMPTS", int), ("ISO_S3_CONNECT_TIMEOUT", float), ("ISO_S3_READ_TIMEOUT", float)):
        text = _setting(name, env)
        try:
            values[name] = kind(text)
        except ValueError:
            values[name] = 0
        if not values[name] > 0 or values[name] != values[name] or values[name] == float("inf"):
            what = "a whole number of attempts ≥ 1" if kind is int else "a number of seconds > 0"
            raise UserError(f"{name}={text!r}: expected {what}")
    mode = _setting("ISO_S3_RETRY_MODE", env).lower()
    if mode not in MODES:
        raise UserError(f"ISO_S3_RETRY_MODE={mode!r}: expected {' or '.join(MODES)}")
    return RetryPolicy(values["ISO_S3_MAX_ATTEMPTS"], mode, values["ISO_S3_CONNECT_TIMEOUT"],
                       values["ISO_S3_READ_TIMEOUT"])


def first_line(e: BaseException) -> str:
    text = re.sub(r" \(reached max retries: \d+\)", "", str(e)).strip() or type(e).__name__  # boto3's count
    return " ".join(text.splitlines()[0].split())[:300]


def is_transient(e: BaseException) -> bool:
    """A failure that a later attempt may not meet (5xx, throttling, a reset or stalled connection)."""
    status = getattr(e, "response", None) and e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    if isinstance(status, int) and (status >= 500 or status == 429):
        return True
    if type(e).__name__ in ("ConnectionClosedError", "ReadTimeoutError", "ResponseStreamingError",
                            "IncompleteReadError"):
        return True
    return any(s in str(e) for s in _TRANSIENT)


def describe_s3_error(e: BaseException, url: str, endpoint: str | None, policy: RetryPolicy | None = None) -> str:
    """One line for an S3 failure: what went wrong and which setting to look at."""
    text = str(e)
    where = endpoint or "the AWS default endpoint"
    if any(s in text for s in _UNREACHABLE) or type(e).__name__ in ("EndpointConnectionError", "ConnectTimeoutError"):
        return f"{url}: cannot reach the S3 endpoint {where} (check AWS_ENDPOINT_URL and the network)"
    if any(s in text for s in ("INVALID_ACCESS_KEY_ID", "InvalidAccessKeyId", "SIGNATURE_DOES_NOT_MATCH",
                               "SignatureDoesNotMatch", "ACCESS_DENIED", "AccessDenied", "Forbidden",
                               "NoCredentialsError", "Unable to locate credentials")) or \
            type(e).__name__ == "NoCredentialsError":
        return f"{url}: access denied by {where} (check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)"
    if "NoSuchBucket" in text or "NO_SUCH_BUCKET" in text:
        return f"{url}: the bucket does not exist (create it first)"
    if is_transient(e):
        policy = policy or retry_policy()
        return (f"{url}: S3 kept failing ({first_line(e)}) after {policy.max_attempts} attempts; try again later, "
                f"or allow more ({policy.settings()})")
    return f"{url}: S3 error: {first_line(e)}"
