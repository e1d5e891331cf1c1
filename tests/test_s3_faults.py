"""Transient S3 faults, injected by the proxy of tests/s3_faults.py in front of the session's moto server:
each fault kind, on each client it applies to (pyarrow.fs for files, boto3 for the conditional record
PUT and copies), is ridden out by the retry policy of warehouse/storage/s3_retry.py or fails in one
line; the commands (extract, merge, compact, validate, sql) either succeed through the retries with
every view equal to a clean run, or fail in one line with nothing half-visible and a rerun exact; a
record PUT whose answer is lost after the store applied it counts as committed, once."""

from __future__ import annotations

import collections
import contextlib
import json

import pytest

from common.errors import UserError
from conftest import run_cli, same_numbers, views
from s3_faults import BUCKET, Rule

BIG = b"x" * 4096  # larger than an S3 error body
SMALL = b'{"seq": 1}'  # smaller: the ranged GET whose 5xx pyarrow's SDK does not retry itself


@pytest.fixture(scope="module")
def clean(workdir, sources, model_factory):
    """A tiny extract (two sources) on a local disk: its arguments and every view, to compare with."""
    model = model_factory("gpt_neox", tied=False)
    args = ["--model", str(model), "--source", f"alpha={sources['alpha']}", "--source", f"beta={sources['beta']}",
            "--max-length", "16", "--batch-size", "4"]
    code, _, err = run_cli("extract", *args, "--warehouse", workdir / "faults-clean")
    assert code == 0, err
    return {"args": args, "views": views(workdir / "faults-clean")}


@pytest.fixture
def faulty(s3, s3_proxy, monkeypatch):
    """The S3 variables with the proxy as the endpoint (retry policy: the defaults unless a test sets
    ISO_S3_*), S3 storages opened fresh; yields the proxy."""
    from warehouse import storage

    for k, v in {**s3["env"], "AWS_ENDPOINT_URL": s3_proxy.endpoint}.items():
        monkeypatch.setenv(k, v)
    storage._OPEN.clear()
    yield s3_proxy
    storage._OPEN.clear()


def opened(name: str):
    from warehouse.storage import open_storage

    return open_storage(f"s3://{BUCKET}/faults-{name}")


def one_line(code: int, err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, err)
    assert all(n in lines[0] for n in needles), err


def keys(s3, prefix: str) -> list[str]:
    pages = s3["client"].get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=f"faults-{prefix}/")
    return sorted(o["Key"].split("/", 1)[1] for p in pages for o in p.get("Contents", []))


# ---------------------------------------------------------------- the policy, as stated


def test_retry_policy_comes_from_the_environment_and_reaches_both_clients(faulty, monkeypatch):
    from warehouse.storage import retry_policy

    assert retry_policy({}) == retry_policy({"ISO_S3_MAX_ATTEMPTS": "5", "ISO_S3_RETRY_MODE": "standard"})
    p = retry_policy({"AWS_MAX_ATTEMPTS": "7", "ISO_S3_READ_TIMEOUT": "2.5", "AWS_RETRY_MODE": "adaptive"})
    assert (p.max_attempts, p.mode, p.read_timeout, p.connect_timeout) == (7, "adaptive", 2.5, 10.0)
    assert retry_policy({"AWS_MAX_ATTEMPTS": "7", "ISO_S3_MAX_ATTEMPTS": "2"}).max_attempts == 2
    for bad in ({"ISO_S3_MAX_ATTEMPTS": "0"}, {"ISO_S3_MAX_ATTEMPTS": "three"}, {"ISO_S3_READ_TIMEOUT": "-1"},
                {"ISO_S3_RETRY_MODE": "legacy"}, {"ISO_S3_CONNECT_TIMEOUT": "nan"}):
        with pytest.raises(UserError, match=next(iter(bad))):
            retry_policy(bad)
    monkeypatch.setenv("ISO_S3_MAX_ATTEMPTS", "3")
    monkeypatch.setenv("ISO_S3_RETRY_MODE", "adaptive")
    monkeypatch.setenv("ISO_S3_READ_TIMEOUT", "7")
    st = opened("policy")
    config = st._s3().meta.config
    assert config.retries == {"total_max_attempts": 3, "mode": "adaptive"} and config.read_timeout == 7
    # each client makes exactly the policy's attempts, then one line names them
    st.replace("obj", BIG)
    for call, method in ((lambda: st.read_bytes("obj"), "GET"), (lambda: st.delete("obj"), "DELETE")):
        with faulty.faults(Rule("503", method=method, path="/faults-policy/obj")) as (rule,):
            with pytest.raises(UserError) as e:
                call()
        assert rule.injected == 3 and faulty.count(method, "/faults-policy/obj") == 3
        assert "S3 kept failing" in str(e.value) and "after 3 attempts" in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------- one fault kind at a time, on each client

