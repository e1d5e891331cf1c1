"""Build a fixed set of warehouses with one checkout's code and dump every view, so that two checkouts
(before and after a refactoring) can be compared row by row.

    python scripts/snapshot_views.py build  --repo . --work /tmp/snap --out before.json
    python scripts/snapshot_views.py build  --repo ../other --work /tmp/snap --out after.json
    python scripts/snapshot_views.py compare before.json after.json

`build` makes the tiny models and sources once under --work (so both checkouts read the same weights and
text), runs `cli.py extract` of --repo over them with most measure flags, merges, compacts, and dumps every
view of every warehouse (columns that name a run or a time left out).  `compare` prints each view that
differs and exits 1 if any does.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

VOLATILE = {"run_id", "created", "created_at", "git", "git_hash", "provenance", "seconds", "time", "versions",
            "started", "finished", "finished_at", "path", "file", "files", "settings", "host", "pid"}
VOLATILE_KEYS = {"seconds", "finished_at", "accumulator_peak_bytes"}  # inside JSON cells (runs.stats)


def _cli(repo: Path, *args: str) -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
               ISO_PROGRESS_INTERVAL="3600")
    r = subprocess.run([sys.executable, str(repo / "cli.py"), *args], env=env, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"cli.py {' '.join(args)} failed:\n{r.stderr[-3000:]}")


def _fixtures(repo: Path, work: Path) -> dict:
    """Tiny models and sources, made once (by tests/tiny.py of the checkout that makes them first)."""
    done = work / "fixtures.json"
    if done.exists():
        return json.loads(done.read_text())
    sys.path.insert(0, str(repo / "tests"))
    sys.path.insert(0, str(repo))
    import tiny

    src = tiny.write_sources(work / "sources")
    models = {}
    for fam, tied in (("gpt_neox", False), ("llama", True), ("bert", False)):
        models[fam] = str(tiny.make_model(work / "models" / fam, fam, tied))
    micro = work / "models" / "micro"
    for i, step in enumerate(("step0", "step10", "step20")):
        tiny.make_model(micro / step, "gpt_neox", False, seed=i)
    models["micro"] = str(micro)
    out = {"sources": {k: str(v) for k, v in src.items()}, "models": models}
    done.write_text(json.dumps(out))
    return out


def _runs(fx: dict) -> list[tuple[str, list[list[str]]]]:
    a, b = fx["sources"]["alpha"], fx["sources"]["beta"]
    m = fx["models"]
    every = ["--moments", "--cross-moments", "--sequences", "--prompt-entropy", "--sample", "16"]
    return [
        ("neox-every", [["extract", "--model", m["gpt_neox"], "--source", f"alpha={a}", "--source", f"beta={b}",
                         "--max-length", "32", "--batch-size", "2", *every]]),
        ("llama-sentence-shards", [
            ["extract", "--model", m["llama"], "--source", f"alpha={a}", "--unit", "sentence", "--max-length", "32",
             "--count-special-tokens", "--shard", f"{i}/2", "--no-fold", "--moments", "--sequences"]
            for i in (1, 2)] + [["merge"]]),
        ("bert-split-by", [["extract", "--model", m["bert"], "--source", f"beta={b}", "--split-by",
                            "meta.pile_set_name", "--max-length", "24", "--cross-moments"]]),
        ("minilm", [["extract", "--model", "minilm", "--source", "stdlib-docs", "--max-tokens", "4000",
                     "--sequences", "--sample", "8"]]),
        ("micro-all-compacted", [["extract", "--model", m["micro"], "--checkpoints", "all", "--source",
                                  f"alpha={a}", "--max-length", "32", "--vector-dtype", "float64"], ["compact"]]),
    ]


def _value(v):
    if isinstance(v, float):
        return "nan" if math.isnan(v) else repr(v)
    if isinstance(v, (list, tuple)):
        return [_value(x) for x in v]
    if isinstance(v, dict):
        return {k: _value(x) for k, x in v.items()}
    return v if isinstance(v, (int, str, type(None), bool)) else str(v)


def _dump(repo: Path, wh: Path) -> dict:
    code = (
        "import json, sys\n"
        f"sys.path.insert(0, {str(repo)!r})\n"
        "from warehouse.query import connect\n"
        f"con = connect({str(wh)!r})\n"
        "names = [r[0] for r in con.execute(\"SELECT view_name FROM duckdb_views() WHERE NOT internal\").fetchall()]\n"
        "out = {}\n"
        "for v in sorted(names):\n"
        "    cur = con.execute(f'SELECT * FROM \"{v}\"')\n"
        "    cols = [c[0] for c in cur.description]\n"
        "    out[v] = {'columns': cols, 'rows': [list(r) for r in cur.fetchall()]}\n"
        "print(json.dumps(out, default=lambda o: o.tolist() if hasattr(o, 'tolist') else str(o)))\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=repo)
    if r.returncode:
        raise SystemExit(f"dump of {wh} failed:\n{r.stderr[-3000:]}")
    raw = json.loads(r.stdout.strip().splitlines()[-1])  # DuckDB may print a progress bar first
    out = {}
    for view, t in raw.items():
        keep = [i for i, c in enumerate(t["columns"]) if c not in VOLATILE]
        rows = sorted((json.dumps(_value([r[i] for i in keep])) for r in t["rows"]))
        out[view] = {"columns": [t["columns"][i] for i in keep], "rows": rows}
    return out


def build(repo: Path, work: Path, out: Path) -> None:
    fx = _fixtures(repo, work)
    result = {}
    for name, commands in _runs(fx):
        wh = work / "wh" / name
        shutil.rmtree(wh, ignore_errors=True)
        for args in commands:
            _cli(repo, *args, "--warehouse", str(wh))
        result[name] = _dump(repo, wh)
        print(f"{name}: {len(result[name])} views", file=sys.stderr)
    out.write_text(json.dumps(result, indent=0, sort_keys=True))


def _close(a: str, b: str, tol: float) -> bool:
    x, y = json.loads(a), json.loads(b)

    def eq(p, q) -> bool:
        if isinstance(p, list) and isinstance(q, list):
            return len(p) == len(q) and all(eq(s, t) for s, t in zip(p, q))
        if isinstance(p, str) and isinstance(q, str) and p != q:
            try:
                f, g = float(p), float(q)
            except ValueError:
                return False
            return abs(f - g) <= tol * max(1.0, abs(g))
        return p == q
    return eq(x, y)


def _steady(dump: dict) -> dict:
    """Drop what names a run or a time (columns and keys inside JSON cells), in dumps made by any version."""
    def cell(v):
        if isinstance(v, str) and v.startswith("{"):
            try:
                d = json.loads(v)
            except ValueError:
                return v
            return json.dumps({k: x for k, x in d.items() if k not in VOLATILE_KEYS}, sort_keys=True)
        return v
    for views in dump.values():
        for t in views.values():
            keep = [i for i, c in enumerate(t["columns"]) if c not in VOLATILE]
            t["rows"] = sorted(json.dumps([cell(r[i]) for i in keep]) for r in map(json.loads, t["rows"]))
            t["columns"] = [t["columns"][i] for i in keep]
    return dump


def compare(a: Path, b: Path, tol: float) -> int:
    A, B = _steady(json.loads(a.read_text())), _steady(json.loads(b.read_text()))
    bad = exact = close = 0
    for wh in sorted(set(A) | set(B)):
        va, vb = A.get(wh, {}), B.get(wh, {})
        for v in sorted(set(va) | set(vb)):
            if v not in va or v not in vb:
                print(f"{wh}/{v}: only in {'after' if v not in va else 'before'}")
                continue
            ra, rb = va[v], vb[v]
            if ra == rb:
                exact += 1
            elif ra["columns"] == rb["columns"] and len(ra["rows"]) == len(rb["rows"]) and all(
                    _close(x, y, tol) for x, y in zip(ra["rows"], rb["rows"])):
                close += 1
                print(f"{wh}/{v}: equal to {tol:g}, not bit for bit")
            else:
                bad += 1
                print(f"{wh}/{v}: DIFFERS (columns {ra['columns'] == rb['columns']}, rows {len(ra['rows'])} vs "
                      f"{len(rb['rows'])})")
    print(f"{exact} views identical, {close} equal to {tol:g}, {bad} differ")
    return 1 if bad else 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--repo", type=Path, default=Path(__file__).resolve().parent.parent)
    b.add_argument("--work", type=Path, required=True)
    b.add_argument("--out", type=Path, required=True)
    c = sub.add_parser("compare")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    c.add_argument("--tol", type=float, default=1e-12)
    args = p.parse_args()
    if args.cmd == "build":
        build(args.repo.resolve(), args.work.resolve(), args.out)
    else:
        sys.exit(compare(args.before, args.after, args.tol))


if __name__ == "__main__":
    main()
