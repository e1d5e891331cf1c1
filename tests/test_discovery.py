"""Layer discovery and its overrides, the tokenizer's special tokens, and memory under a budget."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

import reference as ref
from conftest import ROOT, run_cli
from extract.architectures import OVERRIDES, discover, parse_module_overrides
from common.errors import UserError
from extract.models import forward_kwargs
from warehouse.query import connect


def _model(model_factory, family="gpt_neox"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_factory(family)).eval()


def test_overrides_table_is_empty_until_discovery_is_wrong():
    # Every family of the parametrised test is found by discovery alone; an entry added here
    # must come with its own test.
    assert OVERRIDES == {}


def test_discovery_names_what_is_missing_and_user_modules_fix_it(model_factory):
    model = _model(model_factory)
    model.gpt_neox.layers = torch.nn.Sequential(*model.gpt_neox.layers)  # no ModuleList to find
    with pytest.raises(UserError, match=r"cannot find the blocks .*--module"):
        discover(model, "causal", None, forward_kwargs("causal"))
    layout = discover(model, "causal", {"blocks": "gpt_neox.layers"}, forward_kwargs("causal"))
    assert layout.blocks == "gpt_neox.layers" and layout.how["blocks"] == "user"
    assert layout.final_norm == "gpt_neox.final_layer_norm" and layout.how["final_norm"] == "discovered"


def test_discovery_finds_every_role(model_factory):
    layout = discover(_model(model_factory, "llama"), "causal", None, forward_kwargs("causal"))
    assert (layout.base, layout.embedding, layout.blocks, layout.final_norm, layout.unembedding, layout.d) == \
        ("model", "model.embed_tokens", "model.layers", "model.norm", "lm_head", 32)


@pytest.mark.parametrize("spec,message", [
    ("blocks", "expected ROLE=PATH"), ("head=lm_head", "expected ROLE=PATH"), ("blocks=", "expected ROLE=PATH"),
])
def test_bad_module_specs(spec, message):
    with pytest.raises(UserError, match=message):
        parse_module_overrides([spec])


def test_module_option_from_the_command_line(workdir, sources, model_factory):
    path = model_factory("gpt_neox")
    wh = workdir / "module-none"
    code, _, err = run_cli("extract", "--model", path, "--source", f"alpha={sources['alpha']}", "--warehouse", wh,
                           "--max-tokens", 200, "--module", "final_norm=none")
    assert code == 0, err
    kinds = [k for (k,) in connect(wh).execute(
        "SELECT layer_kind FROM layer_norms WHERE source = 'all' ORDER BY layer").fetchall()]
    assert kinds == ["embedding", "block", "block"]
    runs = connect(wh).execute("SELECT provenance FROM runs WHERE kind = 'data'").fetchone()[0]
    layout = json.loads(runs)["layout"] if isinstance(runs, str) else runs["layout"]
    assert layout["final_norm"] is None and layout["how"]["final_norm"] == "user"
    code, _, err = run_cli("extract", "--model", path, "--source", f"alpha={sources['alpha']}",
                           "--warehouse", workdir / "module-bad", "--module", "blocks=gpt_neox.nope")
    assert code == 2 and err.count("\n") == 1 and "no module at 'gpt_neox.nope'" in err


def test_special_tokens_fed_and_excluded_or_counted(workdir, sources, model_factory):
    """Llama-style BOS: fed always; counted only with --count-special-tokens, then equal to the
    model's own hidden states over every position."""
    path = model_factory("llama", context=128)
    texts = ref.source_texts(sources["alpha"])
    for flag, special in (("--no-count-special-tokens", False), ("--count-special-tokens", True)):
        wh = workdir / f"special-{special}"
        code, _, err = run_cli("extract", "--model", path, "--source", f"alpha={sources['alpha']}", "--warehouse", wh,
                               "--max-length", 128, flag)
        assert code == 0, err
        con = connect(wh)
        states = ref.own_hidden_states(str(path), texts, special=special)
        n = con.execute("SELECT n FROM layer_norms WHERE source = 'all' AND layer = 0").fetchone()[0]
        assert n == len(states[0][0]) == sum(1 for _ in texts) * special + len(ref.own_hidden_states(str(path), texts)[0][0])
        bos = con.execute("SELECT count(*) FROM token_sums WHERE token_id = (SELECT min(token_id) FROM vocab "
                          "WHERE token = '<s>')").fetchone()[0]
        assert (bos > 0) == special
        got = dict(con.execute("SELECT layer, inter_sim FROM inter_sim").fetchall())
        assert got[1] == pytest.approx(ref.inter_sim({1: states[1]})[1], abs=1e-6)
        prov = con.execute("SELECT provenance FROM runs WHERE kind = 'data'").fetchone()[0]
        prov = json.loads(prov) if isinstance(prov, str) else prov
        assert prov["special_tokens"]["counted"] is special and len(prov["special_tokens"]["prefix"]) == 1


