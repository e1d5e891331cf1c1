"""Every family a researcher points the tool at, on a tiny random config built here with its
family's tokenizer conventions (BOS, [CLS]/[SEP], <s>/</s>, none), saved with `save_pretrained`
and loaded back through `--model DIR`: the discovered layers are numbered the same way, and
Inter-Sim and average Intra-Sim equal those computed by definition (O(n²), float64) on the
model's own `output_hidden_states` at the positions the tokenizer's special-tokens mask leaves."""

from __future__ import annotations

import pytest

import reference as ref
import tiny
from conftest import run_cli
from warehouse.query import connect

FAMILIES = sorted(tiny.FAMILY_SPECS)
CONTEXT = 128  # every test document fits one window: the reference feeds documents whole


def test_at_least_twenty_families():
    assert len(FAMILIES) >= 20


@pytest.fixture(scope="module")
def family_runs(workdir, sources, model_factory):
    """(model dir, warehouse) per family, extracted once."""
    out = {}

    def get(family):
        if family not in out:
            path = model_factory(family, tied=family in ("gpt2", "bert", "gemma", "opt"), context=CONTEXT)
            wh = workdir / f"family-{family}"
            code, _, err = run_cli("extract", "--model", path, "--source", f"alpha={sources['alpha']}",
                                   "--warehouse", wh, "--max-length", CONTEXT, "--batch-size", 5)
            assert code == 0, err
            out[family] = (path, wh)
        return out[family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_family_equals_its_own_hidden_states(family_runs, sources, family):
    path, wh = family_runs(family)
    con = connect(wh)
    kinds = [k for _, k in con.execute(
        "SELECT layer, layer_kind FROM layer_norms WHERE source = 'all' ORDER BY layer").fetchall()]
    assert kinds[:3] == ["embedding", "block", "block"] and len(kinds) in (3, 4)
    last = len(kinds) - 1  # the final norm's output where there is one, else block L's
    states = ref.own_hidden_states(str(path), ref.source_texts(sources["alpha"]))
    L = len(states) - 1  # hidden_states: L + 1 entries
    assert L == 2
    pairs = {**{i: i for i in range(L)}, last: L}  # our layer → index into hidden_states
    n_tokens = con.execute("SELECT n FROM layer_norms WHERE source = 'all' AND layer = 0").fetchone()[0]
    assert n_tokens == len(states[0][0])
    got = dict(con.execute("SELECT layer, inter_sim FROM inter_sim").fetchall())
    avg = dict(con.execute("SELECT layer, avg_intra_sim FROM avg_intra_sim").fetchall())
    for ours, i in pairs.items():
        one = {0: states[i]}
        assert got[ours] == pytest.approx(ref.inter_sim(one)[0], abs=1e-6), (family, ours)
        assert avg[ours] == pytest.approx(ref.avg_intra_sim(ref.intra_sim(one))[0], abs=1e-6), (family, ours)
    finals = con.execute("SELECT count(*) FROM layernorm WHERE is_final").fetchone()[0]
    parametric = family not in ("olmo",)  # OLMo's LayerNorm has no gain or bias to record
    assert finals == (1 if len(kinds) == 4 and parametric else 0)
    iso = con.execute("SELECT count(DISTINCT matrix), bool_and(i_w > 0 AND i_w <= 1) FROM isotropy").fetchone()
    assert iso[0] in (1, 2) and iso[1]


# Families whose last hidden state is the last block's own output (post-LN encoders): no final norm.
NO_FINAL_NORM = {"bert", "roberta", "xlm-roberta", "distilbert", "electra", "deberta-v2", "bart", "bart-causal"}


@pytest.mark.parametrize("family", ["llama", "gpt_neox", "bert", "deberta-v2", "modernbert", "gemma2", "phi",
                                    "t5", "bart", "mbart", "bart-causal"])
def test_final_norm_found_where_there_is_one(family_runs, family):
    _, wh = family_runs(family)
    kinds = [k for (k,) in connect(wh).execute(
        "SELECT layer_kind FROM layer_norms WHERE source = 'all' ORDER BY layer").fetchall()]
    assert (kinds[-1] == "final_norm") == (family not in NO_FINAL_NORM)


def test_blocks_without_weights_in_the_checkpoint_are_refused(workdir, sources, model_factory):
    """BART's decoder saved alone, its config edited to claim an encoder-decoder: loading it as one
    would measure a freshly initialised encoder. One line, exit 2, nothing written."""
    import json
    import shutil

    src = model_factory("bart-causal", context=CONTEXT)
    path = workdir / "bart-decoder-as-seq2seq"
    shutil.copytree(src, path, dirs_exist_ok=True)
    config = json.loads((path / "config.json").read_text())
    config.update(is_encoder_decoder=True, architectures=["BartForConditionalGeneration"])
    (path / "config.json").write_text(json.dumps(config))
    wh = workdir / "refused-seq2seq"
    code, _, err = run_cli("extract", "--model", path, "--source", f"alpha={sources['alpha']}", "--warehouse", wh)
    assert code == 2 and "holds no weights for" in err and "model.encoder.layers" in err, err
    assert len(err.strip().splitlines()) == 1 and not (wh / "manifest.json").exists()
