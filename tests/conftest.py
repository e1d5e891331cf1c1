"""Session fixtures: tiny models saved to disk, text sources, and warehouses built once."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Plain progress lines (stderr is no terminal under pytest) only when a test asks: a test that counts
# stderr's lines (one `error:` line) must not see a 10 % line of a slow machine (tests/test_progress.py).
os.environ.setdefault("ISO_PROGRESS_INTERVAL", "3600")
os.environ.setdefault("ISO_PARAMS_CACHE", "off")
if "TRITON_INTERPRET" not in os.environ:  # the Triton kernels (extract/accumulate/fused.py) in Triton's
    import torch  # interpreter where there is no GPU to compile them for (read when Triton is imported)

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"  # no cache of parameter tables in ~/.cache (its own test sets one)
# Under pytest-xdist the workers already fill the cores: each worker (and every process it starts)
# gets cores ÷ workers intra-op threads, instead of each worker's OpenMP pool spinning on every core
# (on 2 cores with -n 2: the suite 11 m → 9 m).  Set OMP_NUM_THREADS to choose otherwise.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _WORKERS))

import tiny  # noqa: E402


@pytest.fixture(scope="session")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("iso")


@pytest.fixture(scope="session")
def sources(workdir) -> dict[str, Path]:
    return tiny.write_sources(workdir / "sources")


@pytest.fixture(scope="session")
def model_factory(workdir):
    """model_factory(family, tied) → directory of a saved tiny random model (built once)."""
    cache: dict = {}

    def make(family: str, tied: bool = False, **kw) -> Path:
        key = (family, tied, tuple(sorted(kw.items())))
        if key not in cache:
            name = f"{family}-{'tied' if tied else 'untied'}" + "".join(f"-{k}{v}" for k, v in sorted(kw.items()))
            cache[key] = tiny.make_model(workdir / "models" / name, family, tied, **kw)
        return cache[key]

    return make


def run_cli(*args: str):
    """Run cli.py in-process; returns (exit code, stdout, stderr)."""
    from typer.testing import CliRunner

    import cli

    result = CliRunner().invoke(cli.app, [str(a) for a in args])
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


# ---------------------------------------------------------------- one extract, and its views compared

VIEWS = ["inter_sim", "inter_sim_by_source", "intra_sim", "avg_intra_sim", "inter_sim_by_frequency",
         "dim_contrib", "drift", "intra_sentence_sim", "anisotropy", "linearity", "inter_sim_types",
         "layer_change", "random_word_sim"]


def views(wh) -> dict:
    from warehouse.query import connect

    con = connect(wh)
    out = {v: sorted(con.execute(f"SELECT * FROM {v}").fetchall()) for v in VIEWS}
    out["shards"] = sorted(con.execute("SELECT checkpoint, source, shard FROM runs WHERE kind = 'data'").fetchall())
    con.close()
    return out


def same_rows(a: list, b: list, name: str, tol: float) -> None:
    """Equal rows; floats to `tol` relative (at least absolute)."""
    assert len(a) == len(b), name
    for r, s in zip(a, b):
        assert len(r) == len(s), name
        for x, y in zip(r, s):
            if isinstance(x, float) and isinstance(y, float):
                assert abs(x - y) <= tol * max(1.0, abs(y)), (name, r, s)
            else:
                assert x == y, (name, r, s)


def same_numbers(a: dict, b: dict, tol: float = 1e-6) -> None:
    """Equal views; floats to `tol` (float32-stored vectors of split tokens merge to ~1e-8)."""
    for v in VIEWS:
        same_rows(a[v], b[v], v, tol)


@pytest.fixture(scope="session")
def single(workdir, sources, model_factory):
    model = model_factory("gpt_neox", tied=False)
    args = ["--model", str(model), "--source", f"alpha={sources['alpha']}", "--source", f"beta={sources['beta']}",
            "--max-length", "32", "--batch-size", "2", "--moments", "--cross-moments"]
    wh = workdir / "scale-single"
    code, _, err = run_cli("extract", *args, "--warehouse", wh)
    assert code == 0, err
    return {"args": args, "wh": wh, "views": views(wh)}


# ---------------------------------------------------------------- S3: one moto server a session

@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """moto's S3 server on loopback with IAM auth (tests/s3_faults.py): env, client, endpoint, port."""
    from s3_faults import moto_server

    with moto_server(tmp_path_factory.mktemp("moto")) as server:
        yield server


@pytest.fixture(scope="session")
def s3_proxy(s3):
    """A fault-injecting proxy in front of the session's moto server (relays everything until a test
    gives it rules: `with s3_proxy.faults(Rule(...)):`)."""
    from s3_faults import FaultProxy

    proxy = FaultProxy(s3["port"])
    yield proxy
    proxy.close()
