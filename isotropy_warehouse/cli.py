"""Command line: parse options, call library functions.  Run `isotropy-warehouse --help` (or `python cli.py --help` in a checkout)."""

from __future__ import annotations

import csv
import json
import math
import sys
import time
from pathlib import Path
from typing import List, Optional

import typer
import typer.core

from common.allocator import keep_freed_memory
from common.errors import UserError
from common.openmp import short_spin

from .extract_options import GroupedHelp, declared_options, warehouse_option

typer.core.HAS_RICH = False  # usage errors as plain text: "Error: Invalid value for ..." on one line

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Extract-then-query warehouse for the isotropy of transformer language models.")

WAREHOUSE = warehouse_option()  # every command's --warehouse: one spelling, one default


def _launcher() -> tuple[str, ...]:
    """What follows `python` to run this command line again: the checkout's cli.py, else the installed package."""
    script = Path(__file__).resolve().parent.parent / "cli.py"
    return (str(script),) if script.is_file() else ("-m", "isotropy_warehouse")


class _Notes:
    """Warnings the warehouse raises while a command reads it (partials pending a fold), each printed
    once as a one-line `note:` on stderr, not as a Python warning; steps that failed after a commit's
    record (store.AfterRecord: the commit landed) as one `warning:` line."""

    def __enter__(self):
        import warnings

        self._cm = warnings.catch_warnings(record=True)
        self._seen = self._cm.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc):
        from warehouse.store import AfterRecord, after_record_line

        self._cm.__exit__(*exc)
        after = [w.message for w in self._seen if isinstance(w.message, AfterRecord)]
        for line in dict.fromkeys(str(w.message) for w in self._seen if not isinstance(w.message, AfterRecord)):
            typer.echo(f"note: {line}", err=True)
        if after:
            typer.echo(f"warning: {after_record_line(after)}", err=True)
        return False


def _refresh_after_commit(st) -> int:
    """views.sql and the other derived files after a command's commits; returns the generation.  On
    a full disk an AfterRecord warning (the commits landed; any query rewrites them)."""
    import warnings

    from warehouse.query import refresh_companions
    from warehouse.store import AfterRecord, read_state

    try:
        refresh_companions(st)
    except OSError as e:
        warnings.warn(AfterRecord(read_state(st)[0], "views", e))
    return read_state(st)[0]


def fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


@app.command(cls=GroupedHelp)
@declared_options  # every option as extract/declared.py declares it
def extract(**options):
    """Run a model over text sources and store mergeable sums.

    Example: python cli.py extract --model pythia-70m --checkpoint step143000 --source enron=enron.jsonl.zst --unit sentence

    Example (the Pile's sources, one read): python cli.py extract --model pythia-160m --source pile=val.jsonl.zst --split-by meta.pile_set_name

    Example (a Hugging Face dataset): python cli.py extract --model pythia-160m --source wiki=hf:wikitext:wikitext-103-raw-v1 --split validation

    Example (one node, 8 GPUs, one shard per GPU): torchrun --standalone --nproc_per_node 8 cli.py extract --model pythia-1.4b --source pile=val.jsonl.zst
    """
    warehouse = options["warehouse"]
    try:
        from extract.launch import finish, reducer_for
        from extract.memory import settle_imports
        from extract.options import prepare
        from extract.run import Interrupted, extract as run_extract, summary_line
    except KeyboardInterrupt:
        _interrupted("interrupted: nothing was committed")
    try:
        job = prepare(options)
        settle_imports()
        launch = job.launch
        start = time.perf_counter()
        tag = f"[rank {launch.rank} of {launch.world_size}] " if launch.distributed else ""
        reducer = reducer_for(launch, job.settings.device, job.settings.spill_dir)  # torchrun: ranks add, rank 0 commits
        results = run_extract(job.ref, job.revisions, job.sources, warehouse, job.settings, log=lambda m: typer.echo(tag + m, err=True),
                              reducer=reducer, compact=options["compact"])
        typer.echo(tag + summary_line(results, time.perf_counter() - start) +
                   f"; shard {launch.shard[0]}/{launch.shard[1]} ({launch.launcher}); warehouse: {warehouse}", err=True)
        finish(launch, reducer)  # under torchrun: rank 0 has committed when this returns
    except UserError as e:
        fail(str(e))
    except Interrupted as e:
        _interrupted(str(e))
    except KeyboardInterrupt:  # before the first checkpoint's work began (options, sources, model lookup)
        _interrupted("interrupted: nothing was committed")


