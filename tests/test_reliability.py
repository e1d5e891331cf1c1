"""Reliability: kill -9 anywhere, concurrent writers, and the catalogue of bad input.

Kills are injected with ISO_FAULT=point[:n] (common/faults.py), which SIGKILLs the extract
process the n-th time it reaches the point: while reading, after a forward pass, while writing
Parquet, before a file is renamed into place, before and after the manifest is replaced, before
stale files are removed, before the derived tables are committed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import ROOT, fork_popen, fork_run, run_cli
from common.errors import UserError
from extract.sources import ReadStats, Source, documents
from warehouse.query import connect

VIEWS = ["inter_sim", "inter_sim_by_source", "intra_sim", "avg_intra_sim", "isotropy", "layernorm",
         "anisotropy", "linearity", "intrinsic_dim", "inter_sim_types"]
# (point, n): where the process dies; commit = the kill comes after the manifest was replaced
KILLS = [("read", 1), ("forward", 1), ("write", 1), ("close", 1), ("close", 4), ("merge", 1), ("manifest", 1),
         ("views", 1), ("gc", 1)]  # (S3: tests/test_s3.py kills at "merge" too)
AFTER_COMMIT = {"views", "gc"}


def snapshot(wh: Path) -> dict:
    con = connect(wh, views=[*VIEWS, "runs"])
    out = {v: sorted(tuple(round(x, 9) if isinstance(x, float) else x for x in r)
                     for r in con.execute(f"SELECT * FROM {v}").fetchall()) for v in VIEWS}
    out["runs"] = sorted(con.execute("SELECT kind, model, checkpoint, source, shard, tokens FROM runs "
                                     "WHERE kind <> 'merged'").fetchall())
    con.close()
    return out


def extract_args(model, sources, wh):
    return ["extract", "--model", str(model), "--source", f"alpha={sources['alpha']}", "--source",
            f"beta={sources['beta']}", "--warehouse", str(wh), "--max-length", "32", "--batch-size", "2",
            "--moments", "--sample", "50"]


def run_subprocess(args, fault=None, timeout=300, real=False):
    """`python cli.py ARGS` in a process of its own (forked from the tests' fork server; `real`: a fresh
    interpreter), killed at `fault` (ISO_FAULT)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if fault:
        env["ISO_FAULT"] = fault
    return (subprocess.run if real else fork_run)([sys.executable, str(ROOT / "cli.py"), *args], capture_output=True,
                                                 text=True, timeout=timeout, env=env, cwd=ROOT)


@pytest.fixture(scope="session")
def base(workdir, sources, model_factory):
    """A warehouse holding alpha only, and the state an uninterrupted alpha+beta run leads to."""
    model = model_factory("gpt_neox", tied=False)
    before = workdir / "rel-before"
    code, _, err = run_cli("extract", "--model", model, "--source", f"alpha={sources['alpha']}", "--warehouse",
                           before, "--max-length", 32, "--moments", "--sample", 50)
    assert code == 0, err
    after = workdir / "rel-after"
    shutil.copytree(before, after)
    code, _, err = run_cli(*extract_args(model, sources, after))
    assert code == 0, err
    return {"model": model, "before": before, "snap_before": snapshot(before), "snap_after": snapshot(after)}


@pytest.mark.parametrize("point,n", KILLS)
def test_kill_9_anywhere(base, sources, workdir, point, n):
    wh = workdir / f"rel-kill-{point}-{n}"
    shutil.copytree(base["before"], wh)
    proc = run_subprocess(extract_args(base["model"], sources, wh), fault=f"{point}:{n}")
    assert proc.returncode == -9, proc.stderr[-2000:]
    state = snapshot(wh)
    want = base["snap_after"] if point in AFTER_COMMIT else base["snap_before"]
    assert state == want  # all of the run or none of it, never a part
    code, _, err = run_cli(*extract_args(base["model"], sources, wh))  # the same command again
    assert code == 0, err
    assert snapshot(wh) == base["snap_after"]
    code, out, _ = run_cli("validate", "--warehouse", wh, "--fix", "--grace", "0")
    assert code == 0
    code, out, _ = run_cli("validate", "--warehouse", wh)
    assert code == 0, out


def test_a_sweep_resumes_where_it_stopped(workdir, sources, model_factory):
    root = workdir / "models" / "sweep"
    for step in ("step0", "step5", "step10"):
        shutil.copytree(model_factory("gpt_neox", tied=True), root / step)
    wh = workdir / "rel-sweep"
    args = ["extract", "--model", str(root), "--checkpoints", "all", "--source", f"alpha={sources['alpha']}",
            "--warehouse", str(wh), "--max-tokens", "100", "--max-length", "16", "--batch-size", "2", "--skip-done"]
    proc = run_subprocess(args, fault="forward:6")  # 4 batches per checkpoint: dies inside the second one
    assert proc.returncode == -9
    done = {r[0] for r in connect(wh).execute("SELECT DISTINCT checkpoint FROM inter_sim").fetchall()}
    assert done == {"step0"}
    code, _, err = run_cli(*args)
    assert code == 0, err
    assert err.count("already in the warehouse with these settings; skipped") == len(done)
    assert {r[0] for r in connect(wh).execute("SELECT DISTINCT checkpoint FROM inter_sim").fetchall()} == {
        "step0", "step5", "step10"}


