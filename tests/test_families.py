"""Every architecture family in the table, on a tiny random config built here: layers are
numbered the same way and the views equal the definitions on independently captured states."""

from __future__ import annotations

import pytest

import reference as ref
from conftest import run_cli
from extract.architectures import FAMILIES
from warehouse.query import connect

# (family, tied, has final norm, has position embeddings)
CASES = [
    ("gpt_neox", False, True, False),
    ("gpt2", True, True, True),
    ("opt", True, True, True),
    ("llama", False, True, False),
    ("mistral", True, True, False),
    ("falcon", True, True, False),
    ("bert", True, False, True),
    ("roberta", True, False, True),
]


def test_cases_cover_the_table():
    assert {c[0] for c in CASES} == set(FAMILIES)


@pytest.mark.parametrize("family,tied,final,positions", CASES)
def test_family(workdir, sources, model_factory, family, tied, final, positions):
    path = model_factory(family, tied=tied)
    wh = workdir / f"family-{family}"
    code, _, err = run_cli("extract", "--model", path, "--source", f"alpha={sources['alpha']}",
                           "--warehouse", wh, "--max-length", 24, "--max-tokens", 300, "--batch-size", 3)
    assert code == 0, err
    con = connect(wh)
    kinds = con.execute("SELECT layer, layer_kind FROM layer_norms WHERE source = 'all' ORDER BY layer").fetchall()
    expect = ["embedding", "block", "block"] + (["final_norm"] if final else [])
    assert [k for _, k in kinds] == expect
    # The reference sees the same first 300 tokens: windows of 24 (22 + [CLS]/[SEP] for encoders).
    states = ref.hidden_states(str(path), ref.source_texts(sources["alpha"]), 24, max_tokens=300)
    assert len(states[0][0]) == 300
    got = dict(con.execute("SELECT layer, inter_sim FROM inter_sim").fetchall())
    for layer, value in ref.inter_sim(states).items():
        assert got[layer] == pytest.approx(value, abs=1e-5), (family, layer)
    avg = dict(con.execute("SELECT layer, avg_intra_sim FROM avg_intra_sim").fetchall())
    for layer, value in ref.avg_intra_sim(ref.intra_sim(states)).items():
        assert avg[layer] == pytest.approx(value, abs=1e-5), (family, layer)
    emb0 = con.execute("SELECT max(abs(intra_sim - 1)) FROM intra_sim WHERE layer = 0").fetchone()[0]
    if positions:
        assert emb0 > 1e-3  # position embeddings make occurrences differ
    else:
        assert emb0 < 1e-12  # one partial, float64 sums: exactly 1 up to rounding
    iso = con.execute("SELECT count(DISTINCT matrix), bool_and(i_w > 0 AND i_w <= 1) FROM isotropy").fetchone()
    assert iso == (2, True)
    finals = con.execute("SELECT count(*) FROM layernorm WHERE is_final").fetchone()[0]
    assert finals == (1 if final else 0)
