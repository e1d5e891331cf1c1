"""Where an extract's forward loop goes, measured inside one process: the forward itself, the layer hooks
(the crew's wall time, its helpers' busy time and their idle time while a hook waits), the batches'
`set_batch` (the token table's growth among it), and the wait for the prefetched batches.

A ratio against a bare forward measured in another process moves with this machine's speed from one
minute to the next; the parts below come from one run, so their shares do not.
`loop ÷ (loop − ours)` estimates default ÷ bare for the loop, "ours" being the hooks and `set_batch`
(it assumes the forward between the hooks runs as fast as a bare one: compare with bench_matrix.py, and
the forward's minor page faults, printed, with `bare_forward.py`'s).

    python bench/hook_accounting.py -- --model DIR --source bench=FILE.jsonl --unit sentence --max-length 512
    python bench/hook_accounting.py --timeline 2 -- --model DIR --source bench=FILE.jsonl   # two hooks' tasks

Everything after `--` goes to `cli.py extract` (a warehouse in a temporary folder unless given); a
`--split-by` source's loop is not timed.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.openmp import short_spin  # noqa: E402

short_spin()  # as the command line does, before torch loads

from extract import staging  # noqa: E402
from extract.accumulate import crew, sums, tables  # noqa: E402
from extract.run import driver, stream  # noqa: E402

seconds: dict[str, float] = defaultdict(float)
calls: dict[str, int] = defaultdict(int)
faults: dict[str, int] = defaultdict(int)  # minor page faults of the whole process while the part ran
hooks: list[tuple[float, list]] = []  # per crew run: (wall, [(helper, task, start, end)])


def minor_faults() -> int:
    """The process's minor page faults so far (all threads)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def timed(owner, name: str, key: str) -> None:
    """Wrap owner.name so its calls add to seconds[key]."""
    original = getattr(owner, name)

    def wrapper(*args, **kw):
        t0, f0 = time.perf_counter(), minor_faults()
        try:
            return original(*args, **kw)
        finally:
            seconds[key] += time.perf_counter() - t0
            calls[key] += 1
            faults[key] += minor_faults() - f0
    setattr(owner, name, wrapper)


def trace_crew() -> None:
    run = crew.Crew.run

    def traced(self, tasks):
        done, t0 = [], time.perf_counter()
        for task in tasks:
            fn, name = task.fn, getattr(task.fn, "func", task.fn).__name__

            def wrapped(fn=fn, name=name):
                a = time.perf_counter()
                fn()
                done.append((threading.current_thread().name, name, a - t0, time.perf_counter() - t0))
            task.fn = wrapped
        run(self, tasks)
        hooks.append((time.perf_counter() - t0, done))
    crew.Crew.run = traced


def trace_waits() -> None:
    iterate = staging.Prefetch.__iter__

    def waited(self):
        it = iterate(self)
        while True:
            t0 = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                return
            seconds["waiting for batches"] += time.perf_counter() - t0
            calls["waiting for batches"] += 1
            yield item
    staging.Prefetch.__iter__ = waited


def report(timeline: int) -> None:
    loop = seconds["forward loop"]
    ours = seconds["hooks (TokenSums.add)"] + seconds["set_batch"]
    between = faults["forward (hooks included)"] - faults["hooks (TokenSums.add)"]
    print(f"forward loop {loop:.2f} s; forward between the hooks {seconds['forward (hooks included)'] - seconds['hooks (TokenSums.add)']:.2f} s, "
          f"{between} minor page faults")
    for key in ("hooks (TokenSums.add)", "set_batch", "table growth (SlotTable.grow)", "gather (TokenSums._gather)",
                "waiting for batches"):
        print(f"  {key:32s} {seconds[key]:7.3f} s in {calls[key]} calls, {faults[key]} minor page faults")
    if hooks:
        busy = [sum(b - a for _, _, a, b in tasks) for _, tasks in hooks]
        helpers = max(len({t[0] for t in tasks}) for _, tasks in hooks)
        wall = sum(w for w, _ in hooks)
        print(f"  crew: {len(hooks)} runs, wall {wall:.3f} s, helpers busy {sum(busy):.3f} s "
              f"(÷ {helpers}: {sum(busy) / helpers:.3f} s), wall ÷ ideal {wall * helpers / sum(busy):.3f}")
        by_task = defaultdict(float)
        for _, tasks in hooks:
            for _, name, a, b in tasks:
                by_task[name] += b - a
        print("  crew tasks: " + ", ".join(f"{k} {v:.3f} s" for k, v in sorted(by_task.items())))
        print(f"  crew: first task starts {1e3 * statistics.mean(min(t[2] for t in ts) for _, ts in hooks):.3f} ms "
              f"after the hook, mean")
        for w, tasks in hooks[len(hooks) // 2: len(hooks) // 2 + timeline]:
            print(f"  one hook, {w * 1e3:.2f} ms:")
            for helper, name, a, b in sorted(tasks, key=lambda t: (t[0], t[2])):
                print(f"    {helper} {name:14s} {a * 1e3:6.2f} → {b * 1e3:6.2f} ms")
    if loop > ours > 0:
        print(f"loop ÷ (loop − hooks − set_batch) = {loop / (loop - ours):.3f}")
    else:  # nothing streamed (a source already done), or a --split-by source, whose loop this does not time
        print("loop ÷ (loop − hooks − set_batch): nothing to compare (no plain source streamed)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--timeline", type=int, default=0, help="print this many hooks' tasks, helper by helper")
    ap.add_argument("extract", nargs=argparse.REMAINDER, help="-- then cli.py extract's arguments")
    a = ap.parse_args()
    args = [x for x in a.extract if x != "--"]
    if "--warehouse" not in args:
        args += ["--warehouse", tempfile.mkdtemp(prefix="hook-accounting-") + "/wh"]
    timed(sums.TokenSums, "set_batch", "set_batch")
    timed(sums.TokenSums, "add", "hooks (TokenSums.add)")
    timed(sums.TokenSums, "_gather", "gather (TokenSums._gather)")
    timed(tables.SlotTable, "grow", "table growth (SlotTable.grow)")
    forward_batch = stream.forward_batch

    def counted(run, *rest, **kw):
        def forward(*x, **y):
            t0, f0 = time.perf_counter(), minor_faults()
            try:
                return run(*x, **y)
            finally:
                seconds["forward (hooks included)"] += time.perf_counter() - t0
                faults["forward (hooks included)"] += minor_faults() - f0
        return forward_batch(forward, *rest, **kw)
    stream.forward_batch = counted
    trace_crew()
    trace_waits()
    accumulate_source = driver.accumulate_source

    def accumulated(loaded, source, settings, result):  # the loop's own clock: SourceResult.seconds
        acc = accumulate_source(loaded, source, settings, result)
        seconds["forward loop"] += result.seconds
        return acc
    driver.accumulate_source = accumulated
    from isotropy_warehouse.cli import main as cli_main
    sys.argv = ["cli.py", "extract", *args]
    try:
        cli_main()
    except SystemExit as e:
        if e.code:
            raise
    report(a.timeline)


if __name__ == "__main__":
    main()