def test_concurrent_writers(workdir, sources, model_factory):
    model = model_factory("gpt_neox", tied=False)
    common = ["--model", str(model), "--source", f"alpha={sources['alpha']}", "--max-length", "32"]
    # different shards at the same time: both land, equal to running them one after the other
    par, seq, same, one = (workdir / f"rel-{k}" for k in ("par", "seq", "same", "one"))
    start = lambda wh, *extra: fork_popen(  # noqa: E731
        [sys.executable, str(ROOT / "cli.py"), "extract", *common, "--warehouse", str(wh), *extra], cwd=ROOT,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})

    def done(p):  # True, or the end of the failed run's stderr (for the assertion's message)
        err = p.communicate(timeout=300)[1]
        return p.returncode == 0 or err[-2000:]

    procs = [start(par, "--shard", s) for s in ("1/2", "2/2")]
    assert [done(p) for p in procs] == [True, True]
    for s in ("1/2", "2/2"):
        assert run_cli("extract", *common, "--warehouse", seq, "--shard", s)[0] == 0
    assert snapshot(par) == snapshot(seq)
    assert run_cli("extract", *common, "--warehouse", one)[0] == 0  # the reference for the race below
    # the same shard twice at the same time: one complete copy, never both, never a mix
    procs = [start(same) for _ in range(2)]
    assert [done(p) for p in procs] == [True, True]
    assert snapshot(same) == snapshot(one)
    manifest = json.loads((same / "manifest.json").read_text())
    assert sum(e["kind"] == "data" for e in manifest["entries"].values()) == 1
    files = sorted(p.name for p in (same / "tables" / "token_sums").rglob("*.parquet"))
    assert len(files) == 1  # the loser's files were removed
    assert run_cli("validate", "--warehouse", same)[0] == 0


# ---------------------------------------------------------------- bad input catalogue


