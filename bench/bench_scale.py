"""Benchmark: the write path at the sweep's widths and vocabularies, without a GPU, in one process.

Every partial goes through the writer `extract` uses (`extract.run.tables.write_sums`, fed synthetic
float64 sums in place of a model's: random, self-consistent, deterministic), then `merge.commit`
(--fold commit: the fold into the source group and `all` at every commit; --fold checkpoint, the
default: the partial appended, and one `merge.fold_pending` per checkpoint once its partials are in),
then, per checkpoint, `merge.compact` (unless --no-compact), as `cli.py sweep` does.  Per partial it prints the bytes written and read (this
process's /proc/self/io: write_bytes/read_bytes — what reached the block layer — and wchar/rchar — what
went through read()/write(), page cache included), the seconds and the peak RSS, for the write and for
the commit separately; then the disk peak (sampled after each write, commit and compaction) and the
warehouse's size at rest.

Then the start-up: `cli.py sql "SELECT 1"` and each figure view against the number of uncompacted
partials (1, 8, 64, 512 tiny partials, written through the same writer, committed in one commit), beside
`python -c "import duckdb, pyarrow.dataset, typer"`.  And with --metadata N: commit time, manifest bytes
and start-up as the manifest grows to N entries (synthetic entries through `merge.commit`).

    python bench/bench_scale.py --d 2048 --layers 2 --vocab 50304 --sources 2 --shards 2 --checkpoints 2
    python bench/bench_scale.py --startup 1,8,64,512 --no-write
    python bench/bench_scale.py --startup 1,8,64,512 --no-write --s3      # on moto's S3 server, loopback
    python bench/bench_scale.py --metadata 10000 --no-write --startup ''
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from extract.run import provenance, settings as run_settings, tables  # noqa: E402
from warehouse import merge, store  # noqa: E402

FIGURE_VIEWS = ("avg_intra_sim", "inter_sim", "inter_sim_by_source", "intra_sim WHERE layer = 1", "anisotropy",
                "dim_contrib", "drift", "inter_sim_types", "inter_sim_by_frequency")


# ---------------------------------------------------------------- measuring this process


def io() -> dict[str, int]:
    """This process's I/O counters (bytes): read_bytes/write_bytes reach the block layer; rchar/wchar
    are read()/write() calls, page cache included."""
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            k, v = line.split(":")
            out[k] = int(v)
    return out


def reset_peak() -> None:
    """Resets VmHWM (Linux ≥ 4.0) so that the next phase's peak RSS is its own."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) * 1024
    return 0


