"""Identity is content, not names; queries are read-only; conflicts refused in one line.

A partial covers the documents of its shard (index ≡ I − 1 mod N): re-sharding a source replaces
what the new shard covers and is refused (one line, nothing written) where it only overlaps; two
different weights under one model name are refused, the same weights from another path accepted;
`sql` and `connect()` cannot create, change or delete a file.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

import tiny
from conftest import ROOT, fork_run, run_cli, same_numbers, views

ARGS = ["--max-length", "32", "--batch-size", "2"]


def tree(root: Path) -> dict[str, str]:
    """Every file and directory under root: its bytes' hash (a directory: 'dir'); the writers' lease
    folder `_inflight/` when empty (bookkeeping: a lease is removed, its folder stays) is left out."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.name == "_inflight" and p.is_dir() and not any(p.iterdir()):
            continue
        out[str(p.relative_to(root))] = "dir" if p.is_dir() else hashlib.blake2b(p.read_bytes()).hexdigest()
    return out


def one_line_error(code: int, err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.fixture(scope="module")
def model(model_factory):
    return model_factory("gpt_neox", tied=False)


def extract(model, wh, *extra, source=None):
    return run_cli("extract", "--model", model, "--source", source, *ARGS, "--warehouse", wh, *extra)


def n_of(wh) -> list:
    from warehouse.query import connect

    con = connect(wh)
    rows = con.execute("SELECT source, layer, n FROM layer_totals ORDER BY source, layer").fetchall()
    con.close()
    return rows


# ---------------------------------------------------------------- shards: coverage by definition


def test_shard_coverage_matches_the_documents_it_names():
    """covers/overlaps against the sets of document indices shard I of N takes (index mod N = I − 1)."""
    from warehouse.merge import covers, overlaps

    def docs(i, n, total):
        return {d for d in range(total) if d % n == i - 1}

    shards = [(i, n) for n in range(1, 7) for i in range(1, n + 1)]
    for a in shards:
        for b in shards:
            total = 2 * math.lcm(a[1], b[1])  # every residue pattern occurs
            A, B = docs(*a, total), docs(*b, total)
            assert covers(a, b) == (B <= A), (a, b)
            assert overlaps(a, b) == bool(A & B), (a, b)


@pytest.fixture(scope="module")
def clean(model, sources, tmp_path_factory):
    """Clean warehouses: alpha as 1/1, and as 1/2 + 2/2."""
    d = tmp_path_factory.mktemp("clean")
    src = f"alpha={sources['alpha']}"
    assert extract(model, d / "whole", source=src)[0] == 0
    assert extract(model, d / "halves", "--shard", "1/2", source=src)[0] == 0
    assert extract(model, d / "halves", "--shard", "2/2", source=src)[0] == 0
    return {"whole": views(d / "whole"), "halves": views(d / "halves"), "n": n_of(d / "whole")}


def test_reshard_whole_to_halves_replaces_and_never_double_counts(model, sources, clean, tmp_path):
    wh, src = tmp_path / "wh", f"alpha={sources['alpha']}"
    assert extract(model, wh, source=src)[0] == 0
    before = tree(wh)
    code, _, err = extract(model, wh, "--shard", "1/2", source=src)  # overlaps 1/1 without covering it
    line = one_line_error(code, err)
    assert "alpha" in line and "shard 1/1" in line and "--replace" in line
    assert tree(wh) == before  # refused before any forward pass: nothing written
    assert extract(model, wh, "--shard", "1/2", "--replace", source=src)[0] == 0  # 1/1 dropped in the same record
    assert extract(model, wh, "--shard", "2/2", source=src)[0] == 0
    assert n_of(wh) == clean["n"]  # not doubled
    same_numbers(views(wh), clean["halves"])
    assert views(wh)["shards"] == clean["halves"]["shards"]


def test_reshard_halves_to_whole_replaces_both(model, sources, clean, tmp_path):
    wh, src = tmp_path / "wh", f"alpha={sources['alpha']}"
    assert extract(model, wh, "--shard", "1/2", source=src)[0] == 0
    assert extract(model, wh, "--shard", "2/2", source=src)[0] == 0
    assert extract(model, wh, source=src)[0] == 0  # 1/1 covers 1/2 and 2/2: both replaced
    assert n_of(wh) == clean["n"]
    same_numbers(views(wh), clean["whole"])
    assert views(wh)["shards"] == clean["whole"]["shards"]
    assert run_cli("validate", "--warehouse", wh)[0] == 0


def test_overlapping_shards_of_another_sharding_are_refused(model, sources, tmp_path):
    """1/2 then 1/3: they share documents 0, 6, 12, …; neither covers the other."""
    wh, src = tmp_path / "wh", f"alpha={sources['alpha']}"
    assert extract(model, wh, "--shard", "1/2", source=src)[0] == 0
    before = tree(wh)
    line = one_line_error(*extract(model, wh, "--shard", "1/3", source=src)[::2])
    assert "shard 1/2" in line
    assert tree(wh) == before
    assert extract(model, wh, "--shard", "2/4", source=src)[0] == 0  # disjoint from 1/2: added


def test_a_changed_source_file_is_refused_unless_it_replaces_every_shard(model, sources, tmp_path):
    wh = tmp_path / "wh"
    changed = tmp_path / "alpha.txt"
    changed.write_text(sources["alpha"].read_text() + "one more document about something else\n")
    assert extract(model, wh, "--shard", "1/2", source=f"alpha={sources['alpha']}")[0] == 0
    before = tree(wh)
    line = one_line_error(*extract(model, wh, "--shard", "2/2", source=f"alpha={changed}")[::2])
    assert "another version" in line and "alpha" in line
    assert tree(wh) == before
    assert extract(model, wh, source=f"alpha={changed}")[0] == 0  # the whole source again: replaces


# ---------------------------------------------------------------- same-named models


def test_same_name_other_weights_refused_same_weights_elsewhere_accepted(sources, tmp_path):
    a = tiny.make_model(tmp_path / "a" / "model", "gpt_neox", False, seed=0)
    b = tiny.make_model(tmp_path / "b" / "model", "gpt_neox", False, seed=1)
    c = tmp_path / "c" / "model"
    shutil.copytree(a, c)
    wh, src = tmp_path / "wh", f"alpha={sources['alpha']}"
    assert extract(a, wh, source=src)[0] == 0
    before = tree(wh)
    line = one_line_error(*extract(b, wh, source=f"beta={sources['beta']}")[::2])
    assert "other weights" in line and "--name" in line and "model@main" in line
    assert tree(wh) == before
    assert extract(c, wh, source=f"beta={sources['beta']}")[0] == 0  # the same bytes from another path
    assert extract(b, wh, "--name", "model-b", source=src)[0] == 0
    from warehouse.query import connect

    con = connect(wh)
    got = con.execute("SELECT model, source, shard FROM runs WHERE kind = 'data' ORDER BY ALL").fetchall()
    con.close()
    assert got == [("model", "alpha", "1-of-1"), ("model", "beta", "1-of-1"), ("model-b", "alpha", "1-of-1")]


# ---------------------------------------------------------------- read-only queries


@pytest.fixture(scope="module")
def wh(model, sources, tmp_path_factory):
    wh = tmp_path_factory.mktemp("ro") / "wh"
    assert extract(model, wh, source=f"alpha={sources['alpha']}")[0] == 0
    return wh


def _forbidden(wh: Path, tmp: Path) -> list[str]:
    listed = next((wh / "tables" / "token_stats").rglob("*.parquet"))
    return [
        f"COPY (SELECT 1 AS x) TO '{wh}/_log/00000000000000000009.json' (FORMAT json)",
        f"COPY (SELECT 42 AS x) TO '{listed}' (FORMAT parquet, USE_TMP_FILE false)",
        f"COPY (SELECT 1 AS x) TO '{tmp}/out.csv'",
        f"ATTACH '{tmp}/db.duckdb'",
        f"EXPORT DATABASE '{tmp}/export'",
        "INSTALL httpfs",
        "LOAD httpfs",
        "SET enable_external_access = true",
        "CREATE TABLE t AS SELECT 1",
        f"SELECT 1; COPY (SELECT 1) TO '{tmp}/two.csv'",
        f"EXPLAIN ANALYZE COPY (SELECT 1) TO '{tmp}/explained.csv'",
        "SELECT * FROM read_csv('/etc/passwd')",
        f"SELECT * FROM read_text('{wh}/manifest.json')",
    ]


def test_sql_refuses_every_writing_statement_in_one_line(wh, tmp_path):
    before, outside = tree(wh), tree(tmp_path)
    for q in _forbidden(wh, tmp_path):
        code, out, err = run_cli("sql", q, "--warehouse", wh)
        one_line_error(code, err)
        assert tree(wh) == before, q
        assert tree(tmp_path) == outside, q
    code, out, _ = run_cli("sql", "SELECT count(*) AS n FROM inter_sim", "--warehouse", wh, "--format", "csv")
    assert code == 0 and out.splitlines()[1] != "0"
    assert run_cli("sql", "EXPLAIN SELECT * FROM inter_sim", "--warehouse", wh)[0] == 0


def test_connect_connections_cannot_write_reach_files_or_load_extensions(wh, tmp_path):
    from common.errors import UserError
    from warehouse.query import connect

    before, outside = tree(wh), tree(tmp_path)
    con = connect(wh)
    for q in _forbidden(wh, tmp_path):  # checked statements (UserError), DuckDB's lock behind them
        with pytest.raises((UserError, duckdb.Error)):
            con.execute(q)
        with pytest.raises(duckdb.Error):  # the lock alone, under the checks: all but the in-place overwrite
            if "USE_TMP_FILE false" not in q and not q.startswith(("CREATE TABLE", "SELECT 1;", "EXPLAIN")):
                con._raw.execute(q)
            else:
                raise duckdb.Error("not covered by the lock alone")
    assert con.execute("SELECT count(*) FROM inter_sim").fetchone()[0] > 0  # the views still read
    con.close()
    assert tree(wh) == before and tree(tmp_path) == outside


def test_no_connect_connection_path_can_overwrite_a_listed_file(wh, tmp_path):
    """DuckDB's allowed_paths grants writing too: every way through the API that `connect()` hands
    out — statements, cursors, duplicates, relations' writers, relation.query — is refused."""
    from common.errors import UserError
    from warehouse.query import connect

    listed = next((wh / "tables" / "token_stats").rglob("*.parquet"))
    copy = f"COPY (SELECT 42 AS x) TO '{listed}' (FORMAT parquet, USE_TMP_FILE false)"
    before = tree(wh)
    con = connect(wh)
    attempts = [
        lambda: con.execute(copy), lambda: con.sql(copy), lambda: con.query(copy),
        lambda: con.from_query(copy), lambda: con.executemany(copy, [[]]),
        lambda: con.execute(duckdb.extract_statements(copy)[0]),
        lambda: con.execute(f"SELECT 1; {copy}"),
        lambda: con.cursor().execute(copy), lambda: con.duplicate().sql(copy),
        lambda: con.execute("SELECT 1").execute(copy),  # execute returns the (checked) connection
        lambda: con.cursor().cursor().from_query(copy),
        lambda: con.sql("SELECT 1").query("t", copy),
        lambda: con.sql("SELECT 42 AS x").filter("x > 0").write_parquet(str(listed)),
        lambda: con.sql("SELECT 42 AS x").to_parquet(str(listed)),
        lambda: con.table("token_stats").to_csv(str(listed)),
        lambda: con.sql("SELECT 42 AS x").write_csv(str(listed)),
        lambda: con.sql("SELECT 42 AS x").to_table("t"),
        lambda: con.read_parquet(str(tmp_path / "nowhere.parquet")),
        lambda: con.read_csv("/etc/passwd"),
        lambda: con.register_filesystem(None),
        lambda: con.execute("CREATE TABLE t AS SELECT 1"),
    ]
    for i, attempt in enumerate(attempts):
        with pytest.raises((UserError, duckdb.Error)):
            attempt()
        assert tree(wh) == before, i
    # reading still works, as a DuckDBPyConnection would
    assert con.execute("SELECT count(*) FROM inter_sim").fetchall()[0][0] > 0
    assert con.execute("SELECT count(*) AS n FROM runs WHERE kind = ?", ["data"]).fetchall() == [(1,)]
    assert con.sql("SELECT count(*) AS n FROM runs WHERE kind = $k", params={"k": "data"}).pl()["n"][0] == 1
    assert con.sql("SELECT * FROM inter_sim").filter("layer >= 0").order("layer").pl().height > 0
    assert len(con.table("layer_totals").df()) > 0 and "layer" in con.sql("SELECT layer FROM inter_sim").columns
    assert con.cursor().execute("SELECT 1").fetchall() == [(1,)]
    assert con.sql("SELECT 2 AS x").query("t", "SELECT x + 1 FROM t").fetchall() == [(3,)]
    con.close()
    with connect(wh) as c2:
        assert c2.execute("EXPLAIN SELECT * FROM inter_sim").fetchall()
    assert tree(wh) == before


def test_python_sql_refuses_writes(wh, tmp_path):
    from common.errors import UserError
    from warehouse.query import sql

    with pytest.raises(UserError, match="read-only"):
        sql(f"COPY (SELECT 1) TO '{tmp_path}/x.csv'", wh)
    assert not (tmp_path / "x.csv").exists()
    assert sql("SELECT count(*) AS n FROM inter_sim", wh)["n"][0] > 0


# ---------------------------------------------------------------- one line, not a traceback


def test_report_with_a_missing_listed_file_is_one_line(model, sources, tmp_path, monkeypatch):
    """A listed file gone: `report` and `sql` say so in one line (checked before DuckDB opens anything),
    and so do the queries of a connection opened before it went (the views bind when read, under the lock)."""
    import warehouse.query
    from common.errors import UserError
    from extract.api import headlines
    from warehouse.query import connect, duckdb_error_line

    wh = tmp_path / "wh"
    assert extract(model, wh, source=f"alpha={sources['alpha']}")[0] == 0
    gone = next((wh / "tables" / "layer_totals").rglob("*.parquet"))  # read by inter_sim
    kept = gone.read_bytes()

    def connect_then_lose_it(*args, **kw):
        con = connect(*args, **kw)
        gone.unlink()
        return con

    monkeypatch.setattr(warehouse.query, "connect", connect_then_lose_it)
    with pytest.raises(duckdb.Error) as raised:
        warehouse.query.connect(wh).execute("SELECT * FROM inter_sim").fetchall()
    line = duckdb_error_line(raised.value)
    assert "listed in the manifest but missing" in line and "layer_totals" in line, line
    gone.write_bytes(kept)
    with pytest.raises(UserError, match=r"layer_totals.*listed in the manifest but missing"):
        headlines(wh, "m", "c")  # (its connection made, then the file gone)
    monkeypatch.undo()
    gone.write_bytes(kept)
    next((wh / "tables" / "token_stats").rglob("*.parquet")).unlink()
    for args in (("report", "--out", tmp_path / "rep"), ("sql", "SELECT * FROM intra_sim")):
        line = one_line_error(*run_cli(*args, "--warehouse", wh)[::2])
        assert "listed in the manifest but missing" in line and "token_stats" in line


def _jsonl(path: Path, texts: list[str]) -> Path:
    import json

    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def test_a_lone_surrogate_escape_is_one_line_or_counted(model, tmp_path):
    src = tmp_path / "s.jsonl"
    src.write_text('{"text": "a fine line of text"}\n{"text": "bad \\ud800 escape here"}\n{"text": "more text"}\n')
    wh = tmp_path / "wh"
    line = one_line_error(*extract(model, wh, source=f"s={src}")[::2])
    assert f"{src}:2" in line and "surrogate" in line
    assert not (wh / "_log").exists()
    code, _, err = extract(model, wh, "--encoding-errors", "skip", source=f"s={src}")
    assert code == 0, err
    from warehouse.query import connect

    con = connect(wh)
    assert con.execute("SELECT documents, stats FROM runs WHERE kind = 'data'").fetchone()[0] == 2
    con.close()


def test_a_missing_tokenizer_is_named(model, sources, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in model.iterdir():
        if f.name.endswith((".safetensors", "config.json")) and not f.name.startswith("tokenizer"):
            shutil.copy(f, bare / f.name)
    line = one_line_error(*extract(bare, tmp_path / "wh", source=f"alpha={sources['alpha']}")[::2])
    assert "tokenizer" in line and "no tokens to process" not in line


def test_a_text_column_that_is_not_text_is_named(model, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path / "ints.parquet"
    pq.write_table(pa.table({"text": [1, 2, 3]}), src)
    line = one_line_error(*extract(model, tmp_path / "wh", source=f"n={src}")[::2])
    assert "'text' holds int64, not text" in line


# ---------------------------------------------------------------- signals and failures after the record


def _cli(args, action=None, fault=None, timeout=300, real=False):
    """`python cli.py ARGS` in a process of its own (forked from the tests' fork server; `real`: a fresh
    interpreter), with ISO_FAULT=fault and ISO_FAULT_ACTION=action."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if fault:
        env.update(ISO_FAULT=fault, ISO_FAULT_ACTION=action)
    return (subprocess.run if real else fork_run)([sys.executable, str(ROOT / "cli.py"), *map(str, args)],
                                                 capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def _args(model, sources, wh):
    return ["extract", "--model", model, "--source", f"alpha={sources['alpha']}", "--source",
            f"beta={sources['beta']}", *ARGS, "--warehouse", wh]


def _lines(err: str) -> list[str]:
    return [line for line in err.replace("\r", "\n").splitlines() if line.startswith(("error:", "warning:"))]


def test_sigint_during_extract_is_one_line_exit_130_and_leaves_nothing(model, sources, tmp_path):
    wh = tmp_path / "wh"
    # Ctrl-C at the 3rd forward pass (after the params), in a fresh interpreter as a user starts it (the
    # other signal and kill tests fork from the tests' fork server, which emulates this exit)
    r = _cli(_args(model, sources, wh), "int", "forward:3", real=True)
    assert r.returncode == 130, r.stderr
    assert "terminate called" not in r.stderr and "Traceback" not in r.stderr
    assert _lines(r.stderr) == [f"error: interrupted: nothing of {model.name}@main was committed"]
    assert not wh.exists() or tree(wh) == {}  # no file, no empty partition folder


def test_failure_after_model_load_leaves_no_empty_folders(model, tmp_path):
    src = _jsonl(tmp_path / "blank.jsonl", ["   ", "\t"])  # no tokens: fails after the parameter tables
    wh = tmp_path / "wh"
    line = one_line_error(*extract(model, wh, source=f"b={src}")[::2])
    assert "no tokens to process" in line
    assert not wh.exists() or tree(wh) == {}


def test_sigint_after_the_record_says_the_commit_landed(model, sources, tmp_path, clean_two):
    wh = tmp_path / "wh"
    r = _cli(_args(model, sources, wh), "int", "views")  # after the record, before the companions
    assert r.returncode == 130, r.stderr
    assert _lines(r.stderr) == [f"error: interrupted after {model.name}@main was committed (generation 1); its data is in "
                                "the warehouse (views.sql, runs.parquet and manifest.json are rewritten by the next "
                                "query)"]
    same_numbers(views(wh), clean_two)


def test_disk_full_after_the_record_is_a_warning_that_the_commit_landed(model, sources, tmp_path, clean_two):
    wh = tmp_path / "wh"
    r = _cli(_args(model, sources, wh), "enospc", "views")
    assert r.returncode == 0, r.stderr
    (line,) = _lines(r.stderr)
    assert line.startswith(f"warning: {model.name}@main was committed (generation 1), but a step after its record failed "
                           "([Errno 28] No space left on device)")
    same_numbers(views(wh), clean_two)
    assert run_cli("validate", "--warehouse", wh)[0] == 0


@pytest.fixture(scope="module")
def clean_two(model, sources, tmp_path_factory):
    wh = tmp_path_factory.mktemp("two") / "wh"
    assert run_cli(*_args(model, sources, wh))[0] == 0
    return views(wh)


def test_a_sweep_file_whose_shards_changed_never_double_counts(model, sources, clean, tmp_path):
    wh, config = tmp_path / "wh", tmp_path / "sweep.toml"

    def sweep(shards: int, extra: str = ""):
        config.write_text(f'warehouse = "{wh}"\nmodels = ["{model}"]\nshards = {shards}\n\n[sources]\n'
                          f'alpha = "{sources["alpha"]}"\n\n[settings]\nmax_length = 32\nbatch-size = 2\n{extra}')
        return run_cli("sweep", config, "--no-compact")  # a compacted checkpoint takes no new partial at all

    assert sweep(1)[0] == 0
    before = tree(wh)
    code, _, err = sweep(2)  # 1/2 overlaps 1/1: refused, nothing written (the plan's line comes first)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "shard 1/1" in errors[0] and "replace = true" in errors[0], err
    assert tree(wh) == before
    code, _, err = sweep(2, "replace = true\n")
    assert code == 0, err
    assert n_of(wh) == clean["n"]
    same_numbers(views(wh), clean["halves"])
    assert sweep(1)[0] == 0  # back to 1/1: it covers both halves
    assert n_of(wh) == clean["n"] and views(wh)["shards"] == clean["whole"]["shards"]
