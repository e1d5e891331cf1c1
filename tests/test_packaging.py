"""The wheel is complete: built from this checkout, installed into a fresh virtual environment (its
dependencies from the environment this test runs in), run from outside the checkout, it answers a view
through its console script and `python -m isotropy_warehouse`, ships every queries/*.sql, and puts no
top-level `cli` into site-packages (`common` is a package of its own)."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

from conftest import run_cli

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ("pyproject.toml", "README.md", "common", "isotropy_warehouse", "extract", "warehouse", "queries")


def _child_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def test_wheel_in_a_fresh_venv_answers_a_view(tmp_path, sources, model_factory):
    # Build from a copy of the shipped files: no build/ or *.egg-info in the checkout (xdist runs beside it).
    src = tmp_path / "src"
    src.mkdir()
    for name in SHIPPED:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "manifest*", "tables",
                                                                                  "views.sql", ".staging"))
        else:
            shutil.copy2(ROOT / name, src / name)
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(dist), str(src)], check=True, env=_child_env(), cwd=tmp_path)
    (wheel,) = dist.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    sqls = sorted(p.name for p in (ROOT / "queries").glob("*.sql"))
    assert len(sqls) >= 30
    assert {f"warehouse/queries/{n}" for n in sqls} <= names, "the wheel lacks queries/*.sql"
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"common", "isotropy_warehouse", "extract", "warehouse"}, tops

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    if sys.prefix != sys.base_prefix:
        # This test runs in a virtual environment (.ci/run's): a venv made from it sees the base
        # interpreter's packages, not these; its dependencies are these, after its own site-packages
        # (a path line: the .pth files there, such as an editable install's finder, are not run).
        parents = [p for p in site.getsitepackages() if Path(p).is_dir()]
        child = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip()
        Path(child, "test-parent-env.pth").write_text("".join(p + "\n" for p in parents))
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--quiet", "--no-deps",
                    "--no-index", str(wheel)], check=True, env=_child_env(), cwd=tmp_path)
    purelib = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True, env=_child_env()).stdout.strip())
    assert purelib.is_relative_to(venv)
    assert not any((purelib / f"cli{ext}").exists() for ext in ("", ".py"))
    assert sorted(p.name for p in (purelib / "warehouse" / "queries").glob("*.sql")) == sqls

    # A warehouse made here (in-process, from the checkout), queried there.
    wh = tmp_path / "wh"
    code, _, err = run_cli("extract", "--model", model_factory("gpt_neox"), "--source", f"alpha={sources['alpha']}",
                           "--max-length", "16", "--max-tokens", "200", "--warehouse", wh)
    assert code == 0, err
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    # The checkout's editable install (if any) must not be what runs: the venv's copy comes first.
    where = subprocess.run([str(py), "-c", "import isotropy_warehouse, warehouse.query as q; "
                            "print(isotropy_warehouse.__file__); print(q.QUERIES_DIR)"],
                           check=True, capture_output=True, text=True, env=_child_env(), cwd=outside).stdout.split("\n")
    assert Path(where[0]).is_relative_to(purelib) and Path(where[1]) == purelib / "warehouse" / "queries", where
    out = subprocess.run([str(venv / "bin" / "isotropy-warehouse"), "sql", "SELECT layer, inter_sim FROM inter_sim "
                          "ORDER BY layer", "--format", "json", "--warehouse", str(wh)],
                         capture_output=True, text=True, env=_child_env(), cwd=outside)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert len(rows) >= 2 and all(isinstance(r["inter_sim"], float) for r in rows), rows
    # Provenance of an installed copy: its version, not the git repository site-packages may lie in.
    prov = subprocess.run([str(py), "-c", "from extract.run.provenance import git_hash; print(git_hash())"], capture_output=True,
                          text=True, env=_child_env(), cwd=outside)
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert prov.stdout.strip() == f"isotropy-warehouse {version}", (prov.stdout, prov.stderr)
    helped = subprocess.run([str(py), "-m", "isotropy_warehouse", "--help"], capture_output=True, text=True,
                            env=_child_env(), cwd=outside)
    assert helped.returncode == 0 and "extract" in helped.stdout and "sql" in helped.stdout, helped.stderr