def disk(path: Path) -> int:
    """Bytes of the files under `path` (allocated blocks)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(dirpath, f)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


class Phase:
    """Seconds, I/O deltas and peak RSS of a `with` block."""

    def __enter__(self):
        reset_peak()
        self.io0, self.t0 = io(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0
        io1 = io()
        self.d = {k: io1[k] - self.io0[k] for k in ("rchar", "wchar", "read_bytes", "write_bytes")}
        self.rss = peak_rss()

    def line(self) -> str:
        gb = 1e9
        return (f"{self.seconds:7.2f} s  write {self.d['write_bytes'] / gb:7.3f} GB (wchar {self.d['wchar'] / gb:7.3f})  "
                f"read {self.d['read_bytes'] / gb:7.3f} GB (rchar {self.d['rchar'] / gb:7.3f})  peak RSS {self.rss / gb:5.2f} GB")


# ---------------------------------------------------------------- synthetic sums, read as TokenSums is


class SyntheticMoments:
    def __init__(self, L: int, d: int, n: int, seed: int):
        self.L, self.d, self.seed = L, d, seed
        self.n = torch.full((L,), n, dtype=torch.int64)
        self.s1 = torch.from_numpy(np.random.default_rng(seed).standard_normal((L, d)))
        self.has_cross = False
        self.n_pair = None

    def s2(self, layer: int) -> np.ndarray:
        A = np.random.default_rng((self.seed, layer)).standard_normal((self.d, self.d))
        return A @ A.T if self.d <= 1024 else A + A.T  # (d, d) symmetric (large d: no O(d³) product)


class SyntheticSums:
    """Every token type of a (types) subset of the vocabulary at every layer, random float64 Σû with
    counts 1…199 — the rows `TokenSums.layer_rows` yields — and consistent per-layer sums."""

    def __init__(self, L: int, V: int, d: int, seed: int, types: float = 1.0, moments: bool = False):
        self.L, self.V, self.d, self.seed = L, V, d, seed
        rng = np.random.default_rng(seed)
        self.ids = np.sort(rng.choice(V, size=max(1, int(V * types)), replace=False)) if types < 1 else np.arange(V)
        z = lambda dt: torch.zeros(L, dtype=dt)  # noqa: E731
        self.nonfinite, self.zero, self.windows = z(torch.int64), z(torch.int64), z(torch.int64) + 10
        self.window_cos = z(torch.float64) + 5.0
        self.change_n, self.change_cos, self.change_angle = z(torch.int64) + 100, z(torch.float64) + 90.0, z(torch.float64) + 15.0
        self.unit_windows, self.sum_ubar_sq = z(torch.int64) + 11, z(torch.float64) + 3.0
        self.sum_ubar = torch.from_numpy(rng.standard_normal((L, d)))
        self.sum_h = torch.from_numpy(rng.standard_normal((L, d)))
        self.sum_u2 = torch.full((L, d), 100.0 / d, dtype=torch.float64)
        self.moments = SyntheticMoments(L, d, 100 * len(self.ids), seed) if moments else None
        self.extra = self.sample = None
        self.spills = []

    def layer_rows(self, layer: int, chunk_rows: int | None = None):
        chunk = chunk_rows or max(256, (16 << 20) // (8 * self.d))
        for i, a in enumerate(range(0, len(self.ids), chunk)):
            rng = np.random.default_rng((self.seed, layer, i))
            ids = self.ids[a:a + chunk]
            n = rng.integers(1, 200, size=len(ids))
            U = rng.standard_normal((len(ids), self.d))
            U /= np.linalg.norm(U, axis=1, keepdims=True)
            yield ids, n, U * (n[:, None] ** 0.8)

    def close(self) -> None:
        pass


def write_partial(wh: Path, model: str, checkpoint: str, step, source: str, shard: tuple[int, int], L: int, V: int,
                  d: int, seed: int, types: float = 1.0, moments: bool = False, vector_dtype: str = "float32"
                  ) -> dict:
    """One partial through `tables.write_sums` and its entry through `provenance.manifest_entry`, as `extract`
    makes them."""
    loaded = SimpleNamespace(ref=SimpleNamespace(name=model), checkpoint=checkpoint, step=step, model=None, layout=None)
    src = SimpleNamespace(name=source, pile_set=None, split_by=None, split_value=None)
    settings = run_settings.Settings(shard=shard, vector_dtype=vector_dtype, moments=moments)
    acc = SyntheticSums(L, V, d, seed, types, moments)
    run_id = store.new_run_id()
    kinds = ["embedding"] + ["block"] * (L - 1)
    real, tables.layer_kinds = tables.layer_kinds, lambda model, layout: kinds  # the model's layers, without a model
    try:
        files, stored = tables.write_sums(wh, loaded, src, settings, acc, run_id)
    finally:
        tables.layer_kinds = real
    result = run_settings.SourceResult(source, tokens=100 * len(acc.ids), vector_dtype=stored, files=files)
    return provenance.manifest_entry("data", loaded, run_id, files, settings, d, src, result, {})


def write_vocab(wh: Path, model: str, checkpoint: str, step, V: int, d: int) -> dict:
    from bench_query import write_vocab as wv

    return wv(wh, model, checkpoint, V, d, step)


# ---------------------------------------------------------------- the parts


def bench_write(wh: Path, a) -> None:
    """Every partial written and committed; with --fold commit each commit folds it (the old path), with
    --fold checkpoint each commit appends it and the checkpoint is folded once when its partials are in
    (`fold_pending`, as `cli.py sweep` and `cli.py merge` do)."""
    peak, commits, folds = 0, [], []
    for c in range(a.checkpoints):
        ckpt, step = (f"step{c * 1000}", c * 1000)
        merge.commit(wh, [write_vocab(wh, "bench", ckpt, step, a.vocab, a.d)])
        for s in range(a.sources):
            for k in range(a.shards):
                with Phase() as w:
                    entry = write_partial(wh, "bench", ckpt, step, f"source{s}", (k + 1, a.shards), a.layers,
                                          a.vocab, a.d, seed=hash((c, s, k)) % 2**31, types=a.types,
                                          moments=a.moments, vector_dtype=a.vector_dtype)
                part = sum((wh / f).stat().st_size for f in entry["files"].values())
                peak = max(peak, disk(wh))
                with Phase() as m:
                    merge.commit(wh, [entry], fold=a.fold == "commit")
                peak = max(peak, disk(wh))
                commits.append((part, w, m))
                print(f"{ckpt} source{s} shard {k + 1}/{a.shards}: partial {part / 1e9:.3f} GB\n"
                      f"    write  {w.line()}\n    commit {m.line()}", flush=True)
        if a.fold == "checkpoint":
            with Phase() as f:
                n = merge.fold_pending(wh, "bench", ckpt)
            peak = max(peak, disk(wh))
            folds.append(f)
            print(f"{ckpt} fold of {n} pending partials {f.line()}", flush=True)
        if not a.no_compact:
            with Phase() as p:
                merge.compact(wh, "bench", ckpt)
            print(f"{ckpt} compact {p.line()}; warehouse {disk(wh) / 1e9:.3f} GB", flush=True)
    total_part = sum(p for p, _, _ in commits)
    rw = lambda ph: ph.d["rchar"] + ph.d["wchar"]  # noqa: E731
    io_commit = sum(rw(m) for _, _, m in commits) + sum(rw(f) for f in folds)
    io_write = sum(rw(w) for _, w, _ in commits)
    print(f"--fold {a.fold}: partials {total_part / 1e9:.3f} GB; commits'{' and folds' if folds else ''} rchar+wchar "
          f"{io_commit / 1e9:.3f} GB = {io_commit / max(total_part, 1):.2f}× the partials; with the partials' writes "
          f"{(io_commit + io_write) / 1e9:.3f} GB = {(io_commit + io_write) / max(total_part, 1):.2f}×; "
          f"write {sum(w.seconds for _, w, _ in commits):.1f} s, commit {sum(m.seconds for _, _, m in commits):.1f} s"
          + (f", fold {sum(f.seconds for f in folds):.1f} s (peak RSS {max(f.rss for f in folds) / 1e9:.2f} GB)"
             if folds else ""))
    print(f"disk peak {peak / 1e9:.3f} GB; at rest {disk(wh) / 1e9:.3f} GB")


def child(*args: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds user + system) of `python args…`; the CPU time is what a loaded
    machine (this one: 2 cores, shared) disturbs least."""
    with tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        p = subprocess.Popen([sys.executable, *args], stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT)
        _, status, ru = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t0
        if status:
            err.seek(0)
            sys.exit(f"failed: {args}\n{err.read().decode()[-2000:]}")
    return wall, ru.ru_utime + ru.ru_stime