def _token_sums(wh):
    rows = connect(wh).execute("SELECT layer, token_id, n, sum_sq, vec FROM token_sums "
                               "ORDER BY source, layer, token_id").fetchall()
    return [(r[0], r[1], r[2]) for r in rows], np.array([r[3] for r in rows]), np.array([r[4] for r in rows])


def test_memory_budget_spills_and_equals_the_unbudgeted_run(workdir, sources, model_factory):
    path = model_factory("gpt_neox")
    out = {}
    for budget in (None, "80KB"):
        wh = workdir / f"budget-{budget}"
        extra = ["--memory-budget", budget] if budget else []
        code, _, err = run_cli("extract", "--model", path, "--source", f"alpha={sources['alpha']}",
                               "--source", f"beta={sources['beta']}", "--warehouse", wh, "--batch-size", 2,
                               "--max-length", 32, "--vector-dtype", "float64", *extra)
        assert code == 0, err
        out[budget] = _token_sums(wh)
        stats = [json.loads(s) if isinstance(s, str) else s for (s,) in
                 connect(wh).execute("SELECT stats FROM runs WHERE kind = 'data'").fetchall()]
        if budget:
            assert all(s["spills"] >= 2 for s in stats), [s["spills"] for s in stats]
            assert all(s["accumulator_peak_bytes"] <= 80_000 for s in stats)
        else:
            assert all(s["spills"] == 0 for s in stats)
    (keys0, sq0, v0), (keys1, sq1, v1) = out[None], out["80KB"]
    assert keys0 == keys1  # the same (layer, token) rows with the same counts
    # equal up to the order of float64 additions: relative 1e-12 (sums of up to ~10³ unit vectors)
    assert (np.abs(v0 - v1).max(1) / np.maximum(1, np.abs(v0).max(1))).max() < 1e-12
    assert (np.abs(sq0 - sq1) / np.maximum(1, sq0)).max() < 1e-12
    con = connect(workdir / "budget-80KB")
    ref_con = connect(workdir / "budget-None")
    for view in ("inter_sim", "avg_intra_sim"):
        a = dict(con.execute(f"SELECT layer, {view} FROM {view}").fetchall())
        b = dict(ref_con.execute(f"SELECT layer, {view} FROM {view}").fetchall())
        assert a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-12 for k in a)


def test_budget_too_small_for_one_batch(workdir, sources, model_factory):
    code, _, err = run_cli("extract", "--model", model_factory("gpt_neox"), "--source", f"alpha={sources['alpha']}",
                           "--warehouse", workdir / "budget-tiny", "--memory-budget", "20KB")
    assert code == 2 and "cannot hold one batch" in err and err.count("\n") == 1
    assert not (workdir / "budget-tiny" / "tables").exists() or not any((workdir / "budget-tiny" / "tables").rglob("*.parquet"))


def test_large_vocabulary_peak_rss_is_bounded(workdir):
    """A 128,256-token vocabulary (Llama-3's), d = 256, 4 blocks, 3,000 Zipf tokens through the CLI in
    a child process: dense float64 accumulators alone would be 1.58 GB, whatever the number of
    tokens; the sparse ones hold only the types seen (~15 MB here).  The rest of the peak is the
    process itself — torch, transformers, DuckDB and the memory-mapped 0.27 GB weights: 0.74 GB with
    300 tokens on the 2-core reference machine, 0.78 GB with these 3,000 — and varies by machine
    (1.00 GB on a CI runner with 20k tokens), so the bound is 1.3 GB: a dense table would put the
    process at ≥ 2.3 GB (bench/bench_memory.py: 40k tokens)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_memory

    model = bench_memory.build(workdir / "vocab128k", layers=4)
    text = bench_memory.text(workdir / "zipf128k.txt", 3_000, True)
    seconds, gb, stats = bench_memory.run(model, text, workdir / "wh-128k")
    assert stats["tokens"] == 3_000 and stats["spills"] == 0
    assert stats["accumulator_peak_bytes"] < 0.2e9
    assert gb < 1.3, f"peak RSS {gb:.2f} GB"  # the child's own VmHWM
