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


def test_help_examples_use_the_name_the_command_was_run_by(tmp_path):
    """`python -m isotropy_warehouse merge --help` shows `python -m isotropy_warehouse merge …`, not the
    checkout's `python cli.py` (the console script likewise shows `isotropy-warehouse`)."""
    out = subprocess.run([sys.executable, "-m", "isotropy_warehouse", "merge", "--help"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Example: python -m isotropy_warehouse merge" in out.stdout and "python cli.py" not in out.stdout
    out = subprocess.run([sys.executable, "cli.py", "merge", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert "Example: python cli.py merge" in out.stdout


def test_params_only_writes_parameters_and_no_data(workdir, model_factory):
    wh = workdir / "params-wh"
    code, _, err = run_cli("extract", "--model", model_factory("gpt_neox", tied=False), "--params-only", "--warehouse", wh)
    assert code == 0, err
    con = connect(wh)
    assert con.execute("SELECT count(*) FROM isotropy").fetchone()[0] == 4
    assert con.execute("SELECT count(*) FROM layernorm").fetchone()[0] == 5
    assert con.execute("SELECT count(*) FROM token_sums").fetchone()[0] == 0
    assert con.execute("SELECT count(*) FROM inter_sim").fetchone()[0] == 0


def test_max_tokens_counts_only_the_documents_it_used(tmp_path, model_factory):
    """--max-tokens stops reading; the documents reported are those whose tokens were counted (the
    tokenizer's chunk read ahead is not), as the definition counts them."""
    from transformers import AutoTokenizer

    model = model_factory("gpt_neox", tied=False)
    texts = [f"document number {i} says " + "word " * (3 + i % 5) for i in range(200)]
    src = tmp_path / "docs.txt"
    src.write_text("\n".join(texts) + "\n")
    tok = AutoTokenizer.from_pretrained(model)
    budget, used = 60, 0
    for text in texts:  # documents until the budget is spent (the last one possibly in part)
        used += 1
        budget -= len(tok(text, add_special_tokens=False)["input_ids"])
        if budget <= 0:
            break
    wh = tmp_path / "wh"
    code, _, err = run_cli("extract", "--model", model, "--source", f"d={src}", "--warehouse", wh,
                           "--max-tokens", 60, "--max-length", 32)
    assert code == 0, err
    con = connect(wh)
    assert con.execute("SELECT documents, tokens FROM runs WHERE kind = 'data'").fetchone() == (used, 60)
    con.close()
    assert f"{used} documents" in err


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


# The query side as a user runs it: each command in a fresh process, then the modules it loaded.
_LOADED = ("import runpy, sys\nsys.argv = sys.argv[1:]\ntry:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
           "except SystemExit as e:\n    code = e.code\nelse:\n    code = 0\n"
           "print('LOADED', code, ' '.join(m for m in ('torch', 'transformers', 'accelerate') if m in sys.modules))")


@pytest.mark.parametrize("command", [
    ["sql", "SELECT count(*) FROM inter_sim, anisotropy, isotropy, intrinsic_dim, linearity"],
    ["validate"], ["views"], ["report", "--out", "{tmp}/report"], ["pull", "--to", "{tmp}/copy"], ["compact"], ["merge"],
])
def test_query_side_imports_neither_torch_nor_transformers(single, tmp_path, command):
    """sql, report, validate, views, pull, compact and merge never load torch or transformers (start-up cost)."""
    import shutil

    wh = tmp_path / "wh"
    shutil.copytree(single["wh"], wh)  # compact rewrites it
    args = [a.replace("{tmp}", str(tmp_path)) for a in command]
    out = subprocess.run([sys.executable, "-c", _LOADED, "cli.py", *args, "--warehouse", str(wh)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    line = [x for x in out.stdout.splitlines() if x.startswith("LOADED")]
    assert line, out.stderr[-2000:]
    assert line[-1].split()[1] == "0", out.stderr[-2000:] + out.stdout[-2000:]  # the command succeeded
    assert line[-1].split()[2:] == [], f"{command[0]} imported {line[-1].split()[2:]}"
