"""A warehouse on S3 (`--warehouse s3://bucket/prefix`) against a real S3 API: moto's server on
127.0.0.1 (the session's, tests/conftest.py), with authentication on (wrong keys are refused as by AWS)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import polars as pl
import pytest

from common.errors import UserError
from conftest import ROOT, fork_popen, fork_run, run_cli, same_numbers, same_rows, views
from s3_faults import BUCKET, free_port


@pytest.fixture
def s3env(s3, monkeypatch):
    """The S3 variables set for in-process calls; S3 storages probed fresh."""
    from warehouse import storage

    for k, v in s3["env"].items():
        monkeypatch.setenv(k, v)
    storage._OPEN.clear()
    yield s3
    storage._OPEN.clear()


def keys(s3, prefix: str) -> list[str]:
    pages = s3["client"].get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/")
    return sorted(o["Key"] for p in pages for o in p.get("Contents", []))


def cli_proc(args, env_extra, timeout=300):
    """cli.py in its own process (exit code and stderr as a user sees them), forked from the fork server."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **env_extra}
    return fork_popen([sys.executable, str(ROOT / "cli.py"), *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def finish(p, timeout=300):
    out, err = p.communicate(timeout=timeout)
    return p.returncode, out, err


def all_views(wh) -> dict:
    from warehouse.query import connect, load_metrics

    con = connect(wh)
    out = {m.name: sorted(con.execute(f"SELECT * FROM {m.name}").fetchall(), key=repr) for m in load_metrics()}
    out["runs"] = sorted(con.execute("SELECT kind, checkpoint, source, shard, tokens FROM runs").fetchall(), key=repr)
    out["token_sums"] = con.execute("SELECT count(*), sum(n), sum(sum_sq) FROM token_sums").fetchall()
    con.close()
    return out


@pytest.fixture(scope="module")
def s3_wh(s3, single):
    """The `single` extract (two sources, --moments) written to S3 through the CLI."""
    from warehouse import storage

    url = f"s3://{BUCKET}/same"
    old = {k: os.environ.get(k) for k in s3["env"]}
    os.environ.update(s3["env"])
    storage._OPEN.clear()
    try:
        code, _, err = run_cli("extract", *single["args"], "--warehouse", url)
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        storage._OPEN.clear()
    assert code == 0, err
    return url


def test_extract_to_s3_equals_local_in_every_view(s3env, s3_wh, single, tmp_path):
    url = s3_wh
    assert keys(s3env, "same")  # really written to the bucket
    got, want = all_views(url), all_views(single["wh"])
    assert set(got) == set(want) and len(got) > 20
    for name in want:
        same_rows(got[name], want[name], name, 1e-12)  # the same computation (DuckDB's parallel sums: last bits)
    # sql, validate and report through the CLI
    code, out, err = run_cli("sql", "SELECT count(*) AS n FROM inter_sim", "--warehouse", url, "--format", "csv")
    assert code == 0 and out.splitlines()[1] == str(len(want["inter_sim"])), err
    code, _, err = run_cli("validate", "--warehouse", url)
    assert code == 0 and "ok" in err, err
    code, _, err = run_cli("report", "--warehouse", url, "--out", tmp_path / "report")
    assert code == 0, err
    local = tmp_path / "report-local"
    assert run_cli("report", "--warehouse", single["wh"], "--out", local)[0] == 0
    for csv in sorted(local.glob("*.csv")):  # the same rows; floats to DuckDB's parallel summation order (~1e-15)
        a, b = (pl.read_csv(f, infer_schema_length=None) for f in (tmp_path / "report" / csv.name, csv))
        assert a.columns == b.columns and a.height == b.height > 0, csv.name
        for c in a.columns:
            if a[c].dtype.is_float():
                assert ((a[c] - b[c]).abs() <= 1e-12 * b[c].abs().clip(lower_bound=1e-300)).all(), (csv.name, c)
            else:
                assert a[c].cast(pl.String).to_list() == b[c].cast(pl.String).to_list(), (csv.name, c)
    # views.sql for the DuckDB shell names the objects (for shells with httpfs)
    text = s3env["client"].get_object(Bucket=BUCKET, Key="same/views.sql")["Body"].read().decode()
    assert f"read_parquet(['s3://{BUCKET}/same/tables/" in text


def test_pull_to_a_local_copy_for_the_duckdb_shell(s3env, s3_wh, single, tmp_path):
    url = s3_wh
    copy = tmp_path / "copy"
    code, _, err = run_cli("pull", "--warehouse", url, "--to", copy)
    assert code == 0, err
    want = all_views(url)
    got = all_views(copy)
    for name in want:
        if name != "token_sums":  # the view-only copy leaves the per-partial vectors behind
            same_rows(got[name], want[name], name, 1e-12)
    q = "SELECT layer, inter_sim FROM inter_sim ORDER BY layer"
    shell = subprocess.run(["duckdb", "-init", str(copy / "views.sql"), "-csv", "-noheader", "-c", q],
                           capture_output=True, text=True, timeout=60)
    assert shell.returncode == 0, shell.stderr
    rows = [tuple(float(x) for x in line.split(",")) for line in shell.stdout.split()]
    from warehouse.query import sql

    ref = sql(q, url).rows()
    assert len(rows) == len(ref) > 0
    assert all(a[0] == b[0] and abs(a[1] - b[1]) <= 1e-12 * max(1, abs(b[1])) for a, b in zip(rows, ref))
    # the copy takes no new partials (its vectors stayed behind); a second pull into it is refused
    code, _, err = run_cli("extract", *single["args"], "--warehouse", copy)
    assert code == 2 and "compacted" in err
    code, _, err = run_cli("pull", "--warehouse", url, "--to", copy)
    assert code == 2 and "already a warehouse" in err
    # compaction on S3: the views stay, the per-partial vectors go
    assert run_cli("compact", "--warehouse", url)[0] == 0
    after = all_views(url)
    for name in want:
        if name != "token_sums":
            same_rows(after[name], want[name], name, 1e-12)
    assert not [k for k in keys(s3env, "same") if "/token_sums/" in k or "/token_vectors/" in k]


def test_two_concurrent_extracts_of_one_key_leave_one_copy(s3env, single, workdir):
    url = f"s3://{BUCKET}/race"
    args = ["extract", *single["args"], "--warehouse", url]
    procs = [cli_proc(args, s3env["env"]) for _ in range(2)]
    results = [finish(p) for p in procs]
    assert all(code == 0 for code, _, _ in results), [e[-2000:] for _, _, e in results]
    got = views(url)
    assert got["shards"] == [("main", "alpha", "1-of-1"), ("main", "beta", "1-of-1")]  # one entry per key
    same_numbers(got, single["views"])  # counted once (n exact), not twice
    records = [k for k in keys(s3env, "race") if "/_log/" in k]
    assert len(records) == 2  # both committed, one after the other (the second replaced the first)
    code, out, err = run_cli("validate", "--warehouse", url)
    assert code == 0, out + err  # the replaced copy's files were collected: no orphans


def test_kill_between_data_files_and_record_leaves_nothing_visible(s3env, single):
    url = f"s3://{BUCKET}/kill"  # killed when every data and merged file is uploaded, the record not yet
    code, _, err = finish(cli_proc(["extract", *single["args"], "--warehouse", url], {**s3env["env"], "ISO_FAULT": "merge"}))
    assert code != 0
    written = keys(s3env, url.rsplit("/", 1)[1])
    assert written and not any("/_log/" in k for k in written)  # data files uploaded, no commit record
    assert all(not rows for name, rows in views(url).items()), "a killed run is visible"
    code, out, _ = run_cli("validate", "--warehouse", url)
    assert code == 1 and "not listed in the manifest" in out
    assert run_cli("validate", "--warehouse", url, "--fix", "--grace", "0")[0] == 0  # quarantined, not deleted
    assert [k for k in keys(s3env, url.rsplit("/", 1)[1]) if "/tables/" in k and "/_quarantine/" not in k] == []
    assert [k for k in keys(s3env, url.rsplit("/", 1)[1]) if "/_quarantine/" in k]
    assert run_cli("extract", *single["args"], "--warehouse", url)[0] == 0  # the re-run completes
    same_numbers(views(url), single["views"])


def test_a_companion_torn_by_a_concurrent_rewrite_is_read_again(s3env, monkeypatch):
    """pyarrow reads an S3 object by a HEAD (its size) and ranged GETs: another writer's `replace` in between
    tears that read ("Parquet magic bytes not found"; seen once in two concurrent extracts of one key). A
    rewritable object (runs.parquet) is read again; a committed one never changes, so its first failure
    stands; a damaged companion is still an error after TORN_READS reads."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    from common.errors import UserError
    from warehouse.storage import open_storage

    st = open_storage(f"s3://{BUCKET}/torn")
    sink = io.BytesIO()
    pq.write_table(pa.table({"x": [1, 2, 3]}), sink)
    for rel in ("runs.parquet", "tables/t/one.parquet"):
        st.replace(rel, sink.getvalue())
    real, calls = pq.read_schema, []

    def torn(first_only):
        def read_schema(f, *a, **k):
            calls.append(1)
            if len(calls) == 1 or not first_only:
                raise pa.ArrowInvalid("Parquet magic bytes not found in footer")
            return real(f, *a, **k)
        return read_schema

    monkeypatch.setattr(pq, "read_schema", torn(True))
    assert st.read_schema("runs.parquet").names == ["x"] and len(calls) == 2  # torn once, then whole
    calls.clear()
    with pytest.raises(UserError, match="magic bytes"):
        st.read_schema("tables/t/one.parquet")  # committed once: not read again
    assert len(calls) == 1
    calls.clear()
    monkeypatch.setattr(pq, "read_schema", torn(False))
    with pytest.raises(UserError, match="magic bytes"):
        st.read_schema("runs.parquet")
    assert len(calls) == st.TORN_READS


def test_create_if_absent_has_one_winner(s3env):
    from warehouse.storage import open_storage

    st = open_storage(f"s3://{BUCKET}/cas")
    wins = []
    barrier = threading.Barrier(8)

    def race(i):
        barrier.wait()
        wins.append((i, st.create_if_absent("_log/00000000000000000001.json", f'{{"writer": {i}}}'.encode())))

    threads = [threading.Thread(target=race, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, ok in wins if ok]
    assert len(wins) == 8 and len(winners) == 1
    assert json.loads(st.read_bytes("_log/00000000000000000001.json")) == {"writer": winners[0]}


def test_store_failing_at_the_commit_record_is_one_line_and_leaves_nothing(s3env, single, monkeypatch):
    from warehouse.storage import S3Storage

    url = f"s3://{BUCKET}/fault"

    def unreachable(self, rel, data):  # the store goes away between the data files and the record
        raise UserError(f"{self.url}: cannot reach the S3 endpoint {self.endpoint} (check AWS_ENDPOINT_URL and the network)")

    monkeypatch.setattr(S3Storage, "create_if_absent", unreachable)
    code, _, err = run_cli("extract", *single["args"], "--warehouse", url)
    assert code == 2 and err.strip().count("\n") == 0 and "cannot reach" in err, err
    assert keys(s3env, "fault") == []  # every uploaded file removed again


BAD = [
    ("unreachable endpoint", {"AWS_ENDPOINT_URL": "http://127.0.0.1:{closed}", "ISO_S3_MAX_ATTEMPTS": "2"},  # (5 by default)
     f"s3://{BUCKET}/x", "cannot reach"),
    ("missing bucket", {}, "s3://no-such-bucket-here/x", "does not exist"),
    ("wrong credentials", {"AWS_SECRET_ACCESS_KEY": "wrong"}, f"s3://{BUCKET}/x", "access denied"),
    ("unknown key id", {"AWS_ACCESS_KEY_ID": "AKIANOSUCHKEY0000000"}, f"s3://{BUCKET}/x", "access denied"),
]


def test_bad_s3_input_is_one_line_and_writes_nothing(s3, single):
    """Each case through `sql` and `extract` in their own processes (all at once)."""
    runs = []
    for case, env, url, message in BAD:
        env = {**s3["env"], **{k: v.format(closed=free_port()) for k, v in env.items()}}
        for args in (["sql", "SELECT 1"], ["extract", *single["args"]]):
            runs.append((case, message, cli_proc([*args, "--warehouse", url], env)))
    for case, message, p in runs:
        code, out, err = finish(p, timeout=120)
        assert code == 2, (case, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], (case, err)
    assert keys(s3, "x") == []


def test_read_only_keys_can_query_but_not_write(s3, s3_wh, single, monkeypatch):
    """A user whose keys may only read (s3:GetObject, s3:ListBucket; moto names HEAD bucket's permission
    s3:HeadBucket, which AWS folds into s3:ListBucket): every view answers, even with the
    companions behind the log (they are caches, not rewritten then); an extract is refused in one line."""
    import boto3

    from warehouse import storage

    iam = boto3.client("iam", endpoint_url=s3["endpoint"], region_name="us-east-1",
                       aws_access_key_id=s3["env"]["AWS_ACCESS_KEY_ID"],
                       aws_secret_access_key=s3["env"]["AWS_SECRET_ACCESS_KEY"])
    iam.create_user(UserName="reader")
    key = iam.create_access_key(UserName="reader")["AccessKey"]
    iam.put_user_policy(UserName="reader", PolicyName="read", PolicyDocument=json.dumps(
        {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": ["s3:GetObject", "s3:ListBucket", "s3:HeadBucket"],
                                                 "Resource": "*"}]}))
    s3["client"].delete_object(Bucket=BUCKET, Key="same/views.sql")  # companions behind the log
    for k, v in s3["env"].items():
        monkeypatch.setenv(k, v)
    storage._OPEN.clear()
    writer = storage.open_storage(f"s3://{BUCKET}/keys-writer")
    assert writer.create_if_absent("marker", b"x")  # boto3 (the conditional PUT) used with the full keys first
    for k, v in {**s3["env"], "AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}.items():
        monkeypatch.setenv(k, v)
    storage._OPEN.clear()
    try:
        with pytest.raises(UserError, match="access denied"):  # each storage's own keys, not the first ones boto3 saw
            storage.open_storage(f"s3://{BUCKET}/keys-reader").create_if_absent("marker", b"x")
        got = views(s3_wh)
        assert got["inter_sim"] and got["shards"] == single["views"]["shards"]
        code, _, err = run_cli("extract", *single["args"], "--warehouse", f"s3://{BUCKET}/readonly")
        assert code == 2 and err.count("\n") == 1 and "access denied" in err, err
        assert keys(s3, "readonly") == []
    finally:
        storage._OPEN.clear()


def test_views_on_s3_bind_without_listing_or_opening_the_partials(s3env, tmp_path):
    """The same on S3 (moto): each table is a pyarrow dataset made from the listed paths and the
    schema alone — every partial's token_sums object but the first deleted, connect and the merged
    views still work (a guard: this held before the local fix too)."""
    from test_scale import first_bound, many_partials  # (here, not in test_scale.py: one moto server a session)
    from warehouse.query import connect
    from warehouse.storage import open_storage

    url = f"s3://{BUCKET}/scale-startup"
    entries = many_partials(url, 24)
    con = connect(url)
    before = con.execute("SELECT * FROM avg_intra_sim ORDER BY ALL").fetchall()
    total = con.execute("SELECT count(*) FROM token_sums").fetchone()
    con.close()
    assert total[0] > 0
    st = open_storage(url)
    keep = first_bound(url)
    for e in entries:
        if e["files"]["token_sums"] != keep:
            st.delete(e["files"]["token_sums"])
    con = connect(url)
    assert con.execute("SELECT 1").fetchone() == (1,)
    assert con.execute("SELECT * FROM avg_intra_sim ORDER BY ALL").fetchall() == before
    con.close()


def test_s3_lease_checksums_and_quarantine(s3env, tmp_path):
    """(Here, not in test_repair.py: one moto server a session.)"""
    if str(ROOT / "bench") not in sys.path:
        sys.path.insert(0, str(ROOT / "bench"))

    import numpy as np
    from bench_query import write_partial
    from warehouse import merge, store
    from warehouse.validate import validate

    url = f"s3://{BUCKET}/repair"
    rng = np.random.default_rng(3)
    for shard in ("1-of-2", "2-of-2"):
        merge.commit(url, [write_partial(url, "m", "c", "s0", shard, 3, 40, 8, rng, chunk=17)])
    ks = keys(s3env, "repair")
    assert not [k for k in ks if "/_inflight/" in k]  # leases of committed runs removed
    assert validate(url) == []
    # an orphan of a dead writer: its lease names a pid that is gone
    client = s3env["client"]
    orphan = "repair/tables/token_sums/model=m/checkpoint=c/source=s0/shard=3-of-3/20260101T000000-deadbeef.parquet"
    client.put_object(Bucket=BUCKET, Key=orphan, Body=b"orphan")
    client.put_object(Bucket=BUCKET, Key="repair/_inflight/20260101T000000-deadbeef.json",
                      Body=json.dumps({"run_id": "20260101T000000-deadbeef", "host": store.HOST, "pid": 2 ** 22 + 7,
                                       "heartbeat": time.time()}).encode())
    # a live lease (this process) protects its run's orphan
    live = "repair/tables/token_sums/model=m/checkpoint=c/source=s0/shard=4-of-4/20260101T000000-0badcafe.parquet"
    client.put_object(Bucket=BUCKET, Key=live, Body=b"in flight")
    client.put_object(Bucket=BUCKET, Key="repair/_inflight/20260101T000000-0badcafe.json",
                      Body=json.dumps({"run_id": "20260101T000000-0badcafe", "host": store.HOST, "pid": os.getpid(),
                                       "heartbeat": time.time()}).encode())
    env = {**os.environ, **s3env["env"], "ISO_FAULT": "move:1"}
    proc = fork_run([sys.executable, str(ROOT / "cli.py"), "validate", "--warehouse", url, "--fix", "--grace", "0"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]  # copied into the quarantine, original not yet deleted
    ks = keys(s3env, "repair")
    assert orphan in ks and any(k.endswith(orphan.split("repair/", 1)[1]) and "/_quarantine/" in k for k in ks)
    assert validate(url, fix=True, grace_s=0) == []
    ks = keys(s3env, "repair")
    assert orphan not in ks and live in ks
    assert any("/_quarantine/" in k and k.endswith("20260101T000000-deadbeef.parquet") for k in ks)
    # a changed object is reported, and a merged one rebuilt by --fix
    m = store.read_manifest(url)
    rel = next(e["files"]["token_stats"] for e in m["entries"].values() if e["kind"] == "merged")
    body = client.get_object(Bucket=BUCKET, Key=f"repair/{rel}")["Body"].read()
    client.put_object(Bucket=BUCKET, Key=f"repair/{rel}", Body=body[:-9] + bytes([body[-9] ^ 1]) + body[-8:])
    assert any(rel in p for p in validate(url))
    assert validate(url, fix=True, grace_s=0) == []
    client.delete_object(Bucket=BUCKET, Key=live)
    client.delete_object(Bucket=BUCKET, Key="repair/_inflight/20260101T000000-0badcafe.json")


def test_s3_appended_partials_fold_once_and_equal_folding_commits(s3env):
    """On S3 as on a disk: partials appended without a fold are pending (runs.folded false), one
    fold_pending folds them, and every view equals commits that fold (the same partials)."""
    if str(ROOT / "bench") not in sys.path:
        sys.path.insert(0, str(ROOT / "bench"))
    import warnings

    import numpy as np
    from bench_query import write_partial
    from warehouse import merge, store
    from warehouse.query import PendingPartials, connect

    a, b = f"s3://{BUCKET}/appended", f"s3://{BUCKET}/folded"
    for url, fold in ((a, False), (b, True)):
        rng = np.random.default_rng(8)
        for source, shard in (("s0", "1-of-2"), ("s0", "2-of-2"), ("s1", "1-of-1")):
            merge.commit(url, [write_partial(url, "m", "c", source, shard, 3, 40, 8, rng, chunk=17)], fold=fold)
    assert len(merge.pending(store.read_manifest(a))) == 3
    with pytest.warns(PendingPartials):
        con = connect(a)
    assert con.execute("SELECT count(*) FROM runs WHERE NOT folded").fetchone() == (3,)
    con.close()
    assert merge.fold_pending(a) == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error", PendingPartials)
        va, vb = all_views(a), all_views(b)
    (n, total, sq), = va.pop("token_sums")  # the partials themselves; DuckDB's float sum is in any order
    assert vb.pop("token_sums") == [(n, total, pytest.approx(sq, rel=1e-12))]
    assert va == vb
