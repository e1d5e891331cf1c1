"""The extract run: model × checkpoints × sources → sums in the warehouse, one commit per checkpoint.

For each checkpoint: read the manifest once and check against it what can be skipped or kept and
what the commit would refuse (extract/run/preflight.py); load the model; write its parameter tables
(extract/run/tables.py) unless kept; stream each source through it (extract/run/stream.py) and write
its sums; then commit the checkpoint's entries (params and every source) in one atomic record.
Nothing of a checkpoint is visible until all of its sources have finished; on any failure its
uncommitted files are removed.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from common.errors import UserError
from warehouse import merge, query, store
from warehouse.storage import UncertainWrite, open_storage

from ..accumulate import cpu_kernels
from ..memory import limit_malloc_arenas, release_memory
from ..models import DTYPES, Loaded, ModelRef, check_dtype, check_local, load, model_identity, to_compute
from ..sources import Source, fingerprint, split_source
from .preflight import check_coverage, params_kept, sources_to_run
from .provenance import checkpoint_provenance, manifest_entry, run_provenance
from .settings import Settings, SourceResult
from .stream import accumulate_source, accumulate_split, memory_budget, new_accumulator
from .tables import remove_empty_dirs, write_params, write_sums
from .windows import max_window


class Interrupted(Exception):
    """SIGINT (Ctrl-C) during extract, with a line saying what was committed; the command line
    prints it and exits 130."""


@dataclass
class _Run:
    """What every checkpoint of one `extract` call shares."""
    ref: ModelRef
    sources: list[Source]
    root: object  # the warehouse's storage
    settings: Settings
    log: object
    prints: dict[str, str]  # source name → data fingerprint
    loader: object
    reducer: object
    compact: bool
    provenance: dict  # run_provenance
    committed: list[str]  # "model@checkpoint" of the commits that landed


@dataclass
class _Work:
    """One checkpoint's work so far: what a failure must remove and what the commit records."""
    run_id: str
    started: float  # perf_counter() when the checkpoint's model began to load
    spent: dict  # seconds of each phase, logged per checkpoint
    written: list[str] = field(default_factory=list)
    entries: list[dict] = field(default_factory=list)
    results: list[SourceResult] = field(default_factory=list)


def extract(ref: ModelRef, checkpoints: list[str], sources: list[Source], root,
            settings: Settings, log=print, prints: dict[str, str] | None = None, loader=None, reducer=None,
            compact: bool = False) -> list[SourceResult]:
    """Every checkpoint over every source, one commit per checkpoint.  `prints`: the sources' data
    fingerprints where the caller has them already (a sweep's plan), so no file is hashed twice.
    `loader(ref, checkpoint)`: a `Loaded` instead of `load` (an in-memory model, extract/api.py),
    run in its own dtype and device (not cast).  `reducer` (extract/reduce.py, a rank of a torchrun
    job): the ranks' sums are added before the write, and only rank 0 writes and commits.  `compact`:
    each checkpoint is compacted after its commit (`cli.py compact`; it then takes no new partial).
    SIGINT (KeyboardInterrupt) anywhere ends in `Interrupted`, whose line says what was committed."""
    committed: list[str] = []  # "model@checkpoint" of the commits that landed
    current: list[str] = []  # the checkpoint being worked on
    try:
        root = open_storage(root)  # a directory or s3://bucket/prefix; S3 is probed here, before any model loads
        limit_malloc_arenas()
        check_dtype(DTYPES[settings.dtype], settings.device)
        store.read_manifest(root)  # fails early on a warehouse of another schema version
        prints = {s.name: (prints or {}).get(s.name) or fingerprint(s) for s in sources}
        run = _Run(ref, sources, root, settings, log, prints, loader, reducer, compact, run_provenance(ref),
                   committed)
        results: list[SourceResult] = []
        for checkpoint in checkpoints:
            current[:] = [checkpoint]
            # One read per checkpoint, after the previous checkpoint's commit: every check before the
            # forward passes reads it; the commit checks conflicts, compatibility and compaction again
            # on the manifest as it is then, so nothing a later writer did slips through.
            results += _checkpoint(run, checkpoint, store.read_manifest(root))
        return results
    except KeyboardInterrupt:  # outside a checkpoint's own handler: loading, checks, logging
        what = f"{ref.name}@{(current or checkpoints or ['?'])[0]}"
        if what in committed:
            raise Interrupted(f"interrupted after {what} was committed; its data is in the warehouse") from None
        raise Interrupted(f"interrupted: nothing of {what} was committed" +
                          (f"; committed before it: {', '.join(committed)}" if committed else "")) from None


