"""Sweeps from a file: models × checkpoints × sources (× shards) and the extract settings in one TOML.

    warehouse = "wh"
    models = ["pythia-160m", { model = "pythia-410m", checkpoints = ["step1000", "step143000"] }]
    checkpoints = 21            # default for every model: a list of revisions, a count, or "all"
    shards = 1                  # each (model, checkpoint, source) as N shard units

    [sources]                   # NAME = what follows NAME= in --source, or a table with per-source options
    enron = "/data/enron.jsonl.zst"
    pile = { source = "/data/val.jsonl.zst", split_by = "meta.pile_set_name" }

    [settings]                  # any option of `cli.py extract`, spelt as on the command line
    unit = "sentence"

    [slurm]                     # for --slurm: lines for #SBATCH, tasks at once, shell lines before the run
    sbatch = ["--gres=gpu:1", "--time=24:00:00"]

A *unit* is one (model, checkpoint, source, shard): exactly the run of `cli.py extract --model M
--checkpoint C --source S --shard I/N --skip-done` with the settings (`commands()` writes them out).
The plan marks each unit done or to run with the same test as --skip-done; running the sweep runs
what is left; a Slurm array names the units to run by their index in the full list, and a task
refuses to run when the file has changed since the script was written (the plan id).

Memory and time: the unit list is models × checkpoints × sources × shards entries (a few hundred
bytes each); planning reads the manifest once and fingerprints each source once (its bytes: the
same read --skip-done does).
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from common.default_warehouse import DEFAULT_WAREHOUSE
from common.errors import UserError
from warehouse.storage import durable_temp

from .declared import OPTIONS, SOURCE_OPTIONS, Option

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

# Keys of [settings] that the sweep's own structure gives.
RESERVED = {"model": "models", "checkpoint": "checkpoints", "checkpoints": "checkpoints", "source": "[sources]",
            "warehouse": "warehouse", "shard": "shards", "skip_done": "the sweep (always on)",
            "compact": "the sweep (each finished checkpoint; `cli.py sweep --no-compact` keeps them open)",
            "fold": "the sweep (its units append their partials; each finished checkpoint is folded once)"}
TOP_KEYS = ("warehouse", "models", "checkpoints", "shards", "sources", "settings", "slurm")
SLURM_KEYS = ("sbatch", "parallel", "python", "setup", "job_name")

# The keys [settings] and a source's table may give: every extract option, by its Python name.
SPECS: dict[str, Option] = {o.name: o for o in OPTIONS}


@dataclass
class SourceSpec:
    name: str
    spec: str  # as --source takes it: NAME=… or a built-in name
    options: dict  # per-source options (pile_set, split_by, split, …) over [settings]


@dataclass
class ModelSpec:
    model: str
    checkpoints: object  # list of revisions | count (int) | "all" | None (the sweep's default)


@dataclass
class Sweep:
    path: Path
    warehouse: str
    models: list[ModelSpec]
    checkpoints: object
    shards: int
    sources: list[SourceSpec]
    settings: dict  # [settings] as given, by Python name
    slurm: dict

    def options(self, source: SourceSpec | None = None) -> dict:
        """Every extract option by name: the defaults, then [settings], then the source's own."""
        o = {name: spec.value_default for name, spec in SPECS.items()}
        o.update(self.settings)
        if source is not None:
            o.update(source.options)
        return o


@dataclass(frozen=True)
class Unit:
    index: int
    model: str  # as the file names it
    checkpoint: str
    source: str | None  # None: a --params-only sweep without sources
    shard: tuple[int, int]

    def label(self) -> str:
        src = self.source if self.source is not None else "(parameters)"
        return f"{self.model}@{self.checkpoint} {src} shard {self.shard[0]}/{self.shard[1]}"


def _where(path: Path, key: str) -> str:
    return f"{path.name}: {key}"


