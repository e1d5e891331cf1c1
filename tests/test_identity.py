"""Identity is content, not names; queries are read-only; the one-line outcomes of issue 34's list.

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
import signal
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

import tiny
from conftest import ROOT, run_cli, same_numbers, views

ARGS = ["--max-length", "32", "--batch-size", "2"]


def tree(root: Path) -> dict[str, str]:
    """Every file and directory under root: its bytes' hash (a directory: 'dir')."""
    out = {}
    for p in sorted(root.rglob("*")):
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


def test_weights_fingerprint_reads_content_not_names(tmp_path):
    from extract.models import content_fingerprint

    big = os.urandom((1 << 20) + 20 * (1 << 16) + 5)  # larger than what is read whole: sampled
    for d in ("x", "y", "z"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "model.safetensors").write_bytes(big)
    flipped = bytearray(big)
    flipped[(1 << 20) + 3] ^= 1  # inside the first sampled block
    (tmp_path / "z" / "model.safetensors").write_bytes(bytes(flipped))
    assert content_fingerprint(tmp_path / "x") == content_fingerprint(tmp_path / "y")
    assert content_fingerprint(tmp_path / "x") != content_fingerprint(tmp_path / "z")


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
    from warehouse.query import connect

    before, outside = tree(wh), tree(tmp_path)
    con = connect(wh)
    for q in _forbidden(wh, tmp_path)[2:]:
        if q.startswith(("CREATE TABLE", "SELECT 1;", "EXPLAIN")):
            continue  # in-memory tables and the like: harmless on a connection (sql() refuses them)
        with pytest.raises(duckdb.Error):
            con.execute(q)
    assert con.execute("SELECT count(*) FROM inter_sim").fetchone()[0] > 0  # the views still read
    con.close()
    assert tree(wh) == before and tree(tmp_path) == outside


def test_python_sql_refuses_writes(wh, tmp_path):
    from isotropy_warehouse.errors import UserError
    from warehouse.query import sql

    with pytest.raises(UserError, match="read-only"):
        sql(f"COPY (SELECT 1) TO '{tmp_path}/x.csv'", wh)
    assert not (tmp_path / "x.csv").exists()
    assert sql("SELECT count(*) AS n FROM inter_sim", wh)["n"][0] > 0