def _interrupted(line: str) -> None:
    """SIGINT: one line and exit 130, at once.  os._exit, not sys.exit: threads still inside native code
    (torch's, the moments' worker) must not be unwound by interpreter shutdown, which could end in
    "terminate called without an active exception" (rc 134).  The warehouse needs no cleanup here:
    `extract` removed its uncommitted files before raising, and a commit is one record or none."""
    import os

    typer.echo(f"error: {line}", err=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(130)


@app.command()
def sweep(
    config: Path = typer.Argument(..., help="The sweep file (TOML): models, checkpoints, sources, [settings], [slurm]."),
    plan: bool = typer.Option(False, "--plan", help="Print the units (model, checkpoint, source, shard), done or to run, and stop."),
    commands: bool = typer.Option(False, "--commands", help="Print every unit's `cli.py extract` command (the same runs by hand) and stop."),
    slurm: Optional[Path] = typer.Option(None, "--slurm", help="Write a Slurm job-array script whose tasks run the units still to run, and stop."),
    task: Optional[int] = typer.Option(None, "--task", help="Run only unit N of the plan (what a Slurm array task runs)."),
    plan_id: Optional[str] = typer.Option(None, "--plan-id", help="With --task: refuse to run unless the file still gives this plan."),
    warehouse: Optional[str] = typer.Option(None, "--warehouse", "-w", help="Overrides the file's warehouse."),
    compact: bool = typer.Option(True, "--compact/--no-compact", help="Compact each checkpoint once all its units are in (default; the disk then holds one checkpoint's partials plus the compacted history). --no-compact keeps them open for more partials."),
):
    """Run a sweep from a file: models × checkpoints × sources (× shards), resuming where it stopped.

    Each unit is the run of `cli.py extract --model M --checkpoint C --source S --shard I/N --skip-done`
    with the file's settings: units already in the warehouse with the same data and settings are kept.

    Example: python cli.py sweep sweep.toml --plan

    Example (a Slurm job array of the units left): python cli.py sweep sweep.toml --slurm sweep.sbatch && sbatch sweep.sbatch
    """
    import datetime

    from extract import sweep as sw
    from extract.run import summary_line
    from extract.sources import BUILTIN

    try:
        if task is not None and (plan or commands or slurm):
            raise UserError("--task runs one unit: it cannot go with --plan, --commands or --slurm")
        if plan_id is not None and task is None:
            raise UserError("--plan-id goes with --task")
        spec = sw.read_config(config, tuple(BUILTIN))
        where = warehouse or spec.warehouse
        planning = plan or commands or slurm is not None
        p = sw.plan(spec, where, planning=planning)
        if task is None and not commands:  # a task runs one unit: extract's --skip-done judges it
            p.mark_done()
        if commands:
            for line in sw.commands(spec, p.units, cli=_launcher(), warehouse=where):
                typer.echo(line)
            return
        if plan or slurm is not None:
            for line in sw.plan_lines(p):
                typer.echo(line)
        if slurm is not None:
            todo = p.todo()
            if not todo:
                typer.echo("nothing to run: no script written", err=True)
                return
            python = spec.slurm.get("python", sys.executable)
            text = sw.slurm_script(spec, todo, p.id, _launcher(), python, Path.cwd(), warehouse,
                                   datetime.datetime.now().isoformat(timespec="seconds"), len(p.units))
            sw.write_script(slurm, text)
            typer.echo(f"wrote {slurm}: {len(todo)} array tasks; submit with: sbatch {slurm}", err=True)
        if plan or slurm is not None:
            return
        from extract.memory import settle_imports

        settle_imports()
        start = time.perf_counter()
        log = lambda m: typer.echo(m, err=True)  # noqa: E731
        if task is None:
            log(sw.plan_lines(p)[0])
        results = sw.run(p, log=log, task=task, expect_id=plan_id, compact=compact)
        log(summary_line(results, time.perf_counter() - start) + f"; warehouse: {where}")
    except UserError as e:
        fail(str(e))


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


@app.command()
def sql(
    query: str = typer.Argument(..., help="SQL over the views (inter_sim, intra_sim, avg_intra_sim, isotropy, layernorm, …)."),
    warehouse: str = WAREHOUSE,
    format: str = typer.Option("table", "--format", "-f", help="table | csv | json"),
):
    """Query the warehouse with DuckDB.

    Example: python cli.py sql "SELECT layer, inter_sim FROM inter_sim ORDER BY layer" --format csv
    """
    import duckdb

    from warehouse.query import check_read_only, connect, duckdb_error_line, views_read

    if format not in ("table", "csv", "json"):
        fail(f"--format {format!r}: expected table, csv or json")
    try:
        check_read_only(query)  # a query cannot write, attach, install or load (the connection is locked too)
        with _Notes():
            con = connect(warehouse, views=views_read(query))  # only the views it reads: a faster start
        cur = con.execute(query)
        if cur.description is None:
            return
        cols, rows = [d[0] for d in cur.description], cur.fetchall()
    except UserError as e:
        fail(str(e))
    except duckdb.Error as e:
        fail(duckdb_error_line(e))
    if format == "json":
        typer.echo(json.dumps([{c: _clean(v) for c, v in zip(cols, r)} for r in rows], default=str))
    elif format == "csv":
        w = csv.writer(sys.stdout, lineterminator="\n")
        w.writerow(cols)
        w.writerows(rows)
    else:
        text = [[("NULL" if v is None else (f"{v:.6g}" if isinstance(v, float) else str(v))) for v in r] for r in rows]
        widths = [max([len(c)] + [len(r[i]) for r in text]) for i, c in enumerate(cols)]
        typer.echo("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
        typer.echo("  ".join("-" * w for w in widths))
        for r in text:
            typer.echo("  ".join(v.ljust(w) for v, w in zip(r, widths)))
        typer.echo(f"({len(rows)} rows)", err=True)


@app.command()
def validate(
    warehouse: str = WAREHOUSE,
    fix: bool = typer.Option(False, "--fix", help="Rebuild lost, damaged or wrong merged tables from their partials; move files no entry lists (older than --grace, of no live writer) to _quarantine/; rewrite views.sql. Never deletes."),
    grace: str = typer.Option("1h", "--grace", help="A file no entry lists is quarantined by --fix only when older than this (0, 90s, 30m, 1h, 2d)."),
    purge: bool = typer.Option(False, "--purge", help="Delete everything in _quarantine/ (printing each path) before validating."),
):
    """Check every file of the warehouse against the schema, the manifest and its commit record's
    checksum, and every merged table against a fresh merge of its partials.

    Example: python cli.py validate --fix
    """
    from warehouse.storage import open_storage
    from warehouse.validate import parse_duration, purge as run_purge, validate as run_validate

    try:
        grace_s = parse_duration(grace)
        st = open_storage(warehouse, must_exist=True)
        if purge:
            run_purge(st, say=typer.echo)
        with _Notes():  # --fix's rebuilds commit: a step failing after their record is a warning
            problems = run_validate(st, fix, grace_s, say=lambda line: typer.echo(line, err=True))
    except UserError as e:
        fail(str(e))
    for p in problems:
        typer.echo(p)
    if problems:
        typer.echo(f"{len(problems)} problem(s) in {warehouse}", err=True)
        raise typer.Exit(1)
    typer.echo(f"{warehouse}: ok", err=True)


@app.command("merge")
def merge_pending(
    warehouse: str = WAREHOUSE,
    model: Optional[str] = typer.Option(None, help="Only this model (default: every model)."),
    checkpoint: Optional[str] = typer.Option(None, help="Only this checkpoint (default: every checkpoint)."),
):
    """Fold the partials committed without a fold (`extract --no-fold`, Slurm array tasks) into the
    merged tables the views read: every pending partial of a group in one pass over its state, one
    commit record.  Safe beside running extracts and other merges (nothing is folded twice).

    Example: python cli.py merge --model pythia-1.4b --checkpoint step143000
    """
    from warehouse.merge import fold_pending
    from warehouse.storage import open_storage

    try:
        st = open_storage(warehouse, must_exist=True)
        t = time.perf_counter()
        with _Notes():
            n = fold_pending(st, model, checkpoint)
            generation = _refresh_after_commit(st)
    except UserError as e:
        fail(str(e))
    typer.echo(f"folded {n} pending partial(s) in {time.perf_counter() - t:.1f} s (generation {generation})"
               if n else "nothing pending", err=True)


@app.command()
def compact(
    warehouse: str = WAREHOUSE,
    model: Optional[str] = typer.Option(None, help="Only this model (default: every model)."),
    checkpoint: Optional[str] = typer.Option(None, help="Only this checkpoint (default: every checkpoint)."),
):
    """Make checkpoints final: drop the per-partial token vectors, moments and samples and the merge
    state, keeping every table a view reads (all views stay exact).  A compacted checkpoint takes no
    new or re-run partial (that is refused with an error); extract those into another warehouse.

    Example: python cli.py compact --model pythia-1.4b --checkpoint step143000
    """
    from warehouse.merge import compact as run_compact
    from warehouse.storage import open_storage

    try:
        st = open_storage(warehouse, must_exist=True)
        with _Notes():
            res = run_compact(st, model, checkpoint)
            generation = _refresh_after_commit(st)
    except UserError as e:
        fail(str(e))
    b, a = res["before"], res["after"]
    per = lambda x: f"{x['bytes_per_cell']:.1f}" if x["bytes_per_cell"] is not None else "-"  # noqa: E731
    typer.echo(f"compacted {res['checkpoints']} checkpoint(s): token-level bytes {b['bytes']} -> {a['bytes']} "
               f"({per(b)} -> {per(a)} B per (layer, token type), {a['cells']} cells; generation {generation})")


@app.command()
def views(warehouse: str = WAREHOUSE):
    """Rewrite WAREHOUSE/views.sql, the DuckDB shell's init file (e.g. after moving the warehouse).

    Example: python cli.py views && duckdb -init isotropy-warehouse/views.sql
    """
    from warehouse.query import write_views_file
    from warehouse.storage import open_storage

    try:
        typer.echo(write_views_file(open_storage(warehouse, must_exist=True)))
    except UserError as e:
        fail(str(e))


@app.command()
def pull(
    warehouse: str = WAREHOUSE,
    to: Path = typer.Option(..., "--to", help="A new local directory for the copy."),
    model: Optional[str] = typer.Option(None, help="Only this model (default: every model)."),
    checkpoint: Optional[str] = typer.Option(None, help="Only this checkpoint (default: every checkpoint)."),
    full: bool = typer.Option(False, "--full", help="Copy every file (a mirror that takes new partials), not only what the views read."),
):
    """Copy a warehouse (e.g. on S3) into a new local directory, for the DuckDB shell without httpfs
    or for working offline.  By default only what the views read (~42 B per layer and token type).

    Example: python cli.py pull --warehouse s3://bucket/pythia --to local-copy && duckdb -init local-copy/views.sql
    """
    from warehouse.pull import pull as run_pull

    try:
        res = run_pull(warehouse, to, model, checkpoint, full)
    except UserError as e:
        fail(str(e))
    typer.echo(f"copied {res['entries']} entries ({res['files']} files, {res['bytes']} bytes) to {to}; "
               f"open with: duckdb -init {to / 'views.sql'}", err=True)


@app.command()
def train(
    source: str = typer.Option("stdlib-docs", "--source", "-s", help="NAME=PATH or a built-in source (stdlib-docs)."),
    out: Path = typer.Option(..., "--out", "-o", help="Directory for out/stepN checkpoints."),
    tied: bool = typer.Option(False, "--tied/--untied", help="Tie the embedding and unembedding matrices."),
    width: int = typer.Option(128, help="Hidden size."),
    depth: int = typer.Option(4, help="Number of blocks."),
    heads: int = typer.Option(4, help="Attention heads."),
    context: int = typer.Option(128, help="Training sequence length (and the model's context)."),
    vocab: int = typer.Option(4096, help="BPE vocabulary size (tokenizer trained on the source)."),
    steps: int = typer.Option(600, help="Optimizer steps."),
    save_every: int = typer.Option(60, help="Save a checkpoint every N steps (and at 0 and the end)."),
    batch_size: int = typer.Option(16, help="Sequences per step."),
    lr: float = typer.Option(3e-3, help="Peak learning rate (warm-up, then cosine to 10 %)."),
    seed: int = typer.Option(0, help="Seed for initialisation and batches."),
    probe: Optional[str] = typer.Option(None, "--probe", help="NAME=PATH: at every save step, extract the live model over this probe set into --warehouse (checkpoint stepN of the model named after --out), in the loop."),
    warehouse: str = WAREHOUSE,
    probe_tokens: int = typer.Option(20_000, help="Tokens of the --probe set per probe."),
    checkpoints: bool = typer.Option(True, "--checkpoints/--no-checkpoints", help="Save out/stepN checkpoints (--no-checkpoints: only the --probe results)."),
):
    """Train a micro Pythia-style GPT-NeoX on a source, saving checkpoints step0 … stepN for `extract`.

    Example: python cli.py train --source stdlib-docs --out micro/untied --untied --steps 600 --save-every 60

    Example (isotropy in the loop): python cli.py train --out micro/untied --probe probe=probe.txt
    """
    from extract.sources import fingerprint, parse_source
    from extract.train import Probe, TrainSettings, train as run_train

    try:
        src = parse_source(source)
        settings = TrainSettings(tied=tied, width=width, depth=depth, heads=heads, context=context, vocab=vocab,
                                 steps=steps, save_every=save_every, batch_size=batch_size, lr=lr, seed=seed)
        if probe is not None:
            parse_source(probe)  # a bad probe source: one line before training
        run_train(src, out, settings, fingerprint(src), log=lambda m: typer.echo(m, err=True),
                  probe=Probe(probe, warehouse, probe_tokens) if probe is not None else None, save=checkpoints)
    except UserError as e:
        fail(str(e))


@app.command()
def demo(
    directory: Path = typer.Option(Path("demo"), "--dir", "-d", help="Where models, warehouse and report go."),
    full: bool = typer.Option(False, "--full", help="The larger run: 600 steps of batch 16, 100,000 tokens per checkpoint."),
    steps: Optional[int] = typer.Option(None, help="Training steps of each micro model (default 200; --full 600)."),
    save_every: Optional[int] = typer.Option(None, help="Checkpoint interval of the micro models (default 25; --full 60)."),
    batch_size: Optional[int] = typer.Option(None, help="Training sequences per step (default 8; --full 16)."),
    max_tokens: Optional[int] = typer.Option(None, help="Tokens extracted per checkpoint (default 20,000; --full 100,000)."),
    force: bool = typer.Option(False, "--force", help="Retrain and re-extract even when done before."),
):
    """The whole job offline: train tied/untied micro models, extract them and MiniLM, draw the report.

    Example: python cli.py demo --dir demo
    """
    start = time.perf_counter()
    from extract.demo import demo_settings, run_demo

    libraries = time.perf_counter() - start
    settings = demo_settings(full, force, steps=steps, save_every=save_every, batch_size=batch_size,
                             max_tokens=max_tokens)
    try:
        result = run_demo(directory, settings, log=lambda m: typer.echo(m, err=True))
    except UserError as e:
        fail(str(e))
    stages = [("start-up (imports)", libraries), *result["stages"]]
    views = result["warehouse"] / "views.sql"
    typer.echo(f"\ndemo finished in {libraries + result['seconds']:.0f} s:")
    for name, seconds in stages:
        typer.echo(f"  {name:<40} {seconds:6.1f} s")
    typer.echo(f"warehouse: {result['warehouse']}")
    typer.echo(f"report:    {result['report']}  ({result['drawn']} of {result['figures']} figures)")
    for f in result["missing"]:
        typer.echo(f"  not drawn: {f.title}: {f.missing}")
    typer.echo("try in the DuckDB shell:")
    for q in result["queries"]:
        typer.echo(f'  duckdb -init {views} -c "{q}"')


@app.command()
def report(
    warehouse: str = WAREHOUSE,
    out: Path = typer.Option(Path("reports"), "--out", "-o", help="Output directory."),
    model: Optional[List[str]] = typer.Option(None, "--model", "-m", help="Only these models (repeatable)."),
    checkpoint: Optional[List[str]] = typer.Option(None, "--checkpoint", "-c", help="Only these checkpoints (repeatable)."),
):
    """Draw the paper's figures (and more) from the warehouse: index.html, PNG, SVG and CSV per chart.

    Example: python cli.py report --out reports && chromium reports/index.html
    """
    from warehouse.report import build_report

    try:
        with _Notes():
            result = build_report(warehouse, out, model, checkpoint)
    except UserError as e:
        fail(str(e))
    for f in result.missing:
        typer.echo(f"not drawn: {f.title}: {f.missing}", err=True)
    typer.echo(f"{len(result.drawn)} of {len(result.figures)} figures drawn: {out / 'index.html'}", err=True)


@app.command()
def doctor(
    model: str = typer.Option("minilm", "--model", "-m", help="The model to measure, as for extract (default: minilm, shipped as a package)."),
    device: Optional[str] = typer.Option(None, help="cpu | cuda (default: cuda when available)."),
    dtype: Optional[str] = typer.Option(None, help="float32 | bfloat16 | float16 (default: bfloat16 on cuda, float32 on cpu)."),
    seconds: float = typer.Option(30.0, help="How long to alternate the bare forward and the default pass (after one warm-up pass of each)."),
    source: str = typer.Option("stdlib-docs", "--source", "-s", help="The text to batch: NAME=PATH, a path, or a built-in (stdlib-docs)."),
    batches: int = typer.Option(8, "--batches", help="Batches made from the source and reused by every pass."),
    max_length: Optional[int] = typer.Option(None, help="Tokens per window (default: the model's context, as extract)."),
    batch_tokens: Optional[int] = typer.Option(None, help="Padded tokens per batch at most (default: as extract)."),
    out: Path = typer.Option(Path("isotropy-doctor.json"), "--out", "-o", help="Where to save the report (JSON) to attach to a bug report."),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code", help="Allow model code from the hub (off by default)."),
):
    """Measure the default extraction pass against a bare forward on this machine and model: the
    ratio, tokens per second, peak memory, the code paths taken (compiled or eager step, moments'
    precision, scatter), a check against float64, versions; saved as JSON.

    Example: python cli.py doctor --model pythia-1.4b --seconds 30 --out doctor.json
    """
    from extract.doctor import check_out, doctor as run_doctor, summary, write_report

    try:
        check_out(out)
        rep = run_doctor(model, device, dtype, seconds, source, batches, max_length, batch_tokens, trust_remote_code,
                         log=lambda line: typer.echo(line, err=True))
    except UserError as e:
        fail(str(e))
    typer.echo(summary(rep), err=True)
    typer.echo(f"saved: {write_report(rep, out)}", err=True)


def _program() -> str:
    """How the user ran this command line: `python cli.py` (a checkout), `isotropy-warehouse` (the
    console script) or `python -m isotropy_warehouse`."""
    name = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    if name == "cli.py":
        return "python cli.py"
    if name == "__main__.py":
        return "python -m isotropy_warehouse"
    return "isotropy-warehouse"


def _examples_as_run(program: str) -> None:
    """Each command's help (its `Example:` lines) in the words the user ran it with."""
    if program == "python cli.py":
        return
    for info in app.registered_commands:
        doc = info.callback.__doc__ if info.callback is not None else None
        if doc and "python cli.py" in doc:
            info.callback.__doc__ = doc.replace("python cli.py", program)


def main() -> None:
    """Run the app; an I/O failure that no command turned into a message (a disk or a store failing
    mid-run) still ends in one line and exit code 2."""
    short_spin()  # before anything loads torch's OpenMP runtime (common/openmp.py)
    keep_freed_memory()  # activations reused from the heap, not mapped again per batch (common/allocator.py)
    _examples_as_run(_program())
    try:
        app()
    except OSError as e:
        typer.echo(f"error: {' '.join(str(e).split())[:400] or type(e).__name__}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