def _value(path: Path, key: str, value, spec: Option):
    """A [settings] or per-source value checked against the option's kind."""
    kind = "str" if spec.kind == "path" else spec.kind
    if kind == "flag" and isinstance(value, bool):
        return value
    if kind == "int" and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind == "str" and isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)
    if kind == "list":
        values = [value] if isinstance(value, str) else value
        if isinstance(values, list) and all(isinstance(v, str) for v in values):
            return list(values)
        raise UserError(f"{_where(path, key)}: expected a string or a list of strings, got {value!r}")
    expected = {"flag": "true or false", "int": "an integer", "str": "a string"}[kind]
    raise UserError(f"{_where(path, key)}: expected {expected}, got {value!r}")


def _checkpoints(path: Path, key: str, value):
    if value is None:
        return None
    if isinstance(value, bool):
        raise UserError(f"{_where(path, key)}: expected a list of revisions, a count or \"all\", got {value!r}")
    if isinstance(value, int):
        if value < 1:
            raise UserError(f"{_where(path, key)}: a count must be at least 1")
        return value
    if value == "all":
        return value
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) and v for v in value):
        return list(value)
    raise UserError(f"{_where(path, key)}: expected a list of revisions, a count or \"all\", got {value!r}")


def read_config(path: str | Path, builtin: tuple[str, ...] = ()) -> Sweep:
    """The sweep file, checked: every mistake is one UserError naming the file and the key.  Its keys
    are the extract options as declared (extract/declared.py); `builtin`: the built-in sources."""
    specs, source_options = SPECS, SOURCE_OPTIONS
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{path}: no such sweep file") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read it ({e.strerror})") from None
    try:
        doc = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise UserError(f"{path.name}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{path.name}: not valid TOML: {e}") from None
    for key in doc:
        if key not in TOP_KEYS:
            raise UserError(f"{_where(path, key)}: unknown key (expected {', '.join(TOP_KEYS)})")

    warehouse = doc.get("warehouse", DEFAULT_WAREHOUSE)
    if not isinstance(warehouse, str) or not warehouse:
        raise UserError(f"{_where(path, 'warehouse')}: expected a directory or s3://bucket/prefix")
    shards = doc.get("shards", 1)
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise UserError(f"{_where(path, 'shards')}: expected a positive integer, got {shards!r}")
    checkpoints = _checkpoints(path, "checkpoints", doc.get("checkpoints"))

    models_raw = doc.get("models")
    if isinstance(models_raw, (str, dict)):
        models_raw = [models_raw]
    if not isinstance(models_raw, list) or not models_raw:
        raise UserError(f"{_where(path, 'models')}: expected a list of models (aliases, directories or hub ids)")
    models = []
    for i, m in enumerate(models_raw):
        key = f"models[{i}]"
        if isinstance(m, str) and m:
            models.append(ModelSpec(m, None))
        elif isinstance(m, dict):
            extra = set(m) - {"model", "checkpoints"}
            if extra:
                raise UserError(f"{_where(path, key)}: unknown key {sorted(extra)[0]!r} (expected model, checkpoints)")
            if not isinstance(m.get("model"), str) or not m["model"]:
                raise UserError(f"{_where(path, key)}: expected model = \"NAME\"")
            models.append(ModelSpec(m["model"], _checkpoints(path, f"{key}.checkpoints", m.get("checkpoints"))))
        else:
            raise UserError(f"{_where(path, key)}: expected a model name or {{ model = …, checkpoints = … }}")
    if len({m.model for m in models}) != len(models):
        raise UserError(f"{_where(path, 'models')}: a model is named twice")

    settings = {}
    table = doc.get("settings", {})
    if not isinstance(table, dict):
        raise UserError(f"{_where(path, 'settings')}: expected a table [settings]")
    aliases = {spec.flag[2:].replace("-", "_"): name for name, spec in specs.items()}  # the option's spelling
    for key, value in table.items():
        name = key.replace("-", "_")
        name = aliases.get(name, name)
        if name in RESERVED:
            raise UserError(f"{_where(path, 'settings.' + key)}: given by the sweep's {RESERVED[name]}, not [settings]")
        if name not in specs:
            raise UserError(f"{_where(path, 'settings.' + key)}: not an option of `cli.py extract`")
        settings[name] = _value(path, "settings." + key, value, specs[name])

    sources = []
    table = doc.get("sources", {})
    if not isinstance(table, dict):
        raise UserError(f"{_where(path, 'sources')}: expected a table [sources] of NAME = \"PATH\"")
    for name, value in table.items():
        key = f"sources.{name}"
        options = {}
        if isinstance(value, dict):
            for k, v in value.items():
                opt = k.replace("-", "_")
                opt = aliases.get(opt, opt)
                if k != "source" and opt not in source_options:
                    raise UserError(f"{_where(path, key + '.' + k)}: not a source option (expected source, "
                                    f"{', '.join(o.replace('_', '-') for o in source_options)})")
                if k != "source":
                    options[opt] = _value(path, f"{key}.{k}", v, specs[opt])
            value = value.get("source")
        if not isinstance(value, str) or not value:
            raise UserError(f"{_where(path, key)}: expected \"PATH\" (as --source {name}=PATH takes it) or "
                            "{ source = \"PATH\", … }")
        spec = name if (name in builtin and value == name) else f"{name}={value}"
        sources.append(SourceSpec(name, spec, options))
    if not sources and not settings.get("params_only"):
        raise UserError(f"{_where(path, 'sources')}: name at least one source (or set params_only = true)")

    slurm = doc.get("slurm", {})
    if not isinstance(slurm, dict):
        raise UserError(f"{_where(path, 'slurm')}: expected a table [slurm]")
    slurm = {k.replace("-", "_"): v for k, v in slurm.items()}
    for key, value in slurm.items():
        if key not in SLURM_KEYS:
            raise UserError(f"{_where(path, 'slurm.' + key)}: unknown key (expected {', '.join(SLURM_KEYS)})")
        ok = {"sbatch": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
              "setup": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
              "parallel": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
              "python": lambda v: isinstance(v, str) and v,
              "job_name": lambda v: isinstance(v, str) and v and v.replace("-", "").replace("_", "").isalnum()}[key]
        if not ok(value):
            want = {"sbatch": "a list of strings", "setup": "a list of shell lines", "parallel": "a positive integer",
                    "python": "an interpreter path", "job_name": "letters, digits, '-' or '_'"}[key]
            raise UserError(f"{_where(path, 'slurm.' + key)}: expected {want}, got {value!r}")
    return Sweep(path, warehouse, models, checkpoints, shards, sources, settings, slurm)


