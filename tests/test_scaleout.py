"""Past one process: torchrun ranks and Slurm array tasks take their shard from the environment,
commit their own partials, and the warehouse equals the single-process one."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from common.errors import UserError
from conftest import ROOT, run_cli, same_numbers, views
from extract.launch import Launch, detect, device_for

def test_detect_shard_from_the_environment():
    assert detect(None, {}) == Launch((1, 1), "single")
    assert detect((2, 3), {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}).shard == (2, 3)  # --shard wins
    t = detect(None, {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"})
    assert t.shard == (4, 4) and t.distributed and t.local_rank == 1
    assert device_for(t, None, True) == "cuda:1" and device_for(t, None, False) == "cpu"
    assert device_for(t, "cuda", True) == "cuda:1" and device_for(t, "cpu", True) == "cpu"
    s = detect(None, {"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_COUNT": "8", "SLURM_ARRAY_TASK_MIN": "0"})
    assert s.shard == (6, 8) and not s.distributed
    assert detect(None, {"SLURM_ARRAY_TASK_ID": "8", "SLURM_ARRAY_TASK_COUNT": "8", "SLURM_ARRAY_TASK_MIN": "1"}).shard == (8, 8)
    with pytest.raises(UserError, match="outside"):
        detect(None, {"SLURM_ARRAY_TASK_ID": "9", "SLURM_ARRAY_TASK_COUNT": "8"})
    with pytest.raises(UserError, match="not an integer"):
        detect(None, {"RANK": "x", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})


def torchrun(args, wh, env_extra=None, timeout=600):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(ROOT / "cli.py"), "extract", *args, "--warehouse", str(wh)],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def test_torchrun_two_cpu_ranks_equal_one_process(single, workdir):
    wh = workdir / "scale-torchrun"
    proc = torchrun(single["args"], wh)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[rank 0 of 2]" in proc.stderr and "[rank 1 of 2]" in proc.stderr
    got = views(wh)
    assert got["shards"] == [("main", s, f"{i}-of-2") for s in ("alpha", "beta") for i in (1, 2)]
    same_numbers(got, single["views"])


def test_torchrun_rank_killed_then_rerun_counts_once(single, workdir):
    wh = workdir / "scale-torchrun-kill"
    proc = torchrun(single["args"], wh, {"ISO_FAULT": "close:2", "ISO_FAULT_RANK": "1"})  # rank 1 dies mid-write
    assert proc.returncode != 0
    proc = torchrun(single["args"], wh)  # the same command again
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = views(wh)
    assert got["shards"] == [("main", s, f"{i}-of-2") for s in ("alpha", "beta") for i in (1, 2)]
    same_numbers(got, single["views"])
    code, out, _ = run_cli("validate", "--warehouse", wh)
    assert code == 1 and "not listed in the manifest" in out  # the killed rank's files: never visible
    assert run_cli("validate", "--warehouse", wh, "--fix")[0] == 0
    assert run_cli("validate", "--warehouse", wh)[0] == 0


def test_slurm_array_script_sweeps_and_resumes(workdir, sources, model_factory):
    root = workdir / "models" / "slurm"
    for step in ("step0", "step5"):
        shutil.copytree(model_factory("gpt_neox", tied=True), root / step)
    wh = workdir / "scale-slurm"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MODEL": str(root), "WAREHOUSE": str(wh),
           "CHECKPOINTS": "step0 step5", "SOURCES": f"alpha={sources['alpha']} beta={sources['beta']}",
           "SHARDS": "1", "PYTHON": sys.executable, "SLURM_ARRAY_TASK_MIN": "0", "SLURM_ARRAY_TASK_COUNT": "4"}
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
        procs[task] = subprocess.Popen([sys.executable, str(ROOT / "cli.py"), "extract", *single["args"],
                                        "--warehouse", str(wh)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True, env=env, cwd=ROOT)
    for task, p in procs.items():
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
        assert f"shard {task}/2 (slurm-array)" in err
    same_numbers(views(wh), single["views"])


@pytest.mark.parametrize("batching", [[], ["--batch-tokens", "40"], ["--batch-tokens", "200", "--batch-size", "3"],
                                      ["--batch-tokens", "40", "--scatter", "segment"]])
def test_batching_by_tokens_gives_the_same_numbers(single, workdir, batching):
    """Token-budget batches (the default: 8 windows' worth, ≥ 4,096 tokens; a small budget; a budget
    with a window cap; the sort-and-segment token sums) against the fixed 2-window batches of
    `single`: the same views, to the float32 forward's noise (padding and batch shape change its
    rounding)."""
    args = [a for a in single["args"] if a not in ("--batch-size", "2")]
    wh = workdir / ("batching-" + ("-".join(batching[1::2]) or "default"))
    code, _, err = run_cli("extract", *args, *batching, "--warehouse", wh)
    assert code == 0, err
    same_numbers(views(wh), single["views"])
