"""Past one process: torchrun ranks reduce their sums and commit one partial; Slurm array tasks take
their shard from the environment and commit their own partials; the warehouse equals the
single-process one."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys

import pytest

from common.errors import UserError
from conftest import ROOT, fork_popen, fork_run, one_thread, run_cli, same_numbers, same_rows, views
from extract.launch import Launch, detect, device_for

def test_detect_shard_from_the_environment():
    assert detect(None, {}) == Launch((1, 1), "single")
    assert detect((2, 3), {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}).shard == (2, 3)  # --shard wins
    assert detect((2, 3), {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}) == Launch((2, 3), "explicit")
    t = detect(None, {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"})
    assert t.shard == (1, 1) and t.reads == (4, 4) and t.distributed and t.local_rank == 1  # reduced: one partial
    u = detect((2, 3), {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"})  # docs ≡ 1 (mod 3) = ≡ 1, 4 (mod 6)
    assert u.shard == (2, 3) and u.reads == (5, 6) and u.launcher == "torchrun"
    assert device_for(t, None, True) == "cuda:1" and device_for(t, None, False) == "cpu"
    assert device_for(t, "cuda", True) == "cuda:1" and device_for(t, "cpu", True) == "cpu"
    s = detect(None, {"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_COUNT": "8", "SLURM_ARRAY_TASK_MIN": "0"})
    assert s.shard == (6, 8) and not s.distributed
    assert detect(None, {"SLURM_ARRAY_TASK_ID": "8", "SLURM_ARRAY_TASK_COUNT": "8", "SLURM_ARRAY_TASK_MIN": "1"}).shard == (8, 8)
    with pytest.raises(UserError, match="outside"):
        detect(None, {"SLURM_ARRAY_TASK_ID": "9", "SLURM_ARRAY_TASK_COUNT": "8"})
    with pytest.raises(UserError, match="not an integer"):
        detect(None, {"RANK": "x", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})


def torchrun(args, wh, shim, env_extra=None, timeout=600, nproc=2):
    """`torchrun --standalone --nproc_per_node NPROC cli.py extract ARGS`: the real launcher (its rendezvous,
    the variables it sets, its stopping the other ranks when one fails), forked from the tests' fork server,
    and its ranks forked too through the `python` stand-in (`--no-python SHIM cli.py …`; tests/zygote.py)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return fork_run([sys.executable, "-m", "torch.distributed.run", "--no-python", "--standalone", "--nproc_per_node",
                     str(nproc), str(shim), str(ROOT / "cli.py"), "extract", *map(str, args), "--warehouse", str(wh)],
                    capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def partials(wh) -> list[str]:
    """The committed data partials: entry keys of kind data."""
    import json

    entries = json.loads((wh / "manifest.json").read_text())["entries"]
    return sorted(k for k, e in entries.items() if e["kind"] == "data")


def test_torchrun_two_cpu_ranks_equal_one_process(single, workdir, python_shim):
    """The ranks reduce their sums (gloo) and rank 0 commits one partial per (checkpoint, source),
    labelled 1-of-1: the same partials as one process, every view equal (float32-stored vectors of
    float64 sums added in another order: at most one float32 ulp apart)."""
    wh = workdir / "scale-torchrun"
    proc = torchrun(single["args"], wh, python_shim)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[rank 0 of 2]" in proc.stderr and "[rank 1 of 2]" in proc.stderr
    got = views(wh)
    assert got["shards"] == [("main", s, "1-of-1") for s in ("alpha", "beta")]
    assert partials(wh) == partials(single["wh"])
    same_numbers(got, single["views"], tol=1e-6)


@pytest.fixture(scope="session")
def reduce_sources(workdir, sources):
    """A split source whose value 'Rare' occurs only in document 1 (read by rank 1 of 2 or 3 ranks)."""
    import json

    import tiny
    import zstandard

    path = workdir / "sources" / "split3.jsonl.zst"
    texts = tiny.corpus(18, seed=5)
    lines = "".join(json.dumps({"text": t, "meta": {"pile_set_name": "Rare" if i == 1 else "AB"[i % 2]}}) + "\n"
                    for i, t in enumerate(texts))
    path.write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
    return {**sources, "split3": path}


@pytest.fixture(scope="session")
def reduce_one(workdir, reduce_sources, model_factory):
    """One process over a plain source (moments, cross moments, per-window measures, a sample) and a
    split source, with `--batch-size 1` (each window's forward is the same whatever the other windows),
    float64-stored vectors and float64 moment products: what the ranks must equal to 1e-12."""
    model = model_factory("gpt_neox", tied=False)
    common = ["--model", str(model), "--max-length", "32", "--batch-size", "1", "--sample", "40",
              "--vector-dtype", "float64", "--moments-precision", "float64"]
    runs = [[*common, "--source", f"alpha={reduce_sources['alpha']}", "--moments", "--cross-moments", "--sequences",
             "--attention-moments", "--attention-sinks"],
            [*common, "--source", f"pile={reduce_sources['split3']}", "--split-by", "meta.pile_set_name"]]
    one = workdir / "reduce-one"
    with one_thread():  # as the ranks run (torchrun's OMP_NUM_THREADS=1): the same float32 forward
        for a in runs:
            code, _, err = run_cli("extract", *a, "--warehouse", one)
            assert code == 0, err
    return runs, one


def test_torchrun_reduce_equals_one_process_exactly(workdir, reduce_one, python_shim):
    """Three ranks (two: test_torchrun_two_cpu_ranks_equal_one_process): every accumulator reduced — token
    sums (ranks see different token types), layer sums, moments and cross moments, per-window measures and
    massive activations, the bottom-k sample, the per-head attention sums (with their second moments and
    sinks) — and a
    split value only one rank met: every view equals one process to 1e-12 (n exact), one partial
    per (checkpoint, source)."""
    runs, one = reduce_one
    many = workdir / "reduce-many"
    for a in runs:
        proc = torchrun(a, many, python_shim, nproc=3)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert partials(many) == partials(one)
    assert {s for _, s, _ in views(many)["shards"]} == {"alpha", "pile.A", "pile.B", "pile.Rare"}
    got, want = views(many), views(one)
    same_numbers(got, want, tol=1e-12)
    from warehouse.query import connect

    tables = {"token_sums": "layer, token_id, n, sum_sq", "layer_sums": "layer, n, sum_sq, windows, sum_abs, curv_sum",
              "moments": "layer, n", "samples": "layer, key, document, position, token_id",
              "massive": "layer, rank, abs_value, dim, token_id, document, position",
              "attention_sums": "layer, role, head, n, excluded, sum_sq, pair_cos, list_sum(sum), list_sum(sum_unit), "
                                "list_sum(s2), sink_n, sink_sum, sink_windows, sink_max_window"}
    a, b = connect(many), connect(one)
    for table, cols in tables.items():
        q = f"SELECT source, {cols} FROM {table} ORDER BY ALL"
        rows = a.execute(q).fetchall()
        assert rows, table
        same_rows(rows, b.execute(q).fetchall(), table, 1e-12)
    q = "SELECT source, layer, list_sum(vec), list_sum(list_transform(vec, lambda x: x * x)) FROM samples ORDER BY ALL"
    same_rows(a.execute(q).fetchall(), b.execute(q).fetchall(), "samples vec", 1e-12)


def test_torchrun_rank_killed_then_rerun_counts_once(single, workdir, python_shim):
    """A rank killed (torchrun stops the other): nothing committed.  Both ranks killed at the same point
    (the job preempted): nothing committed, rank 0's parameter tables left behind, never visible, found
    by validate and moved by --fix; the same command again counts every token once."""
    wh = workdir / "scale-torchrun-kill"
    # rank 1 dies before beta's reduce; torchrun stops rank 0 (SIGTERM), or rank 0 fails at the lost peer
    proc = torchrun(single["args"], wh, python_shim, {"ISO_FAULT": "reduce:2", "ISO_FAULT_RANK": "1"})
    assert proc.returncode != 0 and "exitcode  : -9" in proc.stderr, proc.stderr[-3000:]
    assert not (wh / "manifest.json").exists() or partials(wh) == []  # nothing committed
    proc = torchrun(single["args"], wh, python_shim, {"ISO_FAULT": "reduce:2"})  # both die before beta's reduce
    assert proc.returncode != 0
    assert not (wh / "manifest.json").exists() or partials(wh) == []
    proc = torchrun(single["args"], wh, python_shim)  # the same command again
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = views(wh)
    assert got["shards"] == [("main", s, "1-of-1") for s in ("alpha", "beta")]
    same_numbers(got, single["views"])
    code, out, _ = run_cli("validate", "--warehouse", wh)
    assert code == 1 and "not listed in the manifest" in out  # rank 0's parameter tables: never visible
    assert run_cli("validate", "--warehouse", wh, "--fix", "--grace", "0")[0] == 0
    assert run_cli("validate", "--warehouse", wh)[0] == 0


def test_slurm_array_script_sweeps_and_resumes(workdir, sources, model_factory, python_shim):
    root = workdir / "models" / "slurm"
    for step in ("step0", "step5"):
        shutil.copytree(model_factory("gpt_neox", tied=True), root / step)
    wh = workdir / "scale-slurm"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MODEL": str(root), "WAREHOUSE": str(wh),
           "CHECKPOINTS": "step0 step5", "SOURCES": f"alpha={sources['alpha']} beta={sources['beta']}",
           "SHARDS": "1", "PYTHON": str(python_shim), "SLURM_ARRAY_TASK_MIN": "0", "SLURM_ARRAY_TASK_COUNT": "4"}
    script = ROOT / "scripts" / "slurm" / "sweep.sbatch"

    def array(tasks):  # the array's tasks, all at once as Slurm starts them: {task: (exit code, stderr)}
        procs = {t: subprocess.Popen(["bash", str(script), "--max-length", "32"], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                     env={**env, "SLURM_ARRAY_TASK_ID": str(t), "OMP_NUM_THREADS": "1"})
                 for t in tasks}
        errs = {t: p.communicate(timeout=300)[1] for t, p in procs.items()}
        return {t: (procs[t].returncode, err) for t, err in errs.items()}

    for task, (code, err) in array([0, 1, 3]).items():  # task 2 was "preempted"
        assert code == 0, err[-2000:]
    assert len(views(wh)["shards"]) == 3
    for task, (code, err) in array(range(4)).items():  # the whole array resubmitted: only task 2 runs
        assert code == 0, err[-2000:]
        assert ("already in the warehouse with these settings; skipped" in err) == (task != 2), (task, err)
    code, _, err = run_cli("merge", "--warehouse", wh)  # the tasks appended (--no-fold): one fold
    assert code == 0 and "folded 4 pending partial(s)" in err, err
    got = views(wh)
    assert got["shards"] == sorted((c, s, "1-of-1") for c in ("step0", "step5") for s in ("alpha", "beta"))
    one = workdir / "scale-slurm-one"
    code, _, err = run_cli("extract", "--model", root, "--checkpoints", "all", "--source", f"alpha={sources['alpha']}",
                           "--source", f"beta={sources['beta']}", "--max-length", 32, "--warehouse", one)
    assert code == 0, err
    same_numbers(got, views(one))
    code, err = array([4])[4]
    assert code == 2 and "outside the 4 units" in err


