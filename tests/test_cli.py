"""The command line: help with examples, one-line errors, --params-only, summaries."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT, fork_run, run_cli
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


# The query side as a user runs it: the commands one after another in one fresh interpreter, after each
# the modules loaded so far (they only grow: the first command that loads torch is named).
_LOADED = ("import json, runpy, sys\n"
           "for argv in json.loads(sys.argv[1]):\n"
           "    sys.argv = argv\n"
           "    try:\n        runpy.run_path(argv[0], run_name='__main__')\n"
           "    except SystemExit as e:\n        code = e.code\n    else:\n        code = 0\n"
           "    print('LOADED', argv[1], code, ' '.join(m for m in ('torch', 'transformers', 'accelerate') "
           "if m in sys.modules), flush=True)\n")
QUERY_SIDE = [
    ["sql", "SELECT count(*) FROM inter_sim, anisotropy, isotropy, intrinsic_dim, linearity"],
    ["validate"], ["views"], ["report", "--out", "{tmp}/report"], ["pull", "--to", "{tmp}/copy"], ["compact"], ["merge"],
]


def test_query_side_imports_neither_torch_nor_transformers(single, tmp_path):
    """sql, report, validate, views, pull, compact and merge never load torch or transformers (start-up
    cost): each succeeds (on its own copy of the warehouse: compact rewrites it) and leaves neither loaded."""
    import json
    import shutil

    runs = []
    for i, command in enumerate(QUERY_SIDE):
        wh, tmp = tmp_path / f"wh{i}", tmp_path / f"out{i}"
        shutil.copytree(single["wh"], wh)
        runs.append(["cli.py", *[a.replace("{tmp}", str(tmp)) for a in command], "--warehouse", str(wh)])
    out = subprocess.run([sys.executable, "-c", _LOADED, json.dumps(runs)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    lines = [x.split() for x in out.stdout.splitlines() if x.startswith("LOADED")]
    assert [x[1] for x in lines] == [c[0] for c in QUERY_SIDE], out.stderr[-2000:]
    for command, line in zip(QUERY_SIDE, lines):
        assert line[2] == "0", (command, out.stderr[-2000:] + out.stdout[-2000:])  # the command succeeded
        assert line[3:] == [], f"{command[0]} imported {line[3:]}"


def test_extract_help_lists_every_declared_option_in_its_group():
    """`extract --help` shows the declared groups in order, each option under its own group (and
    `--scatter`, removed, nowhere), with the command's examples."""
    from extract.declared import GROUPS, OPTIONS

    code, out, _ = run_cli("extract", "--help")
    assert code == 0 and "Example:" in out and "--scatter" not in out
    titles = [title for _, title in GROUPS]
    at = [out.index(f"\n{title}:\n") for title in titles]
    assert at == sorted(at) and "\nOptions:\n" not in out
    ends = at[1:] + [out.index("\nOther options:\n")]
    for o in OPTIONS:
        g = [key for key, _ in GROUPS].index(o.group)
        section = out[at[g]:ends[g]]
        assert f" {o.flag}" in section, (o.name, titles[g])
        if o.off:
            assert f"{o.flag} / {o.off}" in section, o.name