def _checkpoint(run: _Run, checkpoint: str, manifest: dict) -> list[SourceResult]:
    """One checkpoint: checks on `manifest`, load, tables, commit, then compaction and the log lines."""
    ref, settings = run.ref, run.settings
    todo = list(run.sources)
    check_local(ref, checkpoint, settings.trust_remote_code)
    identity = model_identity(ref, checkpoint)  # a local directory's weights: known before loading
    if settings.skip_done:
        todo, skip = sources_to_run(manifest, ref, checkpoint, run.sources, settings, run.prints, identity,
                                    run.reducer)
        if skip:
            run.log(f"{ref.name}@{checkpoint}: already in the warehouse with these settings; skipped")
            return []
    if skip_twin(run, manifest, checkpoint, identity):
        return []
    if not settings.params_only:
        merge.check_open(manifest, ref.name, checkpoint)  # before hours of forward passes
    data_todo = [] if settings.params_only else todo
    check_coverage(manifest, ref, checkpoint, data_todo, settings, run.prints, None)  # shards and files: before loading
    if not settings.params_only and str(settings.accumulator_device or settings.device).startswith("cpu") \
            and DTYPES[settings.dtype] == torch.float32:
        cpu_kernels.warm()  # the CPU's compiled token sums (float32 rows), loaded while the model loads
    t0 = time.perf_counter()
    loaded = (load(ref, checkpoint, DTYPES[settings.dtype], settings.device, settings.trust_remote_code,
                   settings.modules) if run.loader is None else run.loader(ref, checkpoint))
    try:
        if identity is None and loaded.revision_hash:  # a hub model's files (an in-memory model's weights), once loaded
            identity = (loaded.weights_id if run.loader is not None
                        else model_identity(ref, checkpoint, loaded.revision_hash))
            if skip_twin(run, manifest, checkpoint, identity):
                return []
        spent = {"load": time.perf_counter() - t0}  # seconds of each phase, logged per checkpoint
        if settings.max_length is not None and settings.max_length > loaded.context:
            raise UserError(f"--max-length {settings.max_length} exceeds the model's context of {loaded.context} tokens")
        # Once loaded, on the same read: hidden size, and other weights under this name.  A writer that
        # committed during the load is no re-read's concern: `merge.commit` checks both again.
        store.check_compatible(manifest, ref.name, loaded.d)
        check_coverage(manifest, ref, checkpoint, data_todo, settings, run.prints, identity,
                       max_window(loaded, settings))
        work = _Work(store.new_run_id(), t0, spent)
        prov = checkpoint_provenance(run.provenance, loaded, checkpoint, identity, settings)
        _write_and_commit(run, loaded, checkpoint, manifest, data_todo, prov, work)
    finally:
        del loaded  # the model's memory, before compaction and the next checkpoint's load
    _after_commit_steps(run, checkpoint, work)
    return work.results