def units(sweep: Sweep, revisions) -> list[Unit]:
    """Every unit in order model, checkpoint, source, shard.  `revisions(model, spec)`: the revisions
    of a model for a checkpoints spec (a list, a count, "all" or None for the final weights)."""
    out = []
    names = [s.name for s in sweep.sources] or [None]
    for m in sweep.models:
        spec = m.checkpoints if m.checkpoints is not None else sweep.checkpoints
        for checkpoint in revisions(m.model, spec):
            for name in names:
                for i in range(1, sweep.shards + 1):
                    out.append(Unit(len(out), m.model, checkpoint, name, (i, sweep.shards)))
    return out


def plan_id(sweep: Sweep, plan: list[Unit]) -> str:
    """What a Slurm task checks before it runs: the units in order, the sources and settings as given
    (not their environment-dependent defaults: a login node and a GPU node compute the same id)."""
    body = json.dumps({"units": [(u.model, u.checkpoint, u.source, u.shard) for u in plan],
                       "sources": [(s.spec, sorted(s.options.items())) for s in sweep.sources],
                       "settings": sorted(sweep.settings.items())}, default=str, sort_keys=True)
    return hashlib.blake2b(body.encode(), digest_size=6).hexdigest()


def commands(sweep: Sweep, plan: list[Unit], cli: tuple[str, ...] = ("cli.py",), warehouse: str | None = None) -> list[str]:
    """The `cli.py extract` command line of every unit: the same runs by hand (`cli`: what follows `python`,
    the checkout's cli.py or `-m isotropy_warehouse`)."""
    out = []
    for u in plan:
        source = next((s for s in sweep.sources if s.name == u.source), None)
        args = ["python", *cli, "extract", "--model", u.model, "--checkpoint", u.checkpoint]
        if source is not None:
            args += ["--source", source.spec]
        args += ["--shard", f"{u.shard[0]}/{u.shard[1]}", "--warehouse", warehouse or sweep.warehouse, "--skip-done"]
        given = {**sweep.settings, **(source.options if source is not None else {})}
        for name, value in given.items():
            spec = SPECS[name]
            if spec.kind == "flag":
                if value:
                    args.append(spec.flag)
                elif spec.off:
                    args.append(spec.off)
            elif spec.kind == "list":
                for v in value:
                    args += [spec.flag, v]
            else:
                args += [spec.flag, str(value)]
        out.append(shlex.join(args))
    return out