def best(*args: str, repeat: int = 3) -> tuple[float, float]:
    runs = [child(*args) for _ in range(repeat)]
    return min(w for w, _ in runs), min(c for _, c in runs)


def time_imports(repeat: int = 3) -> tuple[float, float]:
    return best("-c", "import duckdb, pyarrow.dataset, typer", repeat=repeat)


def time_sql(wh, query: str, repeat: int = 3) -> tuple[float, float]:
    return best(str(ROOT / "cli.py"), "sql", query, "--warehouse", str(wh), "--format", "csv", repeat=repeat)


def tiny_warehouse(wh: Path, partials: int, d: int = 16, L: int = 3, V: int = 512) -> None:
    """`partials` tiny partials (source s, shard k of 8) written through the writer, one commit."""
    merge.commit(wh, [write_vocab(wh, "bench", "main", None, V, d)])
    entries = [write_partial(wh, "bench", "main", None, f"source{i // 8}", (i % 8 + 1, 8), L, V, d, seed=i,
                             types=0.5, moments=True) for i in range(partials)]
    merge.commit(wh, entries)


def moto_s3() -> tuple[subprocess.Popen, str]:
    """moto's S3 server on 127.0.0.1 with a bucket `bench`; the AWS variables set in this process (and so
    in the `cli.py sql` children).  Returns (server, "s3://bench")."""
    import socket

    import boto3

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    os.environ.update({"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "bench",
                       "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1"})
    boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name="us-east-1").create_bucket(Bucket="bench")
    return proc, "s3://bench"


def bench_startup(base: Path | str, counts: list[int]) -> None:
    imports = time_imports()
    print(f'python -c "import duckdb, pyarrow.dataset, typer": {imports[0]:.2f} s wall, {imports[1]:.2f} s CPU (best of 3)')
    print("seconds over the imports, wall / CPU (best of 3 each)")
    print(f"{'partials':>8s} {'SELECT 1':>11s} " + " ".join(f"{v.split()[0][:14]:>14s}" for v in FIGURE_VIEWS))
    for n in counts:
        if isinstance(base, str):  # s3://bucket: built every time (the server keeps nothing)
            wh = f"{base}/startup-{n}"
            tiny_warehouse(wh, n)
        else:
            wh = base / f"startup-{n}"
            if not (wh / store.MANIFEST).exists():
                tiny_warehouse(wh, n)
        row = [time_sql(wh, "SELECT 1")] + [time_sql(wh, f"SELECT * FROM {v}") for v in FIGURE_VIEWS]
        cells = [f"{w - imports[0]:5.2f}/{c - imports[1]:5.2f}" for w, c in row]
        print(f"{n:8d} {cells[0]:>11s} " + " ".join(f"{x:>14s}" for x in cells[1:]), flush=True)