def _bad_files(d: Path, sources) -> dict[str, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    d.mkdir(parents=True, exist_ok=True)
    (d / "empty.txt").write_text("")
    (d / "blank.txt").write_text("\n\n   \n")
    (d / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    (d / "bad.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
    (d / "notext.jsonl").write_text('{"body": "no text field"}\n')
    data = sources["beta"].read_bytes()
    (d / "trunc.jsonl.zst").write_bytes(data[: len(data) // 2])
    pq.write_table(pa.table({"body": ["x"]}), d / "nocolumn.parquet")
    (d / "other.jsonl").write_text(json.dumps({"text": "x", "meta": {"pile_set_name": "Other"}}) + "\n")
    (d / "unreadable.txt").write_text("x\n")
    os.chmod(d / "unreadable.txt", 0)
    (d / "doc.csv").write_text("text\nx\n")
    return {p.stem.split(".")[0]: p for p in d.iterdir()}


def bad_cases(files, sources, models, wh):
    a = f"alpha={sources['alpha']}"
    neox = str(models["neox"])
    return {
        "missing source file": (["--model", neox, "--source", "x=/nonexistent/file.txt"], "no such file"),
        "unreadable source file": (["--model", neox, "--source", f"x={files['unreadable']}"], "cannot read"),
        "unsupported format": (["--model", neox, "--source", f"x={files['doc']}"], "unsupported format"),
        "empty source": (["--model", neox, "--source", f"x={files['empty']}"], "no tokens to process"),
        "only blank lines": (["--model", neox, "--source", f"x={files['blank']}"], "no tokens to process"),
        "zero tokens after --pile-set": (["--model", neox, "--source", f"x={files['other']}", "--pile-set", "Enron Emails"], "no tokens to process"),
        "non-UTF-8 bytes": (["--model", neox, "--source", f"x={files['latin1']}"], "latin1.txt:1: bytes that are not UTF-8"),
        "malformed JSONL line": (["--model", neox, "--source", f"x={files['bad']}"], "bad.jsonl:2: malformed JSON line"),
        "JSONL without text": (["--model", neox, "--source", f"x={files['notext']}"], "notext.jsonl:1: JSON line has no string field 'text'"),
        "truncated .zst": (["--model", neox, "--source", f"x={files['trunc']}"], "truncated zstd stream"),
        "Parquet without text": (["--model", neox, "--source", f"x={files['nocolumn']}"], "Parquet file has no 'text' column"),
        "unknown model alias": (["--model", "pythia-13m", "--source", a], "unknown model 'pythia-13m'"),
        "model directory without weights": (["--model", str(models["noweights"]), "--source", a], "model directory has no weights"),
        "revision that does not exist (local)": (["--model", neox, "--checkpoint", "step999", "--source", a], "checkpoint 'step999' not found"),
        "revision that does not exist (hub)": (["--model", "EleutherAI/pythia-70m", "--checkpoint", "step999", "--source", a], "cannot load model 'EleutherAI/pythia-70m' at 'step999'"),
        "tokenizer larger than the embedding": (["--model", str(models["bigtok"]), "--source", a], "tokens but the embedding has only"),
        "--shard malformed": (["--model", neox, "--source", a, "--shard", "2of4"], "--shard '2of4': expected I/N"),
        "--shard out of range": (["--model", neox, "--source", a, "--shard", "5/4"], "--shard '5/4'"),
        "--max-length beyond the context": (["--model", neox, "--source", a, "--max-length", "4096"], "--max-length 4096 exceeds the model's context of 64"),
        "--dtype unknown": (["--model", neox, "--source", a, "--dtype", "float8"], "--dtype 'float8'"),
        "--device the machine lacks": (["--model", neox, "--source", a, "--device", "cuda"], "--device cuda: no CUDA device"),
        "source name escaping the warehouse": (["--model", neox, "--source", f"../../x={sources['alpha']}"], "NAME must be"),
        "source name 'all'": (["--model", neox, "--source", f"all={sources['alpha']}"], "not 'all'"),
        "remote code without --trust-remote-code": (["--model", str(models["remote"]), "--source", a], "uses custom code (auto_map); pass --trust-remote-code"),
        "different hidden size for the same model": (["--model", str(models["wide"]), "--source", a], "with hidden size 32, this one has 64"),
    }


@pytest.fixture(scope="session")
def catalogue(workdir, sources, model_factory):
    import tiny

    d = workdir / "bad"
    files = _bad_files(d / "files", sources)
    neox = model_factory("gpt_neox", tied=False)
    models = {"neox": neox}
    models["noweights"] = d / "noweights"
    shutil.copytree(neox, models["noweights"])
    (models["noweights"] / "model.safetensors").unlink()
    models["bigtok"] = d / "bigtok"
    tiny.make_tokenizer(models["bigtok"], "bpe")
    cfg = tiny.make_config("gpt_neox", vocab=100, tied=False)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(cfg).save_pretrained(models["bigtok"])
    models["remote"] = d / "remote"
    models["remote"].mkdir()
    (models["remote"] / "config.json").write_text(json.dumps({"model_type": "custom-thing", "auto_map": {"AutoConfig": "configuration_custom.CustomConfig"}}))
    (models["remote"] / "model.safetensors").write_bytes(b"")
    (models["remote"] / "configuration_custom.py").write_text("raise SystemExit('remote code ran')\n")
    wide_root = d / "wide-parent" / neox.name  # the same model name with another hidden size
    wide_root.parent.mkdir(parents=True)
    shutil.copytree(model_factory("gpt_neox", tied=False, d=64), wide_root)
    models["wide"] = wide_root
    wh = d / "wh"
    code, _, err = run_cli("extract", "--model", neox, "--source", f"alpha={sources['alpha']}", "--warehouse", wh,
                           "--max-tokens", 50)
    assert code == 0, err
    return {"cases": bad_cases(files, sources, models, wh), "wh": wh}


CASE_NAMES = list(bad_cases({k: Path(k) for k in ("unreadable", "doc", "empty", "blank", "other", "latin1", "bad",
                                                   "notext", "trunc", "nocolumn")}, {"alpha": Path("a")},
                            {k: Path(k) for k in ("neox", "noweights", "bigtok", "remote", "wide")}, Path("w")))


def _tree(wh: Path) -> dict:
    return {str(p.relative_to(wh)): p.stat().st_mtime_ns for p in wh.rglob("*") if p.is_file()}


@pytest.mark.parametrize("case", CASE_NAMES)
def test_bad_input_fails_cleanly(catalogue, case):
    if case == "unreadable source file" and os.geteuid() == 0:
        pytest.skip("root reads files whatever their mode")
    args, message = catalogue["cases"][case]
    wh = catalogue["wh"]
    before = _tree(wh)
    code, out, err = run_cli("extract", *args, "--warehouse", wh)
    lines = err.strip().splitlines()
    assert code == 2, (case, err)
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], (case, err)
    assert "Traceback" not in err
    assert _tree(wh) == before, case  # nothing written


def test_non_utf8_can_be_replaced_or_skipped_and_is_counted(catalogue, sources, model_factory, workdir):
    latin = catalogue["cases"]["non-UTF-8 bytes"][0][3].split("=", 1)[1]
    for mode, word in (("replace", "replaced with U+FFFD"), ("skip", "skipped")):
        code, _, err = run_cli("extract", "--model", model_factory("gpt_neox", tied=False), "--source", f"x={latin}",
                               "--warehouse", workdir / f"enc-{mode}", "--encoding-errors", mode)
        if mode == "skip":
            assert code == 2 and "no tokens to process" in err  # its only line was skipped
        else:
            assert code == 0 and f"1 lines had bytes that are not UTF-8 ({word})" in err


def test_warehouse_of_another_schema_version(workdir, sources, model_factory):
    wh = workdir / "rel-v0"
    wh.mkdir()
    (wh / "manifest.json").write_text(json.dumps({"schema_version": 0, "entries": {}}))
    code, _, err = run_cli("extract", "--model", model_factory("gpt_neox", tied=False), "--source",
                           f"alpha={sources['alpha']}", "--warehouse", wh)
    from warehouse.schema import SCHEMA_VERSION

    assert code == 2 and f"warehouse schema version 0, this tool writes version {SCHEMA_VERSION}" in err
    code, _, err = run_cli("sql", "SELECT 1", "--warehouse", wh)
    assert code == 2 and "schema version 0" in err


def test_corrupt_parquet_is_named(catalogue, workdir):
    wh = workdir / "rel-corrupt"
    shutil.copytree(catalogue["wh"], wh)
    victim = next((wh / "tables" / "layer_sums").rglob("*.parquet"))
    victim.write_bytes(b"not parquet at all")
    code, _, err = run_cli("sql", "SELECT * FROM inter_sim", "--warehouse", wh)
    assert code == 2 and victim.name in err and len(err.strip().splitlines()) == 1
    code, out, _ = run_cli("validate", "--warehouse", wh)
    assert code == 1 and victim.name in out and "commit record" in out  # its size differs from the recorded one


def test_validate_finds_orphans_and_fixes_them(catalogue, workdir):
    wh = workdir / "rel-orphan"
    shutil.copytree(catalogue["wh"], wh)
    assert run_cli("validate", "--warehouse", wh)[0] == 0
    orphan = wh / "tables" / "token_sums" / "model=x" / "leftover.parquet"
    orphan.parent.mkdir(parents=True)
    orphan.write_bytes(b"partial")
    code, out, _ = run_cli("validate", "--warehouse", wh)
    assert code == 1 and "leftover.parquet: not listed in the manifest" in out
    assert run_cli("validate", "--warehouse", wh, "--fix")[0] == 1 and orphan.exists()  # younger than --grace
    assert run_cli("validate", "--warehouse", wh, "--fix", "--grace", "0")[0] == 0 and not orphan.exists()
    moved = list((wh / "_quarantine").rglob("leftover.parquet"))  # moved, not deleted
    assert len(moved) == 1 and moved[0].read_bytes() == b"partial"
    code, out, _ = run_cli("validate", "--warehouse", wh, "--purge")
    assert code == 0 and "deleted" in out and not moved[0].exists()


def test_partition_values_cannot_escape():
    from warehouse.store import partition_dir

    rel = partition_dir("token_sums", {"model": "../../etc", "checkpoint": "a/b", "source": "s", "shard": "1-of-1"})
    assert ".." not in rel.split("/") and rel.count("/") == 5 and "model=..%2F..%2Fetc" in rel


# ---------------------------------------------------------------- fuzzing the readers


def _read_all(path: Path) -> list[str]:
    return list(documents(Source("f", path, None, "replace"), (1, 1), ReadStats()))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=400), suffix=st.sampled_from([".txt", ".jsonl", ".jsonl.zst", ".json.gz", ".parquet"]))
def test_readers_survive_random_bytes(tmp_path, data, suffix):
    path = tmp_path / f"fuzz{suffix}"
    path.write_bytes(data)
    try:
        docs = _read_all(path)
    except UserError:
        return
    assert all(isinstance(d, str) for d in docs)


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                           max_leaves=10)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(objs=st.lists(json_values | st.fixed_dictionaries({"text": st.text(), "meta": json_values}), max_size=5))
def test_jsonl_reader_survives_random_json(tmp_path, objs):
    import zstandard

    lines = "".join(json.dumps(o) + "\n" for o in objs).encode()
    for name, data in (("r.jsonl", lines), ("r.jsonl.zst", zstandard.ZstdCompressor().compress(lines))):
        (tmp_path / name).write_bytes(data)
        try:
            docs = _read_all(tmp_path / name)
        except UserError as e:
            assert "JSON line has no string field 'text'" in str(e)
            continue
        assert docs == [o["text"] for o in objs]
