"""moto's S3 server on loopback for the tests (`moto_server`), and a fault-injecting HTTP proxy
(`FaultProxy`) that listens on 127.0.0.1 in front of it and relays every request, except those a rule
picks, which it answers with a fault instead:

    "500" / "503"     an S3 error (InternalError / SlowDown, with S3's XML body), the request not relayed
    "reset-request"   part of the request body read, then the connection reset (TCP RST): not relayed
    "reset-response"  relayed (the store applied it), the status, headers and part of the body sent, then reset
    "lost-response"   relayed (the store applied it), then reset before a byte of the answer
    "delay"           held `delay_s` seconds before it is relayed (a client past its read timeout gave up)

A `Rule` picks requests by method and a regular expression searched in the path (with the query),
then either the `nth` matching ones (1-based), or a `fraction` of them by the proxy's seeded random
numbers; `times` caps how many it faults; `after` holds it back until another rule has faulted.  Rules and the proxy count what they saw (`matched`,
`injected`, `proxy.log`), so a test can assert that its fault was hit and retried.  The signature of
a request stays valid: the Host header is relayed as the client sent it.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import re
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

BUCKET = "iso-warehouse"
FAULTS = ("500", "503", "reset-request", "reset-response", "lost-response", "delay")
HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "upgrade", "transfer-encoding"}
ERRORS = {"500": ("Internal Server Error", "InternalError", "We encountered an internal error. Please try again."),
          "503": ("Slow Down", "SlowDown", "Please reduce your request rate.")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def moto_server(logdir):
    """moto's S3 server on loopback (tests/moto_serial.py: each request atomic, as S3's are) with IAM
    auth: the first 3 calls (made here) create a user and its keys; every later request must be signed
    with them.  Yields env (the AWS variables), client (boto3,
    those keys), endpoint and port; the bucket BUCKET exists."""
    import boto3

    port = free_port()
    log = open(os.path.join(logdir, "moto.log"), "w")
    proc = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "moto_serial.py"), str(port)],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "3"})
    endpoint = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.05)
        iam = boto3.client("iam", endpoint_url=endpoint, region_name="us-east-1",
                           aws_access_key_id="setup", aws_secret_access_key="setup")
        iam.create_user(UserName="iso")
        key = iam.create_access_key(UserName="iso")["AccessKey"]
        iam.put_user_policy(UserName="iso", PolicyName="all", PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
        env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
               "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"], "AWS_REGION": "us-east-1"}
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                              aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])
        client.create_bucket(Bucket=BUCKET)
        yield {"env": env, "client": client, "endpoint": endpoint, "port": port}
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


@dataclass
class Rule:
    fault: str
    method: str | None = None  # None: any method
    path: str = ""  # a regular expression searched in the request's path and query
    nth: tuple[int, ...] | None = None  # these matching requests (1-based); else `fraction` of them
    fraction: float = 1.0
    times: int | None = None  # at most this many faults
    delay_s: float = 0.0
    after: "Rule | None" = None  # only once that rule has injected a fault (the store going down)
    matched: int = 0
    injected: int = 0
    paths: list[str] = field(default_factory=list)  # the requests it faulted

    def __post_init__(self):
        if self.fault not in FAULTS:
            raise ValueError(f"unknown fault {self.fault!r}")

    def pick(self, method: str, path: str, rng: random.Random) -> bool:
        if (self.method and method != self.method) or not re.search(self.path, path) or \
                (self.after is not None and not self.after.injected):
            return False
        self.matched += 1
        if self.times is not None and self.injected >= self.times:
            return False
        hit = self.matched in self.nth if self.nth is not None else rng.random() < self.fraction
        if hit:
            self.injected += 1
            self.paths.append(f"{method} {path}")
        return hit


class FaultProxy:
    """The proxy: `endpoint` is its URL; `rules` are consulted in order (the first that picks a request
    decides); `log` holds (method, path, fault or "", time.monotonic()) of every request as it arrives."""

    def __init__(self, upstream_port: int, seed: int = 0):
        self.upstream_port = upstream_port
        self.rules: list[Rule] = []
        self.log: list[tuple[str, str, str, float]] = []
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        proxy = self

        class Handler(_Relay):
            owner = proxy

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, name="s3-fault-proxy", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def choose(self, method: str, path: str) -> Rule | None:
        with self.lock:
            return next((r for r in self.rules if r.pick(method, path, self.rng)), None)

    def note(self, method: str, path: str, fault: str) -> None:
        with self.lock:
            self.log.append((method, path, fault, time.monotonic()))

    @contextlib.contextmanager
    def faults(self, *rules: Rule, seed: int = 0):
        """These rules (only) for the duration of the block; the log starts empty."""
        with self.lock:
            self.rules, self.log[:] = list(rules), []
            self.rng.seed(seed)
        try:
            yield rules
        finally:
            with self.lock:
                self.rules = []

    def count(self, method: str | None = None, path: str = "") -> int:
        """How many requests (of `method`, with `path` searched in their path) reached the proxy."""
        with self.lock:
            return sum(1 for m, p, _, _ in self.log if (method is None or m == method) and re.search(path, p))


class _Relay(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as S3 clients expect (and 100-continue answered)
    owner: FaultProxy

    def log_message(self, format, *args):  # noqa: A002 - quiet
        pass

    def _relay(self) -> None:
        method, path = self.command, self.path
        rule = self.owner.choose(method, path)
        fault = rule.fault if rule else None
        self.owner.note(method, path, fault or "")
        if fault == "reset-request":
            self._read_body(partial=True)
            return self._reset()
        body = self._read_body()
        if fault in ERRORS:
            return self._error(fault)
        if fault == "delay":
            time.sleep(rule.delay_s)
        try:
            status, reason, headers, data = self._forward(method, path, body)
        except OSError:  # the server is gone (the session ends while a delayed request waited)
            return self._reset()
        if fault == "lost-response":
            return self._reset()
        head = [f"HTTP/1.1 {status} {reason}"] + [f"{k}: {v}" for k, v in headers] + \
            ([] if method == "HEAD" else [f"Content-Length: {len(data)}"])
        out = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1")
        try:
            if fault == "reset-response":
                self.wfile.write(out + data[: len(data) // 2])
                return self._reset()
            self.wfile.write(out + (b"" if method == "HEAD" else data))
        except OSError:  # the client gave up (a delay past its timeout)
            self.close_connection = True

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _relay

    def _read_body(self, partial: bool = False) -> bytes:
        """The request body as sent (chunked bodies with their framing); `partial`: about half of it."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            raw = []
            while True:
                line = self.rfile.readline()
                raw.append(line)
                size = int(line.split(b";")[0].strip() or b"0", 16)
                if partial:
                    raw.append(self.rfile.read(size // 2))
                    return b"".join(raw)
                if size == 0:
                    while True:  # trailers, up to the empty line
                        line = self.rfile.readline()
                        raw.append(line)
                        if line in (b"\r\n", b"\n", b""):
                            return b"".join(raw)
                raw.append(self.rfile.read(size + 2))
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n // 2 if partial else n)

    def _forward(self, method: str, path: str, body: bytes):
        conn = http.client.HTTPConnection("127.0.0.1", self.owner.upstream_port, timeout=60)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP - {"transfer-encoding"}}
            conn.request(method, path, body=body if body or method in ("PUT", "POST") else None, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            keep = [(k, v) for k, v in resp.getheaders() if k.lower() not in HOP_BY_HOP | {"content-length"}]
            if method == "HEAD":
                keep += [(k, v) for k, v in resp.getheaders() if k.lower() == "content-length"]
            return resp.status, resp.reason, keep, data
        finally:
            conn.close()

    def _error(self, fault: str) -> None:
        reason, code, message = ERRORS[fault]
        body = b"" if self.command == "HEAD" else (
            f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
            f"<RequestId>fault-proxy</RequestId></Error>").encode()
        head = [f"HTTP/1.1 {fault} {reason}", "Content-Type: application/xml", f"Content-Length: {len(body)}"]
        if self.command == "HEAD":
            head[-1] = "Content-Length: 0"
        with contextlib.suppress(OSError):
            self.wfile.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)

    def _reset(self) -> None:
        """Close the client's connection with a TCP reset (SO_LINGER 0), not an orderly FIN."""
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
