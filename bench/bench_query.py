"""Benchmark: the query phase at the paper's scale.

Builds a warehouse of realistic shape through the normal write path (store.TableWriter for each
partial's token_sums / layer_sums, warehouse.merge.commit for each commit, as `extract` does):
SOURCES × SHARDS partials of LAYERS layers × VOCAB token types (every type seen by every partial,
the worst case) with random vectors of width D, and a vocab table.  Then times every view through
`cli.py sql` in a child process (wall time, and the child's own peak RSS), beside `cli.py sql
"SELECT 1"` (the CLI's start-up), and the same queries in the `duckdb` shell (`duckdb -init
views.sql`).  Finally `cli.py compact` and the bytes per (layer, token type) before and after.

    python bench/bench_query.py                       # 4 sources × 2 shards, 26 layers, 50,304 types, d 128
    python bench/bench_query.py --d 512 --sources 1 --shards 2
    # the paper's sweep: 3 models × 21 checkpoints, one source each (cli.py report timed too)
    python bench/bench_query.py --models 3 --checkpoints 21 --sources 1 --shards 1 --compact-each --report --no-compact

Times are compared with `python -c "import duckdb, pyarrow.dataset, typer"`, the least any query
process must import (the bound the query side keeps: `SELECT 1` within 0.5 s of it, every view within 1 s).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import run_script  # noqa: E402
from warehouse import merge, store  # noqa: E402

QUERIES = {
    "avg_intra_sim": "SELECT * FROM avg_intra_sim",
    "intra_sim (one layer, token text)": "SELECT token_id, token, n, intra_sim FROM intra_sim WHERE layer = 12 "
                                         "ORDER BY intra_sim DESC LIMIT 20",
    "inter_sim_by_source": "SELECT * FROM inter_sim_by_source",
    "inter_sim": "SELECT * FROM inter_sim",
    "inter_sim_by_frequency": "SELECT * FROM inter_sim_by_frequency",
    "inter_sim_types": "SELECT * FROM inter_sim_types",
    "dim_contrib (top 5 per layer)": "SELECT * FROM dim_contrib QUALIFY row_number() OVER "
                                     "(PARTITION BY model, checkpoint, source, layer ORDER BY contrib DESC) <= 5",
    "drift": "SELECT * FROM drift",
    "intra_sentence_sim": "SELECT * FROM intra_sentence_sim",
}


def write_partial(root: Path, model: str, checkpoint: str, source: str, shard: str, layers: int, vocab: int,
                  d: int, rng: np.random.Generator, types: np.ndarray | None = None, step: int | None = None,
                  chunk: int = 8192) -> dict:
    """One partial's token_sums and layer_sums (random, self-consistent sums) and its data entry."""
    run_id = store.new_run_id()
    values = {"model": model, "checkpoint": checkpoint, "source": source, "shard": shard}
    key = {**values, "step": step}
    ids_all = np.arange(vocab, dtype=np.int32) if types is None else np.sort(types).astype(np.int32)
    tok = store.TableWriter(root, "token_sums", values, run_id)
    lay = store.TableWriter(root, "layer_sums", values, run_id)
    layer_rows = {c: [] for c in ("layer", "layer_kind", "n_layers", "n", "sum_sq", "n_nonfinite", "n_zero",
                                  "vec", "sum_h", "sum_u2", "windows", "window_cos", "sum_abs", "curv_windows",
                                  "curv_sum", "pe_windows", "pe_sum", "change_n", "change_cos", "change_angle",
                                  "unit_windows", "sum_ubar", "sum_ubar_sq")}
    tokens = 0
    for layer in range(layers):
        mean = rng.standard_normal(d)  # a common direction: Inter-Sim > 0
        total, n_total = np.zeros(d), 0
        for a in range(0, len(ids_all), chunk):
            ids = ids_all[a:a + chunk]
            n = rng.integers(1, 200, size=len(ids))
            U = (rng.standard_normal((len(ids), d)) + mean) / np.sqrt(d + mean @ mean)  # ~unit rows
            S = (U * (n[:, None] ** 0.8)).astype(np.float32)  # |Σû| between √n and n
            S64 = S.astype(np.float64)
            tok.write({**{k: [v] * len(ids) for k, v in key.items()}, "layer": np.full(len(ids), layer, np.int16),
                       "token_id": ids, "n": n, "sum_sq": np.einsum("ij,ij->i", S64, S64), "vec": store.list_array(S)})
            total += S64.sum(0)
            n_total += int(n.sum())
        tokens = n_total
        for c, v in (("layer", layer), ("layer_kind", "block"), ("n_layers", layers), ("n", n_total),
                     ("sum_sq", float(total @ total)), ("n_nonfinite", 0), ("n_zero", 0), ("vec", total.tolist()),
                     ("sum_h", (total * 3).tolist()), ("sum_u2", np.full(d, n_total / d).tolist()),
                     ("windows", n_total // 512), ("window_cos", 0.5 * (n_total // 512)),
                     ("sum_abs", 0.8 * n_total * d), ("curv_windows", n_total // 512),
                     ("curv_sum", 1.1 * (n_total // 512)), ("pe_windows", None), ("pe_sum", None),
                     ("change_n", n_total if layer + 1 < layers else None),
                     ("change_cos", 0.9 * n_total if layer + 1 < layers else None),
                     ("change_angle", 0.15 * n_total if layer + 1 < layers else None),
                     ("unit_windows", n_total // 512), ("sum_ubar", (total / 512).tolist()),
                     ("sum_ubar_sq", 0.3 * (n_total // 512))):
            layer_rows[c].append(v)
    lay.write({**{k: [v] * layers for k, v in key.items()}, **layer_rows})
    files = {"token_sums": tok.close(), "layer_sums": lay.close()}
    return {"key": store.entry_key("data", model, checkpoint, source, shard), "kind": "data", "model": model,
            "checkpoint": checkpoint, "step": step, "source": source, "shard": shard, "run_id": run_id,
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "hidden_size": d, "files": files,
            "stats": {"tokens": tokens}, "settings": {}, "provenance": {}}


def write_vocab(root: Path, model: str, checkpoint: str, vocab: int, d: int, step: int | None = None) -> dict:
    run_id = store.new_run_id()
    w = store.TableWriter(root, "vocab", {"model": model, "checkpoint": checkpoint}, run_id)
    w.write({"model": [model] * vocab, "checkpoint": [checkpoint] * vocab, "step": [step] * vocab,
             "token_id": np.arange(vocab, dtype=np.int32), "token": [f"tok{i}" for i in range(vocab)],
             "special": [False] * vocab})
    return {"key": store.entry_key("params", model, checkpoint), "kind": "params", "model": model,
            "checkpoint": checkpoint, "step": step, "source": None, "shard": None, "run_id": run_id,
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "hidden_size": d, "files": {"vocab": w.close()},
            "stats": {}, "settings": {}, "provenance": {}}


def build(root: Path, sources: int, shards: int, layers: int, vocab: int, d: int, log=print,
          models: int = 1, checkpoints: int = 1, compact_each: bool = False) -> list[float]:
    """The warehouse; returns the seconds of each commit (write + merge).  With several models or
    checkpoints: models bench0 … and checkpoints step0, step1000, … (a training sweep); with
    `compact_each`, each checkpoint is compacted once its partials are in (`cli.py compact`: the
    views read the same merged tables, and the disk holds one checkpoint's partials at a time)."""
    rng = np.random.default_rng(0)
    seconds = []
    for m in range(models):
        model = "bench" if models == 1 else f"bench{m}"
        for c in range(checkpoints):
            ckpt, step = ("main", None) if checkpoints == 1 else (f"step{c * 1000}", c * 1000)
            merge.commit(root, [write_vocab(root, model, ckpt, vocab, d, step)])
            for s in range(sources):
                for k in range(shards):
                    t0 = time.perf_counter()
                    entry = write_partial(root, model, ckpt, f"source{s}", f"{k + 1}-of-{shards}", layers, vocab, d,
                                          rng, step=step)
                    t1 = time.perf_counter()
                    merge.commit(root, [entry])
                    seconds.append(time.perf_counter() - t0)
                    log(f"  partial {len(seconds)} ({model}@{ckpt}): written in {t1 - t0:.1f} s, "
                        f"merged in {time.perf_counter() - t1:.1f} s", flush=True)
            if compact_each:
                merge.compact(root, model, ckpt)
    return seconds


def time_cli(wh: Path, query: str, repeat: int = 3) -> tuple[float, float]:
    """Best wall time over `repeat` runs of `cli.py sql`, and the peak RSS of that run."""
    best = (float("inf"), float("nan"))
    for _ in range(repeat):
        s, gb, r = run_script(ROOT / "cli.py", "sql", query, "--warehouse", str(wh), "--format", "csv")
        if r.returncode:
            sys.exit(f"query failed: {query}\n{r.stderr[-2000:]}")
        best = min(best, (s, gb))
    return best


def time_shell(wh: Path, query: str, repeat: int = 3) -> float | None:
    duckdb = shutil.which("duckdb") or str(Path(sys.executable).parent / "duckdb")
    if not Path(duckdb).exists():
        return None
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        r = subprocess.run([duckdb, "-init", str(wh / store.VIEWS_FILE), "-csv", "-c", query],
                           capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if r.returncode:
            sys.exit(f"duckdb shell failed: {query}\n{r.stderr[-2000:]}")
        best = min(best, time.perf_counter() - t0)
    return best


def time_imports(repeat: int = 3) -> float:
    """Best wall time of `python -c "import duckdb, pyarrow.dataset, typer"`."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import duckdb, pyarrow.dataset, typer"], check=True)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sources", type=int, default=4)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--layers", type=int, default=26)
    ap.add_argument("--vocab", type=int, default=50_304)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--models", type=int, default=1)
    ap.add_argument("--checkpoints", type=int, default=1)
    ap.add_argument("--report", action="store_true", help="also time `cli.py report` over the whole warehouse")
    ap.add_argument("--no-compact", action="store_true", help="skip the compaction step at the end")
    ap.add_argument("--compact-each", action="store_true", help="compact every checkpoint as soon as it is built")
    ap.add_argument("--dir", type=Path, default=None, help="where to build (default: a temporary directory)")
    a = ap.parse_args()
    tmp = a.dir or Path(tempfile.mkdtemp(prefix="isoquery-"))
    wh = tmp / "wh"
    print(f"{time.strftime('%Y-%m-%d')}: {a.models} model(s) × {a.checkpoints} checkpoint(s) × "
          f"{a.sources} sources × {a.shards} shards, {a.layers} layers, "
          f"{a.vocab} token types, d {a.d}; warehouse {wh}")
    if not (wh / store.MANIFEST).exists():
        commits = build(wh, a.sources, a.shards, a.layers, a.vocab, a.d, models=a.models, checkpoints=a.checkpoints,
                        compact_each=a.compact_each)
        hwm = [int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM")]
        print(f"build: {sum(commits):.1f} s for {len(commits)} commits (last {commits[-1]:.1f} s); "
              f"peak RSS of the building process {hwm[0] / 1e6:.2f} GB" if hwm else "")
    from warehouse.query import refresh_companions

    refresh_companions(wh)
    imports = time_imports()
    print(f'python -c "import duckdb, pyarrow.dataset, typer": {imports:.2f} s (best of 3)')
    base, base_gb = time_cli(wh, "SELECT 1")
    shell_base = time_shell(wh, "SELECT 1")
    print(f"cli.py sql \"SELECT 1\": {base:.2f} s ({base - imports:+.2f} over the imports), {base_gb:.2f} GB"
          + (f"; duckdb shell: {shell_base:.2f} s" if shell_base is not None else ""))
    print(f"{'view':38s} {'cli s':>7s} {'- start':>8s} {'- imps':>7s} {'RSS GB':>7s} {'shell s':>8s} {'- start':>8s}")
    queries = dict(QUERIES)
    if a.report:  # every metric view, whole (the report's figures read these)
        from warehouse.query import load_metrics

        for m in load_metrics():  # per-token views (82 M rows in a sweep) by one layer, as the report reads them
            queries.setdefault(m.name, f"SELECT * FROM {m.name} WHERE layer = 12 ORDER BY n DESC LIMIT 20"
                               if m.name in ("token_norms", "intra_sim") else f"SELECT * FROM {m.name}")
    worst = 0.0
    for name, q in queries.items():
        s, gb = time_cli(wh, q)
        sh = time_shell(wh, q)
        worst = max(worst, s - imports)
        shell = f"{sh:8.2f} {sh - shell_base:8.2f}" if sh is not None else ""
        print(f"{name:38s} {s:7.2f} {s - base:8.2f} {s - imports:7.2f} {gb:7.2f} {shell}", flush=True)
    print(f"slowest view: {worst:.2f} s over the imports")
    if a.report:
        s, gb, r = run_script(ROOT / "cli.py", "report", "--warehouse", str(wh), "--out", str(tmp / "reports"))
        if r.returncode:
            sys.exit(f"report failed:\n{r.stderr[-2000:]}")
        print(f"cli.py report: {s:.1f} s, {gb:.2f} GB: {r.stderr.strip().splitlines()[-1]}")
    if a.no_compact:
        return
    s, gb, r = run_script(ROOT / "cli.py", "compact", "--warehouse", str(wh))
    print(f"compact: {s:.1f} s, {gb:.2f} GB: {r.stdout.strip() or r.stderr.strip()[-300:]}")
    s, gb = time_cli(wh, QUERIES["avg_intra_sim"])
    print(f"avg_intra_sim after compact: {s:.2f} s ({s - base:.2f} over start-up), {gb:.2f} GB")


if __name__ == "__main__":
    main()
