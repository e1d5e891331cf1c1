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