def bench_metadata(base: Path, n: int) -> None:
    """Commit time, manifest.json / views.sql / runs.parquet / commit-record bytes and start-up as the
    manifest grows to n entries: filler entries (parameter tables of checkpoints c0, c1, …, each
    listing one tiny vocab file) published through `store.publish` in batches, then at each mark one
    ordinary commit (a tiny partial of a new checkpoint: `merge.commit` + `refresh_companions`, as
    extract does) timed."""
    from warehouse.query import refresh_companions

    wh = base / "metadata"
    imports = time_imports()
    vocab = write_vocab(wh, "bench", "c0", 0, 8, 4)
    merge.commit(wh, [vocab])
    marks = sorted({m for m in (10, 100, 1000, 3000, 10000, n) if m <= n})
    print(f"{'entries':>8s} {'commit s':>9s} {'manifest MB':>12s} {'runs KB':>8s} {'views.sql KB':>13s} "
          f"{'record KB':>10s} {'SELECT 1 s':>11s} (CPU s over the imports)")
    for i, goal in enumerate(marks):
        while True:
            seq, manifest = store.read_state(wh)
            have = len(manifest["entries"])
            if have >= goal - 3:
                break
            k = min(1000, goal - 3 - have)
            fill = [{**vocab, "key": store.entry_key("params", "bench", f"c{have + j}"), "checkpoint": f"c{have + j}"}
                    for j in range(k)]
            assert store.publish(wh, seq, manifest, fill) is not None
        t0 = time.perf_counter()  # one ordinary commit at this size: params + data + 2 merged entries
        e = write_partial(wh, "bench", f"x{i}", 0, "s", (1, 1), 1, 4, 4, seed=i)
        merge.commit(wh, [e])
        refresh_companions(wh)
        sec = time.perf_counter() - t0
        seq, manifest = store.read_state(wh)
        rec = max((wh / "_log").iterdir(), key=lambda q: q.stat().st_mtime)
        s1 = time_sql(wh, "SELECT 1", repeat=1)[1] - imports[1]
        print(f"{len(manifest['entries']):8d} {sec:9.2f} {(wh / store.MANIFEST).stat().st_size / 1e6:12.2f} "
              f"{(wh / store.RUNS_FILE).stat().st_size / 1e3:8.1f} {(wh / store.VIEWS_FILE).stat().st_size / 1e3:13.1f} "
              f"{rec.stat().st_size / 1e3:10.1f} {s1:11.2f}", flush=True)


PYTHIA = {  # hidden size, layer indices (embedding output + blocks + final norm), vocabulary (embedding rows)
    "70m": (512, 8, 50_304), "160m": (768, 14, 50_304), "410m": (1024, 26, 50_304), "1b": (2048, 18, 50_304),
    "1.4b": (2048, 26, 50_304), "2.8b": (2560, 34, 50_304), "6.9b": (4096, 34, 50_432), "12b": (5120, 38, 50_688),
}


