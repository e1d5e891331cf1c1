"""The newcomer path: micro-model training, the stdlib-docs source and the whole demo (small)."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace

from safetensors.numpy import load_file

from conftest import run_cli
from extract.sources import BUILTIN, ReadStats, documents, parse_source
from warehouse.query import connect


def test_stdlib_docs_is_read_at_run_time():
    src = parse_source("stdlib-docs")
    docs = list(documents(src, (1, 1), ReadStats()))
    assert len(docs) > 1000 and any("Return" in d for d in docs)
    import json as json_module

    assert json_module.__doc__.strip() in docs  # the running interpreter's own docstrings
    assert docs == list(BUILTIN["stdlib-docs"]())  # deterministic order


def test_stdlib_docs_walk_finds_what_ast_walk_finds_in_its_order(tmp_path):
    """The docstring reader visits only statements; against ast.walk on code that nests definitions
    in every kind of block, and the pruned file walk against rglob's filter."""
    import ast

    from extract.sources import definitions, stdlib_files

    code = '''"""m"""
def f():
    """f"""
    def g(): "g"
    x = [lambda: 1 for _ in ()]
    class C:
        "C"
        async def h(): "h"
try:
    def t(): "t"
except E:
    def e(): "e"
else:
    def el(): "el"
finally:
    def fi(): "fi"
match x:
    case 1:
        def m(): "m"
with a:
    if b:
        while c:
            for d in e:
                class D: "D"
            else:
                def w(): "w"
def z(): "z"
'''
    tree = ast.parse(code)
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    want = [ast.get_docstring(n) for n in ast.walk(tree) if isinstance(n, kinds)]
    assert [ast.get_docstring(n) for n in definitions(tree)] == want and len(want) == 13
    for rel in ("a.py", "b/c.py", "b/test/d.py", "site-packages/x/e.py", "f/tests.py", "g/h.txt", "g/__pycache__/i.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    skip = {"site-packages", "test", "tests", "__pycache__"}
    slow = sorted(p for p in tmp_path.rglob("*.py") if not skip & set(p.relative_to(tmp_path).parts))
    assert stdlib_files(tmp_path, skip) == slow and len(slow) == 3


def test_train_saves_hf_checkpoints_tied_and_untied(workdir, sources):
    for tied, flag in ((True, "--tied"), (False, "--untied")):
        out = workdir / "train-test" / flag[2:]
        code, _, err = run_cli("train", "--source", f"alpha={sources['alpha']}", "--out", out, flag, "--width", 32,
                               "--depth", 2, "--heads", 2, "--context", 32, "--vocab", 300, "--steps", 6,
                               "--save-every", 3, "--seed", 1)
        assert code == 0, err
        assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["step0", "step3", "step6"]
        w = load_file(str(out / "step6" / "model.safetensors"))
        assert ("lm_head.weight" in w or "embed_out.weight" in w) != tied  # tied models store one matrix
        rec = json.loads((out / "train.json").read_text())
        assert rec["settings"]["tied"] is tied and rec["checkpoints"]["step6"]["loss"] > 0
        w0 = load_file(str(out / "step0" / "model.safetensors"))
        assert (w0["gpt_neox.embed_in.weight"] != w["gpt_neox.embed_in.weight"]).any()  # it trained
        code, _, err = run_cli("train", "--source", f"alpha={sources['alpha']}", "--out", out, flag, "--width", 32,
                               "--depth", 2, "--heads", 2, "--context", 32, "--vocab", 300, "--steps", 6,
                               "--save-every", 3, "--seed", 1)
        assert code == 0 and "reusing it" in err


def test_train_rejects_bad_settings(workdir, sources):
    code, _, err = run_cli("train", "--source", f"alpha={sources['alpha']}", "--out", workdir / "bad", "--width", 30,
                           "--heads", 4)
    assert code == 2 and err.startswith("error: --width 30 must be a multiple of --heads 4")


def test_demo_end_to_end_and_reuse(workdir):
    out = workdir / "demo"
    args = ["demo", "--dir", out, "--steps", 4, "--save-every", 2, "--batch-size", 2, "--max-tokens", 500]
    code, stdout, err = run_cli(*args)
    assert code == 0, err
    con = connect(out / "warehouse")
    models = dict(con.execute("SELECT model, count(DISTINCT checkpoint) FROM inter_sim GROUP BY model").fetchall())
    assert models == {"minilm": 1, "micro-tied": 3, "micro-untied": 3}
    peers = con.execute("SELECT count(DISTINCT model) FROM anisotropy WHERE source = 'all'").fetchall()[0][0]
    assert peers == 3 and con.execute("SELECT count(*) FROM intrinsic_dim").fetchall()[0][0] > 0
    assert (out / "reports" / "index.html").exists()
    from warehouse.report import FIGURES

    assert f"{len(FIGURES)} of {len(FIGURES)} figures" in stdout
    assert "duckdb -init" in stdout and stdout.count("SELECT") == 2
    stages = re.findall(r"^  (\S.*?) +(\d+\.\d) s$", stdout, re.M)  # each stage's time, in order
    assert [name for name, _ in stages] == [
        "start-up (imports)", "read stdlib-docs", "train micro-tied", "train micro-untied",
        "extract minilm (1 checkpoint)", "extract micro-tied (3 checkpoints)", "extract micro-untied (3 checkpoints)",
        "report"]
    total = int(re.search(r"^demo finished in (\d+) s:$", stdout, re.M).group(1))
    assert abs(total - sum(float(s) for _, s in stages)) <= 3  # the stages are the whole run
    runs = con.execute("SELECT run_id FROM runs ORDER BY ALL").fetchall()
    shutil.copytree(out / "models" / "micro-tied" / "step2", out / "models" / "micro-tied" / "step9")  # another run's
    page = (out / "reports" / "index.html").read_bytes()
    code, stdout, err = run_cli(*args)  # again: nothing retrained or re-extracted, only this run's steps
    assert code == 0, err
    assert err.count("reusing it") == 2 and err.count("skipped") == 7
    assert connect(out / "warehouse").execute("SELECT run_id FROM runs ORDER BY ALL").fetchall() == runs
    # nor redrawn: the warehouse is as the report saw it (its counts as the first run printed them)
    assert "was drawn from this warehouse as it is now; kept" in err and "demo: report," not in err
    assert (out / "reports" / "index.html").read_bytes() == page
    assert f"{len(FIGURES)} of {len(FIGURES)} figures" in stdout


def test_demo_sizes_full_and_their_help():
    """`--full` is the larger run; an option given replaces its size; `demo --help` states both sizes."""
    import typer.main

    from extract.demo import FULL, DemoSettings, demo_settings
    from isotropy_warehouse.cli import app

    small = DemoSettings()
    assert demo_settings() == small and demo_settings(True) == FULL
    assert (FULL.steps, FULL.save_every, FULL.batch_size, FULL.max_tokens) == (600, 60, 16, 100_000)
    assert demo_settings(True, True, steps=4, max_tokens=None) == replace(FULL, steps=4, force=True)
    assert small.steps % small.save_every == 0 and small.steps < FULL.steps and small.max_tokens < FULL.max_tokens
    helps = {p.name: p.help for p in typer.main.get_command(app).commands["demo"].params}
    for name in ("steps", "save_every", "batch_size", "max_tokens"):
        assert f"(default {getattr(small, name):,}; --full {getattr(FULL, name):,})" in helps[name], name