def _get(st):
    st.replace("obj", BIG)
    return lambda: st.read_bytes("obj") == BIG, "GET", "/obj"


def _get_small(st):
    st.replace("obj", SMALL)
    return lambda: st.read_bytes("obj") == SMALL, "GET", "/obj"


def _put_file(st):
    return lambda: (st.replace("obj", BIG), st.read_bytes("obj") == BIG)[1], "PUT", "/obj"


def _put_multipart(st):  # larger than a part (10 MiB): a multipart upload (create, parts, complete)
    data = b"y" * (11 << 20)
    return lambda: (st.replace("obj", data), st.read_bytes("obj") == data)[1], "POST", r"/obj\?uploads"


def _complete_multipart(st):
    call, method, _ = _put_multipart(st)
    return call, method, r"/obj\?uploadId="


def _put_record(st):
    return lambda: st.create_if_absent("_log/00000000000000000001.json", BIG), "PUT", "/_log/"


def _copy(st):
    st.replace("obj", BIG)
    return lambda: (st.move("obj", "moved"), st.read_bytes("moved") == BIG and not st.exists("obj"))[1], "PUT", "/moved"


CASES = [  # (fault, client, operation): a fault, then the request passes (the policy test counts N in a row)
    ("500", "pyarrow", _get), ("503", "pyarrow", _get), ("503", "pyarrow", _get_small), ("500", "pyarrow", _put_file),
    ("503", "pyarrow", _put_file), ("500", "boto3", _put_record), ("503", "boto3", _put_record),
    ("503", "boto3", _copy), ("500", "pyarrow", _put_multipart),  # (a small file is one PUT: _put_file)
    ("lost-response", "pyarrow", _complete_multipart),  # the upload completed, its answer lost
    ("reset-response", "pyarrow", _get), ("reset-response", "boto3", _copy),  # mid-body, answer side
    ("reset-request", "pyarrow", _put_file), ("reset-request", "boto3", _put_record),  # mid-body, request side
    ("delay", "pyarrow", _get), ("delay", "boto3", _put_record),  # past the read timeout
]


@pytest.mark.parametrize("fault,client,operation", CASES, ids=[f"{f}-{c}-{o.__name__[1:]}" for f, c, o in CASES])
def test_fault_is_retried(faulty, monkeypatch, fault, client, operation):
    monkeypatch.setenv("ISO_S3_READ_TIMEOUT", "2")
    name = f"{fault}-{client}-{operation.__name__[1:]}"
    st = opened(name)
    call, method, path = operation(st)
    with faulty.faults(Rule(fault, method=method, path=f"/faults-{name}{path}", nth=(1,), delay_s=4)) as (rule,):
        assert call() is True
    assert rule.injected == 1 and rule.matched == 2  # retried, and passed


# ---------------------------------------------------------------- a record PUT whose answer is lost

RECORD = "_log/00000000000000000001.json"


@pytest.mark.parametrize("lost", ["first-attempt", "every-attempt"])
def test_lost_record_response_is_settled_by_reading_it_back(faulty, s3, lost):
    """Stored, answer lost: boto3's retry meets 412 from its own first attempt (first-attempt), or every
    attempt is lost (every-attempt); either way the record read back is ours: created, once."""
    st = opened(f"lost-{lost}")
    rule = Rule("lost-response", method="PUT", path="/_log/", times=1 if lost == "first-attempt" else None)
    with faulty.faults(rule):
        assert st.create_if_absent(RECORD, BIG) is True
    assert rule.injected >= 1 and faulty.count("PUT", "/_log/") == (2 if lost == "first-attempt" else 5)
    assert st.read_bytes(RECORD) == BIG
    # another writer's record in place and the answers lost: the race is lost, not an error
    other = opened(f"lost-race-{lost}")
    s3["client"].put_object(Bucket=BUCKET, Key=f"faults-lost-race-{lost}/{RECORD}", Body=b"another writer's")
    with faulty.faults(Rule("lost-response", method="PUT", path="/_log/", times=rule.times)):
        assert other.create_if_absent(RECORD, BIG) is False


