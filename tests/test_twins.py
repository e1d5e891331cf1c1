"""Checkpoints that are not what they claim: twins (identical tensors under two step names) are
listed by `checkpoint_twins`, warned about by `extract`, skipped with --skip-twins and marked on
every figure across training; different weights are not twins."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from conftest import run_cli, same_numbers, views

ARGS = ["--max-length", "32", "--batch-size", "4"]


@pytest.fixture(scope="module")
def run(tmp_path_factory, sources, model_factory):
    """A training run's directory: step0; step5, step0's tensors saved again (another header: the
    files differ, the tensors do not); step10, other weights."""
    root = tmp_path_factory.mktemp("twins") / "run"
    shutil.copytree(model_factory("gpt_neox", tied=False), root / "step0")
    shutil.copytree(root / "step0", root / "step5")
    state = load_file(root / "step0" / "model.safetensors")
    save_file(dict(reversed(state.items())), root / "step5" / "model.safetensors", metadata={"format": "pt", "re": "saved"})
    shutil.copytree(model_factory("gpt_neox", tied=False, seed=1), root / "step10")
    wh = root.parent / "wh"
    code, _, err = run_cli("extract", "--model", root, "--checkpoints", "all", "--source", f"alpha={sources['alpha']}",
                           *ARGS, "--warehouse", wh)
    assert code == 0, err
    return {"root": root, "wh": wh, "err": err}


def _rows(wh, sql):
    from warehouse.query import connect

    con = connect(wh)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def test_twins_are_listed_warned_about_and_others_are_not(run):
    assert (run["root"] / "step5" / "model.safetensors").read_bytes() != (run["root"] / "step0" / "model.safetensors").read_bytes()
    warnings = [line for line in run["err"].splitlines() if line.startswith("warning:")]
    assert warnings == ["warning: run@step5: its weights equal those of run@step0 (every tensor identical), already in "
                        "the warehouse; extracting it anyway (--skip-twins skips such checkpoints; see the "
                        "checkpoint_twins view)"]
    # the latest step holds the weights; the earlier checkpoint is listed as its twin, step10 not at all
    got = _rows(run["wh"], "SELECT model, checkpoint, step, twin_of, twin_step FROM checkpoint_twins")
    assert got == [("run", "step0", 0, "step5", 5)]
    weights = _rows(run["wh"], "SELECT DISTINCT checkpoint, json_extract_string(provenance, '$.model_identity') "
                               "FROM runs WHERE kind = 'params' ORDER BY 1")
    assert len({w for _, w in weights}) == 2 and all(w.startswith("tensors ") for _, w in weights)


def test_skip_twins_skips_the_twin_and_writes_nothing_for_it(run, sources, tmp_path):
    wh = tmp_path / "wh"
    code, _, err = run_cli("extract", "--model", run["root"], "--checkpoint", "step0", "--checkpoint", "step5",
                           "--skip-twins", "--source", f"alpha={sources['alpha']}", *ARGS, "--warehouse", wh)
    assert code == 0, err
    assert "run@step5: its weights equal those of run@step0 (every tensor identical), already in the warehouse; " \
           "skipped (--skip-twins)" in err and "warning:" not in err
    assert _rows(wh, "SELECT DISTINCT checkpoint FROM runs ORDER BY 1") == [("step0",)]
    assert not [p for p in wh.rglob("*") if "step5" in str(p)]  # no file, no folder of the twin
    assert _rows(wh, "SELECT count(*) FROM checkpoint_twins") == [(0,)]
    full = views(run["wh"])
    only = {k: [r for r in v if "step0" in r] for k, v in full.items()}
    same_numbers(views(wh), only)


def test_every_figure_across_training_marks_the_twins(run):
    """The shared mechanism: `Data.training` adds `twin_of`, every chart of a figure across training
    draws the twins' mark, and its caption names them (`note_twins`, as the page draws it)."""
    from warehouse.report.charts import note_twins
    from warehouse.report.data import Data
    from warehouse.report.registry import FIGURES

    d = Data(run["wh"], None, None)
    across = 0
    for make in FIGURES:
        fig = make(d)
        if fig.missing or fig.data is None or "step" not in fig.data.columns or fig.data["step"].n_unique() < 2:
            continue
        across += 1
        assert "twin_of" in fig.data.columns, fig.id
        assert "isValid(datum.twin_of)" in json.dumps(fig.chart.to_dict()), fig.id
        note_twins(fig)
        assert fig.caption.endswith("(the checkpoint_twins view): run@step0 = step5."), fig.id
    assert across >= 8
    fig = FIGURES[0](d)  # by layer, at the final checkpoint: no twin, no note
    note_twins(fig)
    assert "twin" not in fig.caption
    d.con.close()