def skip_twin(run: _Run, manifest: dict, checkpoint: str, identity: str | None) -> bool:
    """Whether to skip this checkpoint because its weights equal those of another checkpoint of the
    model already in the warehouse (--skip-twins); without --skip-twins a one-line warning."""
    others = merge.twin_checkpoints(manifest, run.ref.name, checkpoint, identity)
    if not others:
        return False
    what = f"{run.ref.name}@{checkpoint}"
    same = ", ".join(f"{run.ref.name}@{c}" for c in others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
    if run.settings.skip_twins:
        run.log(f"{what}: its weights equal those of {same} (every tensor identical), already in the warehouse; "
                "skipped (--skip-twins)")
        return True
    run.log(f"warning: {what}: its weights equal those of {same} (every tensor identical), already in the "
            "warehouse; extracting it anyway (--skip-twins skips such checkpoints; see the checkpoint_twins view)")
    return False


def _write_and_commit(run: _Run, loaded: Loaded, checkpoint: str, manifest: dict, todo: list[Source],
                      prov: dict, work: _Work) -> None:
    """The parameter tables (unless kept), every source's sums, one commit; on failure, the files
    of a commit that did not happen removed."""
    root, settings, reducer, spent = run.root, run.settings, run.reducer, work.spent
    try:
        t = time.perf_counter()
        if params_kept(manifest, loaded, prov) or (reducer is not None and not reducer.writes):
            spent["parameter tables (kept)" if reducer is None or reducer.writes else "parameter tables (rank 0)"] = 0.0
        else:
            params_files = write_params(root, loaded, work.run_id, prov)
            spent["parameter tables"] = time.perf_counter() - t
            work.written += params_files.values()
            work.entries = [manifest_entry("params", loaded, work.run_id, params_files, settings, loaded.d, prov=prov)]
        if run.loader is None:  # an in-memory model is left in its own dtype and device
            to_compute(loaded, DTYPES[settings.dtype], settings.device)
        for source in todo:
            parts = _accumulate(run, loaded, source, spent)
            if parts is None:  # a rank that does not write
                continue
            _write_parts(run, loaded, source, parts, work)
            _record(run, loaded, source, [(sub, result) for sub, result, _ in parts], prov, work)
        t = time.perf_counter()
        if work.entries:  # nothing when the parameter tables were kept and no source was left
            with store.collect_after_record() as failed_after:  # a step after the record failed: it landed
                merge.commit(root, work.entries, replace=settings.replace, fold=settings.fold)  # one record
            if failed_after:
                after_commit(root, f"{run.ref.name}@{checkpoint}", failed_after[0], run.log)
        spent["commit"] = time.perf_counter() - t
    except BaseException as exc:
        if not _keep_committed(run, checkpoint, work, keep=isinstance(exc, UncertainWrite)):
            if isinstance(exc, KeyboardInterrupt):
                raise Interrupted(f"interrupted: nothing of {run.ref.name}@{checkpoint} was committed" +
                                  (f"; committed before it: {', '.join(run.committed)}" if run.committed else "")
                                  ) from None
            raise
        after_commit(root, f"{run.ref.name}@{checkpoint}", exc, run.log)  # the record landed: say so


def _keep_committed(run: _Run, checkpoint: str, work: _Work, keep: bool = False) -> bool:
    """After a failure: removes the files no landed commit lists (none with `keep` or when the state
    cannot be read: a record that may still land would list them) and releases the run's lease;
    returns whether the checkpoint's commit is known to have landed (every entry's files listed)."""
    kept = merge.committed_files(run.root, work.entries)  # the live manifest: did the commit land?
    if kept is None:  # the state cannot be read: not known to have landed, and nothing deleted
        kept, keep = set(), True
    for rel in [] if keep else work.written:  # files of a commit that did not happen (never of one that did)
        if rel not in kept:
            with contextlib.suppress(Exception):  # a storage fault: an orphan for validate --fix
                run.root.delete(rel)
    store.release_leases(run.root, [work.run_id])  # its files are gone (or orphans, which --fix may now move)
    if work.entries and kept >= {f for e in work.entries for f in e["files"].values()}:
        return True
    remove_empty_dirs(run.root, run.ref.name, checkpoint)  # nothing of this checkpoint landed
    return False


def _accumulate(run: _Run, loaded: Loaded, source: Source, spent: dict) -> list[tuple] | None:
    """One source's sums: (source, result, sums) per value of a split source, one otherwise; under a
    reducing torchrun job the ranks' sums added on rank 0 (None on the other ranks)."""
    settings = run.settings
    if source.split_by is None:
        result = SourceResult(source.name)
        parts = [(source, result, accumulate_source(loaded, source, settings, result))]
    else:
        parts = [(p.source, p.result, p.acc) for p in accumulate_split(loaded, source, settings)]
    release_memory()  # the forward's freed temporaries, before the write allocates
    if run.reducer is not None:  # the job's sums, on rank 0 ([] on the others)
        t = time.perf_counter()
        parts = run.reducer.reduce(parts, lambda name, value, source=source: (
            split_source(source, value) if value is not None else source, SourceResult(name),
            new_accumulator(loaded, settings, memory_budget(settings))))
        spent["reduce"] = spent.get("reduce", 0.0) + time.perf_counter() - t
        if not parts:
            return None
    return parts


def _write_parts(run: _Run, loaded: Loaded, source: Source, parts: list[tuple], work: _Work) -> None:
    """Each value's sums written, then freed (every part's sums freed whatever happens)."""
    spent = work.spent
    try:
        if sum(r.tokens for _, r, _ in parts) == 0:
            raise UserError(f"--source {source.name}: {source.describe()}: no tokens to process "
                            f"({sum(r.documents for _, r, _ in parts)} documents after filters)")
        for sub, result, acc in parts:
            spent["forward"] = spent.get("forward", 0.0) + result.seconds
            t = time.perf_counter()
            result.files, result.vector_dtype = write_sums(run.root, loaded, sub, run.settings, acc, work.run_id)
            spent["write"] = spent.get("write", 0.0) + time.perf_counter() - t
            work.written += result.files.values()
            acc.close()
    finally:
        for _, _, acc in parts:
            acc.close()
    release_memory()


def _record(run: _Run, loaded: Loaded, source: Source, parts: list[tuple[Source, SourceResult]], prov: dict,
            work: _Work) -> None:
    """The data entries of one source's values, and a warning for what each one had to work around."""
    settings, log = run.settings, run.log
    for sub, result in parts:
        work.entries.append(manifest_entry(
            "data", loaded, work.run_id, result.files, settings, loaded.d, sub, result,
            {**prov, "source_fingerprint": run.prints[source.name],
             "source_path": str(sub.path.resolve()) if sub.path is not None else sub.describe()}))
        work.results.append(result)
        if result.replaced_lines:
            log(f"warning: {sub.name}: {result.replaced_lines} lines had bytes that are not UTF-8 (replaced with U+FFFD)")
        if result.skipped_lines:
            log(f"warning: {sub.name}: {result.skipped_lines} lines had bytes that are not UTF-8 (skipped)")
        if result.nonfinite:
            log(f"warning: {sub.name}: {result.nonfinite} NaN/inf activations counted and excluded")
        if result.vector_dtype != settings.vector_dtype:
            log(f"warning: {sub.name}: a token's sum of unit vectors exceeds {settings.vector_dtype}'s range "
                f"(it occurs more than 65,504 times): its vectors are stored in {result.vector_dtype}")


def _after_commit_steps(run: _Run, checkpoint: str, work: _Work) -> None:
    """After the commit landed: compaction (--compact), views.sql, and the checkpoint's log lines."""
    ref, reducer, spent = run.ref, run.reducer, work.spent
    run.committed.append(f"{ref.name}@{checkpoint}")
    if run.compact and (reducer is None or reducer.writes) and any(e["kind"] == "data" for e in work.entries):
        t = time.perf_counter()
        with store.collect_after_record() as failed_after:
            merge.compact(run.root, ref.name, checkpoint)
        if failed_after:
            after_commit(run.root, f"{ref.name}@{checkpoint} (compacted)", failed_after[0], run.log)
        spent["compact"] = time.perf_counter() - t
    if reducer is None or reducer.writes:
        try:
            query.refresh_companions(run.root)  # views.sql for the DuckDB shell (a query would rewrite it too)
        except BaseException as exc:
            after_commit(run.root, f"{ref.name}@{checkpoint}", exc, run.log)
    run.log(f"{ref.name}@{checkpoint}: {time.perf_counter() - work.started:.1f} s: " +
            ", ".join(f"{k} {v:.1f} s" for k, v in spent.items()))
    for r in work.results:
        run.log(f"{ref.name}@{checkpoint} {r.source}: {r.tokens} tokens, {r.documents} documents, "
                f"{r.skipped} skipped, {r.windows} windows, {r.nonfinite} non-finite, "
                f"{r.seconds:.1f} s ({r.tokens / max(r.seconds, 1e-9):.0f} tok/s)")


def after_commit(root, what: str, exc: BaseException, log) -> None:
    """A failure after the commit record was created: the data is in the warehouse.  What follows
    the record (manifest.json, runs.parquet, views.sql: caches a query rewrites; removing replaced
    files: orphans `validate --fix` removes) is not needed for correct answers, so a failure there
    is a warning; an interrupt there ends the run, saying the commit landed."""
    try:
        generation = f"generation {store.read_state(root)[0]}"
    except Exception:  # noqa: BLE001 - the line is what matters
        generation = "its commit record"
    if isinstance(exc, store.AfterRecord):  # the commit itself finished what it could and said what failed
        generation, exc = f"generation {exc.generation}", OSError(exc.reason)
    if isinstance(exc, KeyboardInterrupt):
        raise Interrupted(f"interrupted after {what} was committed ({generation}); its data is in the warehouse "
                          "(views.sql, runs.parquet and manifest.json are rewritten by the next query)") from None
    if not isinstance(exc, (OSError, UserError)):
        raise exc
    reason = " ".join(str(exc).split())[:200] or type(exc).__name__
    log(f"warning: {what} was committed ({generation}), but a step after its record failed ({reason}); "
        "views.sql, runs.parquet and manifest.json are rewritten by the next query (or `cli.py views`), "
        "left-over files are removed by `cli.py validate --fix`")


def summary_line(results: list[SourceResult], seconds: float) -> str:
    tokens = sum(r.tokens for r in results)
    return (f"done: {tokens} tokens, {sum(r.documents for r in results)} documents, "
            f"{sum(r.skipped for r in results)} skipped, {sum(r.nonfinite for r in results)} non-finite, "
            f"{seconds:.1f} s")