def test_record_put_that_never_lands_is_uncertain_and_one_line(faulty, monkeypatch):
    from warehouse.storage import UncertainWrite

    monkeypatch.setenv("ISO_S3_MAX_ATTEMPTS", "2")
    st = opened("uncertain")
    with faulty.faults(Rule("503", method="PUT", path="/_log/")):
        with pytest.raises(UncertainWrite, match="S3 kept failing .* after 2 attempts") as e:
            st.create_if_absent(RECORD, BIG)
    assert "\n" not in str(e.value) and not st.exists(RECORD)
    with faulty.faults(Rule("reset-request", method="PUT", path="/_log/"), Rule("503", method="HEAD"),
                       Rule("503", method="GET")):
        with pytest.raises(UncertainWrite, match="whether it was written is unknown") as e:
            st.create_if_absent(RECORD, BIG)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------- the commands


def scattered(command: str) -> list[Rule]:
    """Faults of every kind at fixed places among one command's requests of each method (its requests
    in order, so the same faults each run; no request meets more than 2).  A 5xx is put only where
    the storage reads (a scan's or a fold's small ranged GET would fail at once: see s3_retry)."""
    log = "/_log/"
    return {
        "extract": [Rule("lost-response", "PUT", log, nth=(1,)),  # boto3's retry meets 412 from its own first attempt
                    Rule("503", "GET", "list-type=2", nth=(2, 7)), Rule("reset-response", "GET", nth=(1,)),
                    Rule("500", "HEAD", nth=(3,)), Rule("reset-request", "HEAD", nth=(12,)),
                    Rule("503", "PUT", nth=(2,)), Rule("reset-request", "PUT", nth=(6, 11)),
                    Rule("500", "PUT", nth=(4, 13)), Rule("lost-response", "PUT", nth=(9,)),  # a data file's
                    Rule("reset-request", "DELETE", nth=(1,))],
        "merge": [Rule("lost-response", "PUT", log),  # every attempt's answer lost: read back, committed once
                  Rule("reset-response", "GET", nth=(10, 20)), Rule("503", "HEAD", nth=(15,)),
                  Rule("503", "PUT", nth=(5,)), Rule("500", "PUT", nth=(7, 20)), Rule("reset-request", "DELETE", nth=(2,))],
        "sql": [Rule("reset-response", "GET", nth=(3,)), Rule("503", "HEAD", nth=(2,))],
        "validate": [Rule("reset-response", "GET", "list-type=2", nth=(3,)), Rule("reset-response", "GET", nth=(30,)),
                     Rule("500", "HEAD", nth=(25,))],
        "compact": [Rule("lost-response", "PUT", log, nth=(1,)), Rule("500", "PUT", nth=(1,)),
                    Rule("reset-request", "PUT", nth=(3,)), Rule("503", "DELETE", nth=(2,))],
    }[command]