def test_slurm_array_environment_picks_the_shard(single, workdir):
    wh = workdir / "scale-slurm-env"
    procs = {}
    for task in (1, 2):  # the two tasks of one array, at the same time
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "SLURM_ARRAY_TASK_ID": str(task),
               "SLURM_ARRAY_TASK_COUNT": "2", "SLURM_ARRAY_TASK_MIN": "1"}
        procs[task] = fork_popen([sys.executable, str(ROOT / "cli.py"), "extract", *single["args"], "--warehouse",
                                  str(wh)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    for task, p in procs.items():
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
        assert f"shard {task}/2 (slurm-array)" in err
    same_numbers(views(wh), single["views"])


@pytest.mark.parametrize("batching", [[], ["--batch-tokens", "40"], ["--batch-tokens", "200", "--batch-size", "3"]])
def test_batching_by_tokens_gives_the_same_numbers(single, workdir, batching):
    """Token-budget batches (the default: 8 windows' worth, ≥ 4,096 tokens; a small budget; a budget
    with a window cap) against the fixed 2-window batches of
    `single`: the same views, to the float32 forward's noise (padding and batch shape change its
    rounding)."""
    args = [a for a in single["args"] if a not in ("--batch-size", "2")]
    wh = workdir / ("batching-" + ("-".join(batching[1::2]) or "default"))
    code, _, err = run_cli("extract", *args, *batching, "--warehouse", wh)
    assert code == 0, err
    same_numbers(views(wh), single["views"])


def test_sweep_file_equals_the_runs_by_hand(workdir, sources, model_factory, python_shim):
    """A TOML sweep (2 models, one with 2 checkpoints, 2 sources one of them split, 2 shards = 12 units):
    its plan, a Slurm array run in part (3 tasks), the plan again, the rest run by `sweep` itself,
    and the warehouse equal to the 12 `cli.py extract` commands it prints, run by hand."""
    root = workdir / "models" / "sweep-file"
    for step in ("step0", "step5"):
        shutil.copytree(model_factory("gpt_neox", tied=True), root / step)
    other = model_factory("llama")
    wh, by_hand = workdir / "sweep-file-wh", workdir / "sweep-file-by-hand"
    config = workdir / "sweep.toml"
    text = f'''
warehouse = "{wh}"
models = [{{ model = "{root}", checkpoints = "all" }}, "{other}"]
shards = 2

[sources]
alpha = "{sources['alpha']}"
beta = {{ source = "{sources['beta']}", split-by = "meta.pile_set_name" }}

[settings]
max_length = 32
batch-size = 2
moments = true
count-special-tokens = false

[slurm]
sbatch = ["--time=1:00:00"]
parallel = 2
python = "{python_shim}"
'''
    config.write_text(text)

    def plan():
        code, out, err = run_cli("sweep", config, "--plan")
        assert code == 0, err
        return out.splitlines()

    lines = plan()
    assert "12 units (3 model checkpoint(s) × 2 source(s) × 2 shard(s)): 0 done, 12 to run" in lines[0]
    assert lines[1].split() == ["0", "to", "run", "sweep-file@step0", "alpha", "shard", "1/2"]
    assert lines[12].split()[3:] == ["llama-untied@main", "beta", "shard", "2/2"]
    script = workdir / "sweep.sbatch"
    code, out, err = run_cli("sweep", config, "--slurm", script)
    assert code == 0 and f"sbatch {script}" in err, err
    body = script.read_text()
    assert "#SBATCH --array=0-11%2\n" in body and "#SBATCH --time=1:00:00\n" in body

    def task(t, path=script):  # one array task as Slurm starts it
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "SLURM_ARRAY_TASK_ID": str(t)}
        return subprocess.Popen(["bash", str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env, cwd=workdir)

    procs = {t: task(t) for t in (0, 6, 9)}  # 3 of the 12 tasks ran, then the job was cancelled
    for t, p in procs.items():
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
        assert f"unit {t}: " in err
    lines = plan()
    assert ": 3 done, 9 to run" in lines[0]
    assert [line.split()[0] for line in lines[1:] if " done " in line] == ["0", "6", "9"]
    code, _, err = run_cli("sweep", config, "--slurm", script)  # written again: only what is left
    assert code == 0, err
    assert "#SBATCH --array=1-5,7-8,10-11%2\n" in script.read_text()

    code, _, err = run_cli("sweep", config)  # the rest, in this process
    assert code == 0, err
    assert ": 3 done, 9 to run" in err and "sweep-file@step0 alpha" in err
    assert ": 12 done, 0 to run" in plan()[0]
    code, _, err = run_cli("sweep", config)  # nothing left: nothing runs
    assert code == 0 and "done: 0 tokens" in err, err
    code, _, err = run_cli("sweep", config, "--slurm", workdir / "none.sbatch")
    assert code == 0 and "nothing to run" in err and not (workdir / "none.sbatch").exists()

    code, out, err = run_cli("sweep", config, "--commands", "--warehouse", by_hand)
    assert code == 0, err
    commands = out.splitlines()
    assert len(commands) == 12
    assert commands[2].endswith(f"--source beta={sources['beta']} --shard 1/2 --warehouse {by_hand} --skip-done "
                                "--max-length 32 --batch-size 2 --moments --no-count-special-tokens "
                                "--split-by meta.pile_set_name")
    for line in commands:  # the same runs by hand
        args = shlex.split(line)
        assert args[:3] == ["python", str(ROOT / "cli.py"), "extract"]
        code, _, err = run_cli(*args[2:])
        assert code == 0, err
    got, want = views(wh), views(by_hand)
    assert got["shards"] == want["shards"] and len(got["shards"]) == 3 * 2 * 2  # beta's one value: beta.Beta
    assert {s for _, s, _ in got["shards"]} == {"alpha", "beta.Beta"}
    same_numbers(got, want)  # commit order differs: float32-stored vectors of split tokens merge to ~1e-8

    config.write_text(text.replace("max_length = 32", "max_length = 24"))  # the file changed after --slurm
    p = task(1)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 2 and "no longer gives the plan the Slurm script was written for" in err, err
    assert len(err.strip().splitlines()) == 1


def test_sweep_of_parameter_tables_only(workdir, model_factory):
    root = workdir / "models" / "sweep-params"
    for step in ("step0", "step5", "step9"):
        shutil.copytree(model_factory("gpt_neox", tied=True), root / step)
    config = workdir / "sweep-params.toml"
    config.write_text(f'warehouse = "{workdir / "sweep-params-wh"}"\nmodels = ["{root}"]\ncheckpoints = 2\n'
                      "[settings]\nparams_only = true\n")
    code, out, err = run_cli("sweep", config, "--plan")
    assert code == 0, err
    assert "2 units (2 model checkpoint(s), parameters only × 1 shard(s)): 0 done, 2 to run" in out
    assert "sweep-params@step0 (parameters)" in out and "sweep-params@step9 (parameters)" in out
    assert run_cli("sweep", config)[0] == 0
    assert ": 2 done, 0 to run" in run_cli("sweep", config, "--plan")[1]


@pytest.mark.parametrize("text, message", [
    ("models = [", "not valid TOML"),
    ('modles = ["m"]', "modles: unknown key"),
    ('sources = {a = "x.txt"}', "models: expected a list of models"),
    ('models = [3]\n[sources]\na = "x.txt"', "models[0]: expected a model name"),
    ('models = [{ model = "MODEL", checkpoint = "step0" }]\n[sources]\na = "x.txt"', "unknown key 'checkpoint'"),
    ('models = ["MODEL", "MODEL"]\n[sources]\na = "SRC"', "a model is named twice"),
    ('models = ["MODEL"]', "sources: name at least one source"),
    ('models = ["MODEL"]\ncheckpoints = 0\n[sources]\na = "SRC"', "checkpoints: a count must be at least 1"),
    ('models = ["MODEL"]\nshards = "2"\n[sources]\na = "SRC"', "shards: expected a positive integer"),
    ('models = ["MODEL"]\n[sources]\na = 3', "sources.a: expected \"PATH\""),
    ('models = ["MODEL"]\n[sources]\na = { source = "SRC", unit = "sentence" }', "sources.a.unit: not a source option"),
    ('models = ["MODEL"]\n[sources]\na = "SRC"\n[settings]\nunits = "sentence"', "settings.units: not an option"),
    ('models = ["MODEL"]\n[sources]\na = "SRC"\n[settings]\nmax_length = "32"', "settings.max_length: expected an integer"),
    ('models = ["MODEL"]\n[sources]\na = "SRC"\n[settings]\nmoments = 1', "settings.moments: expected true or false"),
    ('models = ["MODEL"]\n[sources]\na = "SRC"\n[settings]\ncheckpoint = "step0"', "given by the sweep's checkpoints"),
    ('models = ["MODEL"]\n[sources]\na = "SRC"\n[settings]\nunit = "word"', "--unit 'word': expected document or sentence"),
    ('models = ["MODEL"]\n[sources]\na = "SRC"\n[slurm]\nparallel = 0', "slurm.parallel: expected a positive integer"),
    ('models = ["MODEL"]\n[sources]\na = "/no/such.jsonl"', "/no/such.jsonl"),
    ('models = ["nosuchmodel"]\n[sources]\na = "SRC"', "unknown model 'nosuchmodel'"),
])
def test_bad_sweep_files_are_refused_in_one_line(workdir, sources, model_factory, text, message):
    config = workdir / "bad-sweep.toml"
    config.write_text(text.replace("MODEL", str(model_factory("gpt_neox", tied=True)))
                      .replace("SRC", str(sources["alpha"])))
    code, out, err = run_cli("sweep", config, "--plan", "--warehouse", workdir / "bad-sweep-wh")
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (workdir / "bad-sweep-wh").exists()


def test_sweep_command_line_mistakes(workdir):
    assert "no such sweep file" in run_cli("sweep", workdir / "missing.toml")[2]
    code, _, err = run_cli("sweep", workdir / "missing.toml", "--task", "1", "--plan")
    assert code == 2 and "--task runs one unit" in err
    code, _, err = run_cli("sweep", workdir / "missing.toml", "--plan-id", "abc")
    assert code == 2 and "--plan-id goes with --task" in err


def test_sweep_settings_spell_every_option_as_the_command_line(tmp_path, monkeypatch):
    """Every extract option a sweep file may set (extract/declared.py, not the command's signature), set
    away from its default in [settings] or a source's table, comes back from the unit's `--commands` line
    through `cli.py extract` as the same value: the sweep's spellings are the command line's."""
    import json

    import extract.options
    from extract import sweep as sw
    from extract.declared import OPTIONS, SOURCE_OPTIONS

    values = {"flag": None, "int": 7, "str": "x", "list": ["a", "b"], "path": str(tmp_path / "spill")}
    settings, per_source = {}, {}
    for o in OPTIONS:
        if o.name in sw.RESERVED or o.name in ("model", "checkpoints", "name"):
            continue
        value = (o.default is not True) if o.kind == "flag" else values[o.kind]  # away from the default
        (per_source if o.name in SOURCE_OPTIONS else settings)[o.name] = value
    settings["name"] = "named"
    settings["moments"] = False  # its off spelling
    config = tmp_path / "every.toml"
    toml = lambda d: "\n".join(f"{k.replace('_', '-')} = {json.dumps(v)}" for k, v in d.items())  # noqa: E731
    config.write_text(f'models = ["m"]\n[sources.a]\nsource = "a.txt"\n{toml(per_source)}\n[settings]\n{toml(settings)}\n')
    spec = sw.read_config(config)
    line, = sw.commands(spec, sw.units(spec, lambda model, checkpoints: ["main"]), warehouse="wh")
    args = shlex.split(line)
    assert args[:3] == ["python", "cli.py", "extract"]
    seen = {}

    def spy(options, launch=None):
        seen.update(options)
        raise UserError("stop here")

    monkeypatch.setattr(extract.options, "prepare", spy)
    code, _, err = run_cli(*args[2:])
    assert code == 2 and "stop here" in err, err
    for name, value in {**settings, **per_source}.items():
        got = str(seen[name]) if name == "spill_dir" else seen[name]  # a path on the command line
        assert got == value, (name, got, value)
    assert seen["skip_done"] is True and seen["shard"] == "1/1" and seen["warehouse"] == "wh"