def test_every_command_defaults_to_the_same_warehouse_outside_the_source_tree(tmp_path):
    """One default warehouse (common/default_warehouse.py): every command's --warehouse, a sweep file
    without `warehouse`, and warehouse.query's functions; ISOTROPY_WAREHOUSE changes it for all."""
    import inspect
    import os

    from typer.main import get_command

    import cli
    from common.default_warehouse import DEFAULT_WAREHOUSE
    from extract import sweep as sw
    from warehouse import query

    assert DEFAULT_WAREHOUSE == (os.environ.get("ISOTROPY_WAREHOUSE") or "isotropy-warehouse")
    defaults = {name: p.default for name, c in get_command(cli.app).commands.items() for p in c.params
                if p.name == "warehouse"}
    assert {"extract", "sql", "validate", "merge", "compact", "views", "pull", "report", "train"} <= set(defaults)
    assert defaults.pop("sweep") is None  # there --warehouse overrides the file's, whose default is this one
    assert set(defaults.values()) == {DEFAULT_WAREHOUSE}, defaults
    config = tmp_path / "sweep.toml"
    config.write_text('models = ["m"]\n[sources]\na = "a.txt"\n')
    assert sw.read_config(config).warehouse == DEFAULT_WAREHOUSE
    for f in (query.connect, query.sql, query.view, query.isoscore_star):
        p = list(inspect.signature(f).parameters.values())
        assert [x.default for x in p if x.name in ("root", "warehouse")] == [DEFAULT_WAREHOUSE], f.__name__
    env = {**os.environ, "ISOTROPY_WAREHOUSE": "s3://bucket/elsewhere"}
    out = subprocess.run([sys.executable, "cli.py", "views", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0 and "[default: s3://bucket/elsewhere]" in " ".join(out.stdout.split()), out.stdout


def test_a_default_extract_leaves_the_checkout_clean(tmp_path, model_factory, sources):
    """`python cli.py extract` without --warehouse, in a copy of the checkout, writes only under the
    ignored ./isotropy-warehouse (never into the source package `warehouse/`): `git status` stays clean."""
    import os
    import shutil

    def git(*args, cwd):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd,
                              capture_output=True, text=True, timeout=120)

    listed = git("ls-files", "-z", cwd=ROOT)
    if shutil.which("git") is None or listed.returncode != 0:
        pytest.skip("not a git checkout")
    copy = tmp_path / "checkout"
    for rel in filter(None, listed.stdout.split("\0")):
        if (ROOT / rel).is_file():
            (copy / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, copy / rel)
    assert git("init", "-q", cwd=copy).returncode == 0
    git("add", "-A", cwd=copy)
    assert git("commit", "-qm", "copy", cwd=copy).returncode == 0
    env = {k: v for k, v in os.environ.items() if k != "ISOTROPY_WAREHOUSE"}

    def package_files():  # the source tree the forked child's modules come from: it must not be written either
        return sorted(p for d in ("warehouse", "extract", "common", "isotropy_warehouse") for p in (ROOT / d).rglob("*")
                      if "__pycache__" not in p.parts)

    before = package_files()
    # forked (tests/zygote.py): the child's working directory is the subject, and it runs the copy's cli.py
    run = fork_run([sys.executable, "cli.py", "extract", "--model", str(model_factory("gpt_neox")),
                    "--source", f"alpha={sources['alpha']}", "--max-tokens", "200"],
                   cwd=copy, capture_output=True, text=True, timeout=300, env={**env, "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert package_files() == before
    assert "warehouse: isotropy-warehouse" in run.stderr and (copy / "isotropy-warehouse" / "views.sql").is_file()
    assert git("status", "--porcelain", "--untracked-files=all", cwd=copy).stdout == ""
    ignored = git("status", "--porcelain", "--ignored", "--untracked-files=all", cwd=copy).stdout.splitlines()
    written = [line[3:] for line in ignored if "__pycache__/" not in line]
    assert written and all(p.startswith("isotropy-warehouse/") for p in written), written


MAPPED_AFTER_A_24_MIB_BLOCK = """
import ctypes, sys
class Info(ctypes.Structure):  # glibc's struct mallinfo2: ten size_t fields, hblks the fourth
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = (ctypes.c_size_t,)
before = libc.mallinfo2().hblks
block = libc.malloc(24 << 20)
print(libc.mallinfo2().hblks - before, 'torch' in sys.modules)
"""


def _glibc_with_mallinfo2() -> bool:
    import ctypes
    import platform

    return platform.libc_ver()[0] == "glibc" and hasattr(ctypes.CDLL(None), "mallinfo2")


@pytest.mark.skipif(not _glibc_with_mallinfo2(), reason="glibc's malloc (2.33 or later: mallinfo2)")
def test_the_command_line_keeps_freed_memory_for_reuse():
    """cli.py's main raises glibc's mmap threshold (common/allocator.py; at least to 32 MiB, which every
    glibc accepts): a fresh process's 24 MiB block, which glibc would map on its own (its threshold starts
    at 128 KiB), comes from the heap instead; without the call, or with the user's own malloc settings, it
    is mapped; torch is not loaded for it."""
    from common import allocator

    cli_main = ("import sys; sys.argv = ['cli', '--help']\nimport isotropy_warehouse.cli as c\n"
                "try:\n    c.main()\nexcept SystemExit:\n    pass\n")
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES" and not k.startswith("MALLOC_")}

    def mapped(code, extra=None):
        out = subprocess.run([sys.executable, "-c", code + MAPPED_AFTER_A_24_MIB_BLOCK], cwd=ROOT,
                             env={**env, **(extra or {})}, capture_output=True, text=True, check=True)
        return out.stdout.split()[-2:]

    assert mapped(cli_main) == ["0", "False"]
    assert mapped("") == ["1", "False"]
    assert mapped(cli_main, {"MALLOC_TRIM_THRESHOLD_": "131072"}) == ["1", "False"]  # the user's own setting
    assert allocator.keep_freed_memory({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}) == 0
    out = subprocess.run([sys.executable, "-c", "from common.allocator import keep_freed_memory as k; print(k({}))"],
                         cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert int(out.stdout) in (allocator.MMAP_THRESHOLD, 32 << 20)  # what this glibc accepts