def test_each_command_fails_in_one_line_then_rides_out_scattered_faults(faulty, clean, s3, monkeypatch):
    """Each command on one warehouse, twice: first with the store failing every attempt of one kind of
    request (2 attempts) — extract (the store going down at its record: neither the record nor the state
    can be read back), merge and compact (at their records), sql and validate (reading the tables),
    validate (a listing midway) — one line, exit 2, nothing of a failed commit visible; then the same
    command with 500s, 503s, resets of either side and lost answers among its requests (`scattered`;
    the answers of the three records lost, merge's on every attempt) — it succeeds, commits once, and
    every view equals a clean local run."""
    from warehouse.query import PendingPartials

    from warehouse import storage

    url = f"s3://{BUCKET}/faults-commands"

    def attempts(n: int) -> None:
        monkeypatch.setenv("ISO_S3_MAX_ATTEMPTS", str(n))
        storage._OPEN.clear()  # (the policy is read when a warehouse is opened)

    def scattered_run(name, *args):
        attempts(3)  # no request meets more than 2 transient faults
        with faulty.faults(*scattered(name)) as rules:
            code, out, err = run_cli(*args, "--warehouse", url)
        attempts(2)
        assert code == 0 and "warning" not in err, (name, err)
        assert all(r.injected == (len(r.nth) if r.nth else 3) for r in rules), \
            (name, [(r.fault, r.method, r.nth, r.injected) for r in rules])
        return out

    attempts(2)
    record = Rule("503", method="PUT", path="/_log/")
    with faulty.faults(record, Rule("503", after=record)) as (_, down):
        code, _, err = run_cli("extract", *clean["args"], "--no-fold", "--warehouse", url)
    one_line(code, err, "S3 kept failing", "after 2 attempts", "whether it was written is unknown")
    assert record.injected == 2 and down.injected > 2  # (the read back, the state: every request after)
    assert not [k for k in keys(s3, "commands") if k.startswith("_log/")]
    assert all(not rows for rows in views(url).values())  # nothing visible
    # its files stay (orphans: its record might still have landed); the rerun commits its own
    scattered_run("extract", "extract", *clean["args"], "--no-fold")

    for command in ("merge", "compact"):
        with pytest.warns(PendingPartials) if command == "merge" else contextlib.nullcontext():
            before = views(url)  # the partials appended, pending (merge); folded (compact)
        with faulty.faults(Rule("500", method="PUT", path="/_log/")):
            code, _, err = run_cli(command, "--warehouse", url)
        one_line(code, err, "S3 kept failing")
        with pytest.warns(PendingPartials) if command == "merge" else contextlib.nullcontext():
            assert views(url) == before
        scattered_run(command, command)
        same_numbers(views(url), clean["views"], 1e-12)

    out = scattered_run("sql", "sql", "SELECT count(*) FROM inter_sim", "--format", "csv")
    assert int(out.split()[-1]) == len(clean["views"]["inter_sim"])
    with faulty.faults(Rule("reset-response", method="GET", path=r"list-type=2", nth=tuple(range(3, 99)))) as (rule,):
        code, out, err = run_cli("validate", "--warehouse", url)
    one_line(code, err, "S3 kept failing")
    assert rule.injected == 2
    with faulty.faults(Rule("503", method="GET", path="/tables/")):  # reading the files: not "damaged files"
        code, out, err = run_cli("validate", "--warehouse", url)
        one_line(code, err, "S3 kept failing")
        code, _, err = run_cli("sql", "SELECT * FROM inter_sim", "--warehouse", url)
        one_line(code, err, "AWS Error", "the S3 store kept failing")
    leases = [k for k in keys(s3, "commands") if k.startswith("_inflight/")]
    assert leases  # the failed extract's: the store went down before it could release it
    for key in leases:  # as its process would be after exiting (it ran in this one: live)
        lease = json.loads(s3["client"].get_object(Bucket=BUCKET, Key=f"faults-commands/{key}")["Body"].read())
        lease["pid_start"] += 1  # this pid, started at another time: proven gone
        s3["client"].put_object(Bucket=BUCKET, Key=f"faults-commands/{key}", Body=json.dumps(lease).encode())
    scattered_run("validate", "validate", "--fix", "--grace", "0")  # the failed commands' orphans quarantined
    left = keys(s3, "commands")
    assert not [k for k in left if k.startswith("_inflight/")] and [k for k in left if k.startswith("_quarantine/")]
    same_numbers(views(url), clean["views"], 1e-12)
    assert [k for k in keys(s3, "commands") if k.startswith("_log/")] == [
        f"_log/{n:020d}.json" for n in (1, 2, 3)]  # one record per commit: extract, merge, compact
    with faulty.faults():  # a command reads each committed object once (warehouse/storage/s3_reads.py)
        assert run_cli("validate", "--warehouse", url)[0] == 0
    reads = collections.Counter(p for m, p, _, _ in faulty.log if m == "GET" and "/tables/" in p)
    assert reads and set(reads.values()) == {1}, reads.most_common(3)