def array_spec(indices: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] → '0-2,5,7-8' (Slurm's --array syntax)."""
    parts, i = [], 0
    while i < len(indices):
        j = i
        while j + 1 < len(indices) and indices[j + 1] == indices[j] + 1:
            j += 1
        parts.append(str(indices[i]) if i == j else f"{indices[i]}-{indices[j]}")
        i = j + 1
    return ",".join(parts)


def slurm_script(sweep: Sweep, todo: list[int], pid: str, cli: tuple[str, ...], python: str, cwd: Path,
                 warehouse: str | None, written: str, total: int) -> str:
    """A job array whose task i runs unit i of the plan (the units still to run)."""
    job = sweep.slurm.get("job_name", "isotropy-sweep")
    array = array_spec(todo) + (f"%{sweep.slurm['parallel']}" if "parallel" in sweep.slurm else "")
    lines = ["#!/bin/bash",
             f"# Written by `cli.py sweep {sweep.path.name} --slurm` on {written}: plan {pid}, {total} units,",
             f"# {len(todo)} to run (the array names those, by their index in `cli.py sweep {sweep.path.name} --plan`).",
             "# Submit with `sbatch THIS_FILE`.  Preempted or failed tasks: submit it again (finished units are",
             "# skipped, --skip-done) or write it again (the array then names only what is left).  A task refuses",
             "# to run when the sweep file no longer gives the same plan.",
             f"#SBATCH --job-name={job}",
             f"#SBATCH --array={array}",
             f"#SBATCH --output={job}-%A_%a.out",
             "#SBATCH --requeue"]
    lines += [f"#SBATCH {line}" for line in sweep.slurm.get("sbatch", [])]
    lines += ["set -euo pipefail", f"cd {shlex.quote(str(cwd))}"]
    lines += list(sweep.slurm.get("setup", []))
    run = [python, *cli, "sweep", str(sweep.path.resolve())]
    if warehouse is not None:
        run += ["--warehouse", warehouse]
    lines.append("exec " + shlex.join(run) + ' --task "$SLURM_ARRAY_TASK_ID" --plan-id ' + pid)
    return "\n".join(lines) + "\n"


def write_script(path: Path, text: str) -> None:
    """The job script at `path`, executable, written atomically: the old script or the new one, never a part."""
    try:
        tmp = durable_temp(path, text.encode())
        try:
            tmp.chmod(0o755)
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
    except OSError as e:
        raise UserError(f"--slurm {path}: cannot write it ({e.strerror})") from None


def for_task(plan: list[Unit], task: int) -> Unit:
    if not 0 <= task < len(plan):
        raise UserError(f"--task {task}: the sweep has units 0 to {len(plan) - 1}")
    return plan[task]


def shard_settings(settings, shard: tuple[int, int]):
    """A unit's settings: its shard, and its partials appended (pending) rather than folded — a
    checkpoint's groups are folded once, when all its units are in (`finish_checkpoints`)."""
    return replace(settings, shard=shard, fold=False)


@dataclass
class Planned:
    """A sweep resolved against its models, sources and warehouse.  `done` is filled by `mark_done`
    (a Slurm task, which runs one unit, does not need it: extract's --skip-done decides there)."""

    sweep: Sweep
    units: list[Unit]
    refs: dict  # model as named → ModelRef
    sources: dict  # source name → Source
    settings: object  # extract.run.settings.Settings (shard 1/1; each unit runs with its own)
    warehouse: str
    id: str
    done: list[bool] = field(default_factory=list)
    prints: dict = field(default_factory=dict)  # source name → data fingerprint, once each

    def mark_done(self) -> None:
        """Mark every unit done or to run with the test --skip-done applies (one manifest read, each
        source fingerprinted once; extract reuses the fingerprints)."""
        from extract.run.preflight import already_done
        from extract.sources import fingerprint
        from warehouse import store
        from warehouse.storage import open_storage

        manifest = store.read_manifest(open_storage(self.warehouse))
        self.done = []
        for u in self.units:
            ref = self.refs[u.model]
            if u.source is None:
                self.done.append(store.entry_key("params", ref.name, u.checkpoint) in manifest["entries"])
                continue
            src = self.sources[u.source]
            if u.source not in self.prints:
                self.prints[u.source] = fingerprint(src)
            self.done.append(already_done(manifest, ref, u.checkpoint, src, shard_settings(self.settings, u.shard),
                                   self.prints[u.source]))

    def todo(self) -> list[int]:
        return [u.index for u in self.units if not self.done[u.index]]


def plan(sweep: Sweep, warehouse: str, planning: bool = False) -> Planned:
    """Resolve models, checkpoints and sources with the checks of `cli.py extract`.  `planning`: only
    planning here (--plan, --slurm), so a `device = "cuda"` setting is taken as given on a machine
    without a GPU (a login node)."""
    import torch

    from extract.launch import Launch
    from extract.options import check_sources, make_settings, make_source, revisions
    from extract.models import resolve_model

    o = sweep.options()
    cuda = torch.cuda.is_available() or (planning and str(o.get("device") or "").startswith("cuda"))
    settings = make_settings({**o, "skip_done": True}, Launch((1, 1), "explicit"), cuda)
    sources = {s.name: make_source(s.spec, sweep.options(s)) for s in sweep.sources}
    check_sources(list(sources.values()), o)
    refs = {m.model: resolve_model(m.model) for m in sweep.models}

    def revs(model, spec):
        if isinstance(spec, list):
            return revisions(refs[model], spec, None)
        return revisions(refs[model], None, None if spec is None else str(spec))

    all_units = units(sweep, revs)
    return Planned(sweep, all_units, refs, sources, settings, warehouse, plan_id(sweep, all_units))


def plan_lines(p: Planned) -> list[str]:
    """The plan as printed: a summary line, then one line per unit (index, done or to run, what)."""
    width = len(str(len(p.units) - 1))
    pairs = len({(u.model, u.checkpoint) for u in p.units})
    n_src, shards = len(p.sweep.sources), p.sweep.shards
    lines = [f"{p.sweep.path.name}: {len(p.units)} units ({pairs} model checkpoint(s)"
             + (f" × {n_src} source(s)" if n_src else ", parameters only") + f" × {shards} shard(s)): "
             f"{sum(p.done)} done, {len(p.todo())} to run; plan {p.id}"]
    for u in p.units:
        what = replace(u, model=p.refs[u.model].name).label()
        lines.append(f"{u.index:>{width}}  {'done  ' if p.done[u.index] else 'to run'}  {what}")
    return lines


def by_checkpoint(plan: list[Unit]) -> dict[tuple[str, str], dict[tuple[int, int], list[str | None]]]:
    """The plan's units by (model, checkpoint), then shard: the sources of each, in plan order."""
    out: dict = {}
    for u in plan:
        names = out.setdefault((u.model, u.checkpoint), {}).setdefault(u.shard, [])
        if u.source not in names:
            names.append(u.source)
    return out


def finish_checkpoints(p: Planned, log=print, compact: bool = True) -> int:
    """Every (model, checkpoint) of the plan whose units are all done and that holds data: its pending
    partials folded, in one pass per group (`cli.py merge`), and with `compact` the checkpoint
    compacted unless it is already (`cli.py compact`); returns how many checkpoints were touched."""
    from warehouse import merge, store
    from warehouse.query import refresh_companions
    from warehouse.storage import open_storage

    st = open_storage(p.warehouse)
    manifest = store.read_manifest(st)
    finished = {}
    for u in p.units:
        key = (p.refs[u.model].name, u.checkpoint)
        finished[key] = finished.get(key, True) and p.done[u.index] and u.source is not None
    pending = set(merge.pending_pairs(manifest))
    count = 0
    for (model, checkpoint), complete in finished.items():
        has_data = any(e["kind"] == "data" and e["model"] == model and e["checkpoint"] == checkpoint
                       for e in manifest["entries"].values())
        if not (complete and has_data):
            continue
        if (model, checkpoint) in pending:
            t = time.perf_counter()
            n = merge.fold_pending(st, model, checkpoint)
            log(f"{model}@{checkpoint}: every unit in; folded {n} partial(s) in {time.perf_counter() - t:.1f} s")
            count += 1
        if compact and not merge.is_compacted(manifest, model, checkpoint):
            res = merge.compact(st, model, checkpoint)
            log(f"{model}@{checkpoint}: compacted (token-level bytes {res['before']['bytes']} -> "
                f"{res['after']['bytes']})")
            count += 1
    if count:
        refresh_companions(st)
    return count


def run(p: Planned, log=print, task: int | None = None, expect_id: str | None = None, compact: bool = True):
    """Run the units still to run (all of them, or unit `task` of a Slurm array); returns the results.
    In this process (not `task`) the units run checkpoint by checkpoint (each shard's run of a checkpoint
    loads it once for all its sources).  Units append their partials without folding; each checkpoint
    is folded once, as soon as all its units are in (one pass per group), and with `compact` then
    compacted — the sweep's disk then holds one checkpoint's partials plus the compacted history.  A
    Slurm task neither folds nor compacts (it cannot know cheaply that the other tasks of its checkpoint
    are done): after the array, `cli.py sweep FILE` (nothing left to run) folds and compacts the
    finished checkpoints."""
    from extract.run import extract as run_extract

    if expect_id is not None and expect_id != p.id:
        raise UserError(f"{p.sweep.path.name} no longer gives the plan the Slurm script was written for "
                        f"(plan {expect_id}, now {p.id}): write the script again with --slurm")
    results = []
    if task is not None:
        u = for_task(p.units, task)
        log(f"unit {u.index}: {u.label()}")
        srcs = [p.sources[u.source]] if u.source is not None else []
        return run_extract(p.refs[u.model], [u.checkpoint], srcs, p.warehouse, shard_settings(p.settings, u.shard),
                           log=log)
    if not p.done:
        p.mark_done()
    pending = [p.units[i] for i in p.todo()]
    finish_checkpoints(p, log, compact)  # checkpoints finished by an earlier run (or a Slurm array)
    for (model, checkpoint), shards in by_checkpoint(pending).items():
        for shard, names in shards.items():
            srcs = [p.sources[n] for n in names if n is not None]
            results += run_extract(p.refs[model], [checkpoint], srcs, p.warehouse, shard_settings(p.settings, shard),
                                   log=log, prints=p.prints)
        for u in p.units:
            if u.model == model and u.checkpoint == checkpoint:
                p.done[u.index] = True
        finish_checkpoints(p, log, compact)
    return results