def project(spec: str, sources: int = 8, checkpoints: int = 21, types: int = 50_000, ranks: int = 8) -> None:
    """The paper's sweep (Pythia 70M … 12B × `checkpoints` × `sources`) from measured rates, given as
    commit_ratio=R (a commit's rchar+wchar ÷ its partial's bytes when it starts its source group and
    folds into `all`: one reduced partial per source), shard_ratio=S (the same for a commit onto an existing
    source group: what each rank's own partial cost before the reduce),
    commit_s_per_gb=C (commit seconds per GB of that I/O), write_s_per_gb=W, rest_b_per_cell=B (bytes per
    (layer, token type) of a compacted checkpoint).  A partial: `types` token types × layers × d float32
    + the moments (layers × d² float64); the fold state: float64 vectors (2× the token part) per source
    group and for `all`."""
    r = {k: float(v) for k, v in (x.split("=") for x in spec.split(","))}
    print(f"projection: {sources} sources × {checkpoints} checkpoints, {types} token types per source, "
          f"torchrun on {ranks} GPUs; rates {spec}")
    print(f"{'model':>6s} {'partial GB':>10s} {'ckpt partials GB':>16s} {'state GB':>9s} {'peak GB':>8s} "
          f"{'rest/ckpt GB':>12s} {'rest sweep GB':>13s} {'commit I/O TB/ckpt now':>22s} {'…before reduce':>15s} "
          f"{'target':>8s} {'write+commit h/ckpt now':>23s} {'target h':>9s}")
    total = {"peak": 0.0, "rest": 0.0}
    for name, (d, L, V) in PYTHIA.items():
        tok = types * L * 4 * d
        part = (tok + L * d * d * 8) / 1e9  # GB
        state = (sources + 1) * 2 * tok / 1e9  # float64 fold state of every source group and `all`
        ckpt = sources * part
        rest = r["rest_b_per_cell"] * L * types * (sources + 1) / 1e9  # the sources' groups and `all`
        io_now = sources * r["commit_ratio"] * part / 1e3  # TB: one reduced partial per source
        io_before = ranks * sources * r["shard_ratio"] * part / 1e3  # each rank its own (nearly full-vocabulary) partial
        io_target = 4 * ckpt / 1e3
        hours_now = (sources * part * r["write_s_per_gb"] + io_now * 1e3 * r["commit_s_per_gb"]) / 3600
        hours_target = (sources * part * r["write_s_per_gb"] + io_target * 1e3 * r["commit_s_per_gb"]) / 3600
        total["rest"] += checkpoints * rest  # models in this order, each compacted checkpoint by checkpoint
        peak = ckpt + state + total["rest"]  # the model's last checkpoint open, everything before compacted
        total["peak"] = max(total["peak"], peak)
        print(f"{name:>6s} {part:10.1f} {ckpt:16.1f} {state:9.1f} {peak:8.1f} {rest:12.2f} {checkpoints * rest:13.1f} "
              f"{io_now:22.2f} {io_before:15.2f} {io_target:8.2f} {hours_now:23.1f} {hours_target:9.1f}")
    print(f"whole sweep at rest (compacted): {total['rest']:.0f} GB; disk peak (12b's last checkpoint open, "
          f"every other compacted): {total['peak']:.0f} GB; without compaction the sweep keeps every "
          f"checkpoint's partials and state")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=50_304)
    ap.add_argument("--types", type=float, default=1.0, help="fraction of the vocabulary each partial holds")
    ap.add_argument("--sources", type=int, default=2)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--checkpoints", type=int, default=2)
    ap.add_argument("--moments", action="store_true", help="also the d×d moments of every layer")
    ap.add_argument("--vector-dtype", default="float32")
    ap.add_argument("--fold", choices=("commit", "checkpoint"), default="checkpoint",
                    help="commit: every commit folds its partial; checkpoint: commits append, one fold per checkpoint")
    ap.add_argument("--no-compact", action="store_true", help="do not compact each checkpoint once its partials are in")
    ap.add_argument("--no-write", action="store_true", help="skip the write-path part")
    ap.add_argument("--startup", default="1,8,64,512", help="partial counts for the start-up part ('' : skip)")
    ap.add_argument("--s3", action="store_true", help="the start-up part on S3 (moto's server on loopback)")
    ap.add_argument("--metadata", type=int, default=0, help="grow the manifest to this many entries (0: skip)")
    ap.add_argument("--project", default="", help="print the paper sweep's projection from measured rates "
                    "(commit_ratio=…,commit_s_per_gb=…,write_s_per_gb=…,rest_b_per_cell=…) and stop")
    ap.add_argument("--dir", type=Path, default=None, help="where to build (kept; default: a temporary directory, removed)")
    a = ap.parse_args()
    if a.project:
        return project(a.project)
    base = a.dir or Path(tempfile.mkdtemp(prefix="isoscale-"))
    base.mkdir(parents=True, exist_ok=True)
    print(f"{time.strftime('%Y-%m-%d')} bench_scale: {os.cpu_count()} CPUs; {' '.join(sys.argv[1:])}")
    try:
        if not a.no_write:
            print(f"write path: {a.checkpoints} checkpoint(s) × {a.sources} source(s) × {a.shards} shard(s), "
                  f"{a.layers} layers, {a.vocab} types × {a.types:g}, d {a.d}, vectors {a.vector_dtype}"
                  f"{', moments' if a.moments else ''}; warehouse {base / 'wh'}")
            bench_write(base / "wh", a)
        if a.startup and a.s3:
            server, url = moto_s3()
            try:
                print(f"start-up on S3: moto's server on 127.0.0.1 ({os.environ['AWS_ENDPOINT_URL']})")
                bench_startup(url, [int(x) for x in a.startup.split(",")])
            finally:
                server.terminate()
        elif a.startup:
            bench_startup(base, [int(x) for x in a.startup.split(",")])
        if a.metadata:
            bench_metadata(base, a.metadata)
    finally:
        if a.dir is None:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
