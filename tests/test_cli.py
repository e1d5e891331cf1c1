"""The command line: help with examples, one-line errors, --params-only, summaries."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT, run_cli
from warehouse.query import connect


def test_help_works_from_the_repo_root_and_each_command_has_an_example():
    out = subprocess.run([sys.executable, "cli.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "extract" in out.stdout and "sql" in out.stdout
    from typer.main import get_command

    import cli

    group = get_command(cli.app)
    for name, command in group.commands.items():
        assert "Example:" in (command.help or ""), name


def test_params_only_writes_parameters_and_no_data(workdir, model_factory):
    wh = workdir / "params-wh"
    code, _, err = run_cli("extract", "--model", model_factory("gpt_neox", tied=False), "--params-only", "--warehouse", wh)
    assert code == 0, err
    con = connect(wh)
    assert con.execute("SELECT count(*) FROM isotropy").fetchone()[0] == 4
    assert con.execute("SELECT count(*) FROM layernorm").fetchone()[0] == 5
    assert con.execute("SELECT count(*) FROM token_sums").fetchone()[0] == 0
    assert con.execute("SELECT count(*) FROM inter_sim").fetchone()[0] == 0


def test_extract_prints_a_summary(workdir, sources, model_factory):
    code, _, err = run_cli("extract", "--model", model_factory("gpt_neox", tied=False), "--source",
                           f"alpha={sources['alpha']}", "--warehouse", workdir / "summary-wh", "--max-tokens", 50)
    assert code == 0
    assert "alpha: 50 tokens" in err and err.strip().splitlines()[-1].startswith("done: 50 tokens")


@pytest.mark.parametrize("args,message", [
    (["--model", "EleutherAI/pythia-70m"], "cannot load model 'EleutherAI/pythia-70m'"),
    (["--model", "pythia-99m"], "unknown model 'pythia-99m'"),
])
def test_unavailable_models_fail_with_one_line(workdir, sources, args, message):
    wh = workdir / "fail-wh"
    code, out, err = run_cli("extract", *args, "--source", f"alpha={sources['alpha']}", "--warehouse", wh)
    assert code == 2 and err.startswith("error: " + message) and len(err.strip().splitlines()) == 1
    assert not (wh / "tables").exists() or not any((wh / "tables").rglob("*.parquet"))
