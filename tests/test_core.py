"""The core views against their definitions, on tiny GPT-NeoX models (tied and untied),
two sources, a 2-way shard split and an identical re-run."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

import reference as ref
from common.errors import UserError
from conftest import run_cli
from warehouse.query import connect, load_metrics, sql as polars_sql

MAXLEN = 32


@pytest.fixture(scope="session")
def core(workdir, sources, model_factory):
    wh = workdir / "core-wh"
    untied = model_factory("gpt_neox", tied=False)
    tied = model_factory("gpt_neox", tied=True)
    common = ["--warehouse", wh, "--max-length", MAXLEN, "--batch-size", 4]
    a, b = f"alpha={sources['alpha']}", f"beta={sources['beta']}"
    for args in (["--source", a, "--shard", "1/2"], ["--source", a, "--shard", "2/2"],
                 ["--source", b], ["--source", a, "--shard", "1/2"]):  # the last: an identical re-run
        code, _, err = run_cli("extract", "--model", untied, *args, *common)
        assert code == 0, err
    code, _, err = run_cli("extract", "--model", tied, "--source", a, "--source", b, *common)
    assert code == 0, err
    texts = {"alpha": ref.source_texts(sources["alpha"]), "beta": ref.source_texts(sources["beta"])}
    states = {}
    for name, path in (("gpt_neox-untied", untied), ("gpt_neox-tied", tied)):
        states[name] = {
            "all": ref.hidden_states(str(path), texts["alpha"] + texts["beta"], MAXLEN),
            "alpha": ref.hidden_states(str(path), texts["alpha"], MAXLEN),
            "beta": ref.hidden_states(str(path), texts["beta"], MAXLEN),
        }
    return {"wh": wh, "states": states, "paths": {"gpt_neox-untied": untied, "gpt_neox-tied": tied}}


def rows(wh, query):
    con = connect(wh)
    try:
        rel = con.sql(query)
        return [dict(zip(rel.columns, r)) for r in rel.fetchall()]
    finally:
        con.close()


MODELS = ["gpt_neox-untied", "gpt_neox-tied"]


@pytest.mark.parametrize("model", MODELS)
def test_inter_sim_equals_pairwise_cosines(core, model):
    got = {r["layer"]: r for r in rows(core["wh"], f"SELECT * FROM inter_sim WHERE model = '{model}'")}
    want = ref.inter_sim(core["states"][model]["all"])
    assert sorted(got) == sorted(want) == list(range(4))  # embedding, 2 blocks, final norm
    for layer, value in want.items():
        assert got[layer]["n"] == len(core["states"][model]["all"][layer][0])
        assert got[layer]["inter_sim"] == pytest.approx(value, abs=1e-6)


@pytest.mark.parametrize("model", MODELS)
def test_inter_sim_by_source(core, model):
    got = rows(core["wh"], f"SELECT * FROM inter_sim_by_source WHERE model = '{model}'")
    assert {r["source"] for r in got} == {"alpha", "beta"}
    for r in got:
        want = ref.inter_sim(core["states"][model][r["source"]])[r["layer"]]
        assert r["inter_sim"] == pytest.approx(want, abs=1e-6)


@pytest.mark.parametrize("model", MODELS)
def test_intra_sim_per_token_and_average(core, model):
    states = core["states"][model]["all"]
    want = ref.intra_sim(states)
    got = {(r["layer"], r["token_id"]): r for r in rows(core["wh"], f"SELECT * FROM intra_sim WHERE model = '{model}'")}
    assert set(got) == set(want)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(core["paths"][model])
    for key, value in want.items():
        assert got[key]["intra_sim"] == pytest.approx(value, abs=1e-6)
        ids = states[key[0]][0]
        assert got[key]["n"] == int((ids == key[1]).sum())
        assert got[key]["token"] == tok.decode([key[1]])
    avg = {r["layer"]: r for r in rows(core["wh"], f"SELECT * FROM avg_intra_sim WHERE model = '{model}'")}
    for layer, value in ref.avg_intra_sim(want).items():
        assert avg[layer]["avg_intra_sim"] == pytest.approx(value, abs=1e-6)
        assert avg[layer]["tokens"] == sum(1 for k in want if k[0] == layer)


@pytest.mark.parametrize("model", MODELS)
def test_avg_intra_sim_by_source(core, model):
    got = rows(core["wh"], f"SELECT * FROM avg_intra_sim_by_source WHERE model = '{model}'")
    assert {r["source"] for r in got} == {"alpha", "beta"}
    for r in got:
        want = ref.intra_sim(core["states"][model][r["source"]])
        per_layer = {k: v for k, v in want.items() if k[0] == r["layer"]}
        assert r["tokens"] == len(per_layer)
        assert r["avg_intra_sim"] == pytest.approx(ref.avg_intra_sim(want)[r["layer"]], abs=1e-6)


@pytest.mark.parametrize("model", MODELS)
def test_embedding_layer_intra_sim_is_one(core, model):
    """GPT-NeoX has no position embeddings: every occurrence of a token has the same layer-0
    vector.  Merging float32-stored partials (sources, shards) costs ~1e-8."""
    got = rows(core["wh"], f"SELECT intra_sim FROM intra_sim WHERE model = '{model}' AND layer = 0")
    assert got and max(abs(r["intra_sim"] - 1) for r in got) < 1e-7


def test_single_partial_and_float64_vectors_are_exact(workdir, sources, model_factory):
    wh = workdir / "exact-wh"
    path = model_factory("gpt_neox", tied=True)
    for s, extra in ((sources["alpha"], []), (sources["beta"], ["--vector-dtype", "float64"])):
        code, _, err = run_cli("extract", "--model", path, "--source", f"{s.name.split('.')[0]}={s}",
                               "--warehouse", wh, "--max-length", MAXLEN, *extra)
        assert code == 0, err
    # alpha alone: one partial, sum_sq exact in float64.
    con = connect(wh)
    one = con.execute("SELECT max(abs((sum_sq - n) / (n * n - n) - 1)) FROM token_sums "
                  "WHERE layer = 0 AND n >= 2 AND source = 'alpha'").fetchone()[0]
    merged = con.execute("SELECT max(abs(intra_sim - 1)) FROM intra_sim WHERE layer = 0").fetchone()[0]
    assert one < 1e-12
    # alpha (float32 vectors) merged with beta (float64 vectors): still limited by alpha's float32.
    assert merged < 1e-7


@pytest.mark.parametrize("model", MODELS)
def test_isotropy_equals_numpy(core, model):
    weights = load_file(str(core["paths"][model] / "model.safetensors"))
    emb = weights["gpt_neox.embed_in.weight"].astype(np.float64)
    unemb = weights.get("lm_head.weight", weights.get("embed_out.weight", emb if "tied" in model else None))
    unemb = emb if unemb is None else unemb.astype(np.float64)
    got = {(r["matrix"], r["centered"]): r for r in rows(core["wh"], f"SELECT * FROM isotropy WHERE model = '{model}'")}
    assert set(got) == {(m, c) for m in ("embedding", "unembedding") for c in (False, True)}
    assert {r["tied"] for r in got.values()} == {model.endswith("-tied")}
    for matrix, W in (("embedding", emb), ("unembedding", unemb)):
        for centered in (False, True):
            A = W - W.mean(0) if centered else W
            assert got[(matrix, centered)]["i_w"] == pytest.approx(ref.isotropy(A), rel=1e-9)
            assert got[(matrix, centered)]["i_w_eigh_signs"] == pytest.approx(ref.isotropy_eigh_signs(A), rel=1e-5)
    if model.endswith("-tied"):
        assert got[("embedding", False)]["i_w"] == got[("unembedding", False)]["i_w"]
    else:
        assert got[("embedding", False)]["i_w"] != got[("unembedding", False)]["i_w"]


def test_partition_function_known_answers():
    """Rows ±e_i: Z(c) is the same for every eigenvector → I = 1; a cone (all rows shifted
    along one direction) is far from isotropic, and mean-centring brings it back."""
    import torch

    from extract.params import partition_rows

    d = 6
    W = np.concatenate([np.eye(d), -np.eye(d)])
    part = partition_rows(torch.tensor(W))
    logz = np.array(part["log_z_pos"] + part["log_z_neg"])
    assert np.exp(logz.min() - logz.max()) == pytest.approx(1.0, abs=1e-12)
    rng = np.random.default_rng(0)
    cone = rng.normal(size=(500, d)) * 0.1 + 3.0 * np.eye(d)[0]
    part = partition_rows(torch.tensor(cone))
    centred = np.array(part["centered"])
    lz = np.array(part["log_z_pos"] + part["log_z_neg"])
    c2 = np.concatenate([centred, centred])
    raw_i = np.exp(lz[~c2].min() - lz[~c2].max())
    cen_i = np.exp(lz[c2].min() - lz[c2].max())
    assert raw_i < 0.01 and cen_i > 0.9  # raw: Z(-c)/Z(c) = e^-6 along the cone axis
    assert raw_i == pytest.approx(ref.isotropy(cone), rel=1e-9)


def test_partition_function_stays_finite_where_exp_overflows():
    """A real unembedding's ⟨c, W_i⟩ exceeds float32's exp range (~88): log-space keeps I(W)."""
    import torch

    from extract.params import partition_rows

    rng = np.random.default_rng(1)
    W = rng.normal(size=(2000, 8)) * 40.0
    part = partition_rows(torch.tensor(W))
    assert np.isinf(part["z_eigh_sign"]).any()  # the float32 convention overflows
    lz = np.array(part["log_z_pos"] + part["log_z_neg"])[: 2 * 8]
    assert np.isfinite(lz).all()


@pytest.mark.parametrize("model", MODELS)
def test_layernorm_equals_numpy(core, model):
    weights = load_file(str(core["paths"][model] / "model.safetensors"))
    got = {r["module"]: r for r in rows(core["wh"], f"SELECT * FROM layernorm WHERE model = '{model}'")}
    modules = {k[: -len(".weight")] for k in weights if "norm" in k and k.endswith(".weight")}
    assert set(got) == modules
    assert [m for m, r in got.items() if r["is_final"]] == ["gpt_neox.final_layer_norm"]
    for m in modules:
        want = ref.layernorm_summary(weights[m + ".weight"].astype(np.float64), weights[m + ".bias"].astype(np.float64))
        for k, v in want.items():
            assert got[m][k] == pytest.approx(v, rel=1e-9, abs=1e-12), (m, k)


def test_rerun_replaces_instead_of_double_counting(core):
    runs = rows(core["wh"], "SELECT * FROM runs WHERE model = 'gpt_neox-untied' AND kind = 'data' ORDER BY source, shard")
    assert [(r["source"], r["shard"]) for r in runs] == [("alpha", "1-of-2"), ("alpha", "2-of-2"), ("beta", "1-of-1")]
    n = rows(core["wh"], "SELECT n FROM inter_sim WHERE model = 'gpt_neox-untied' AND layer = 0")[0]["n"]
    assert n == len(core["states"]["gpt_neox-untied"]["all"][0][0])
    listed = {f for r in json.loads((core["wh"] / "manifest.json").read_text())["entries"].values() for f in r["files"].values()}
    on_disk = {str(p.relative_to(core["wh"])) for p in (core["wh"] / "tables").rglob("*.parquet")}
    assert on_disk == listed  # the replaced run's files were removed


def test_runs_record_provenance(core):
    r = rows(core["wh"], "SELECT * FROM runs WHERE kind = 'data' LIMIT 1")[0]
    prov = json.loads(r["provenance"])
    assert r["git_hash"] and r["source_fingerprint"] and r["model_revision"]
    assert {"torch", "transformers", "pyarrow", "duckdb", "python"} <= set(prov["packages"])
    assert json.loads(r["settings"])["max_length"] == MAXLEN
    assert r["tokens"] > 0 and r["hidden_size"] == 32


def test_every_query_header_matches_its_columns(core):
    con = connect(core["wh"])
    for metric in load_metrics():
        cols = [row[0] for row in con.sql(f"DESCRIBE {metric.name}").fetchall()]
        assert cols == list(metric.columns), metric.path
        text = metric.path.read_text()
        assert "-- Formula:" in text and "-- Inputs:" in text


def test_a_connection_of_some_views_has_those_and_their_inputs_and_the_same_rows(core):
    """connect(wh, views=[…]) creates each named view and what it reads (by the headers' Inputs), nothing
    else, each unbound until a query reads it, and each view's rows equal the full connection's; `sql()`
    and `cli.py sql` open only what a query reads, and every view for a catalogue query or a name that is
    no view."""
    from warehouse.query import view_closure, views_read

    VIEW_NAMES = "SELECT view_name FROM duckdb_views() WHERE NOT internal AND left(view_name, 1) <> '_'"

    full = connect(core["wh"])
    bound_now = VIEW_NAMES + " AND is_bound"  # made unbound: DuckDB binds a view when a query reads it
    assert full.sql(bound_now).fetchall() == []
    full.sql("SELECT * FROM inter_sim").fetchall()
    assert {r[0] for r in full.sql(bound_now).fetchall()} == view_closure(["inter_sim"])
    for metric in load_metrics():
        con = connect(core["wh"], views=[metric.name])
        bound = {r[0] for r in con.sql(VIEW_NAMES).fetchall()}
        assert bound == view_closure([metric.name]) and set(metric.inputs) <= bound, metric.name
        query = f"SELECT * FROM {metric.name}"
        assert sorted(map(repr, con.sql(query).fetchall())) == sorted(map(repr, full.sql(query).fetchall()))
        con.close()
    every = {r[0] for r in full.sql(VIEW_NAMES).fetchall()}
    full.close()
    assert views_read("WITH s AS (SELECT * FROM inter_sim) SELECT * FROM s, main.RUNS") == {"inter_sim", "runs"}
    replace = "SELECT * REPLACE ((SELECT count(*) FROM inter_sim) AS model) FROM runs"  # (not in the parser's list)
    assert views_read(replace) == {"inter_sim", "runs"} and len(polars_sql(replace, core["wh"])) > 0
    for query in ("SHOW TABLES", "SELECT * FROM duckdb_views()", "SELECT 1", "SELECT * FROM nope, inter_sim",
                  "SELECT * FROM information_schema.tables", "SELECT * FROM pragma_table_info('inter_sim'), runs"):
        assert views_read(query) is None, query
    code, out, _ = run_cli("sql", VIEW_NAMES, "-w", core["wh"], "--format", "csv")
    assert code == 0 and set(out.split()[1:]) == every
    code, out, _ = run_cli("sql", "SELECT count(*) AS n FROM inter_sim", "-w", core["wh"], "--format", "csv")
    assert code == 0 and out.split() == ["n", "8"]
    with pytest.raises(UserError, match="no such view: nope"):
        connect(core["wh"], views=["inter_sim", "nope"])


def test_views_reference_is_generated_from_the_query_headers():
    """docs/views.md is what `scripts/views_doc.py` writes from queries/*.sql now: every view, with
    its formula, inputs and columns (regenerate it after changing a header)."""
    from warehouse.query import views_reference

    doc = (Path(__file__).resolve().parent.parent / "docs" / "views.md").read_text()
    assert doc == views_reference(), "docs/views.md is stale: run python scripts/views_doc.py"
    for metric in load_metrics():
        assert f"## `{metric.name}`" in doc and ", ".join(f"`{c}`" for c in metric.columns) in doc


def test_duckdb_shell_opens_the_warehouse(core):
    out = subprocess.run(["duckdb", "-init", str(core["wh"] / "views.sql"), "-csv", "-c",
                          "SELECT layer, inter_sim FROM inter_sim WHERE model = 'gpt_neox-tied' ORDER BY layer"],
                         capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line and line[0].isdigit()]
    want = rows(core["wh"], "SELECT layer, inter_sim FROM inter_sim WHERE model = 'gpt_neox-tied' ORDER BY layer")
    assert [int(line.split(",")[0]) for line in lines] == [r["layer"] for r in want]
    for line, r in zip(lines, want):
        assert float(line.split(",")[1]) == pytest.approx(r["inter_sim"], rel=1e-12)


def test_duckdb_shell_runs_every_view(core):
    """duckdb-cli (1.5.x) parses and runs every view the Python module (2.x) defines."""
    names = [m.name for m in load_metrics()]
    sql = " ".join(f"SELECT '{n}', count(*) FROM {n};" for n in names)
    out = subprocess.run(["duckdb", "-init", str(core["wh"] / "views.sql"), "-csv", "-noheader", "-c", sql],
                         capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert out.returncode == 0 and "Error" not in out.stderr, out.stderr
    counts = dict(line.split(",") for line in out.stdout.splitlines() if "," in line)
    assert set(counts) == set(names) and int(counts["inter_sim"]) == 8


def test_polars_function(core):
    import polars as pl

    df = polars_sql("SELECT * FROM avg_intra_sim ORDER BY model, layer", core["wh"])
    assert isinstance(df, pl.DataFrame) and df.columns == ["model", "checkpoint", "step", "layer", "tokens", "avg_intra_sim"]
    assert df.height == 8


def test_cli_sql_formats_and_errors(core):
    code, out, _ = run_cli("sql", "SELECT layer, inter_sim FROM inter_sim ORDER BY model, layer", "-w", core["wh"], "--format", "json")
    data = json.loads(out)
    assert code == 0 and isinstance(data, list) and set(data[0]) == {"layer", "inter_sim"}
    code, out, _ = run_cli("sql", "SELECT layer FROM inter_sim ORDER BY model, layer", "-w", core["wh"], "--format", "csv")
    assert code == 0 and out.splitlines()[:2] == ["layer", "0"]
    code, out, err = run_cli("sql", "SELEC oops", "-w", core["wh"])
    assert code != 0 and err.startswith("error: Parser Error") and len(err.strip().splitlines()) == 1


def test_float16_vectors_cost_is_bounded(workdir, sources, model_factory, core):
    """--vector-dtype float16 halves storage; merged Intra-Sim moves by < 1e-3, Inter-Sim not at all."""
    wh = workdir / "fp16-wh"
    path = core["paths"]["gpt_neox-tied"]
    code, _, err = run_cli("extract", "--model", path, "--source", f"alpha={sources['alpha']}", "--source",
                           f"beta={sources['beta']}", "--warehouse", wh, "--max-length", MAXLEN,
                           "--vector-dtype", "float16")
    assert code == 0, err
    want = ref.intra_sim(core["states"]["gpt_neox-tied"]["all"])
    got = {(r["layer"], r["token_id"]): r["intra_sim"] for r in rows(wh, "SELECT * FROM intra_sim")}
    err16 = max(abs(got[k] - v) for k, v in want.items())
    print(f"float16 vectors: max |Δ intra_sim| = {err16:.2e}")
    assert 1e-7 < err16 < 1e-3  # visibly coarser than float32, still small
    inter = {r["layer"]: r["inter_sim"] for r in rows(wh, "SELECT * FROM inter_sim")}
    for layer, v in ref.inter_sim(core["states"]["gpt_neox-tied"]["all"]).items():
        assert inter[layer] == pytest.approx(v, abs=1e-6)


def test_folded_partials_path_gives_the_same_views(workdir, sources, model_factory, core, monkeypatch):
    """The path used when the float64 sums live on another device than the model
    (--accumulator-device cpu on a GPU): per-batch partials folded in. Forced here on the CPU."""
    import functools

    import extract.run.stream as run_module
    from extract.accumulate.sums import TokenSums

    monkeypatch.setattr(run_module, "TokenSums", functools.partial(TokenSums, fold_partials=True))
    wh = workdir / "fold-wh"
    code, _, err = run_cli("extract", "--model", core["paths"]["gpt_neox-tied"], "--source", f"alpha={sources['alpha']}",
                           "--source", f"beta={sources['beta']}", "--warehouse", wh, "--max-length", MAXLEN)
    assert code == 0, err
    states = core["states"]["gpt_neox-tied"]["all"]
    got = {r["layer"]: r["inter_sim"] for r in rows(wh, "SELECT * FROM inter_sim")}
    for layer, value in ref.inter_sim(states).items():
        assert got[layer] == pytest.approx(value, abs=1e-6)
    intra = {(r["layer"], r["token_id"]): r["intra_sim"] for r in rows(wh, "SELECT * FROM intra_sim")}
    want = ref.intra_sim(states)
    assert set(intra) == set(want) and max(abs(intra[k] - v) for k, v in want.items()) < 1e-6
