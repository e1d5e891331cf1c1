"""A commit whose record landed but a step after it failed (a full disk, a storage fault): it is
committed all the same.  What follows a record only refreshes caches or removes garbage — the
companions (manifest.json, runs.parquet, views.sql: any query rewrites them), the writer's lease (its
files are listed now; validate --fix moves the lease once the writer is gone), the files the commit
replaced (proven garbage: validate --fix moves them) — so such a failure is an `AfterRecord`
warning, never an error: the command says the commit landed (generation G) and what was left.
"""

from __future__ import annotations

import contextlib
import warnings

# step → (what failed, what follows from it)
STEPS = {
    "companions": ("writing manifest.json and runs.parquet",
                   "manifest.json, runs.parquet and views.sql are rewritten by the next query (or `cli.py views`)"),
    "views": ("writing views.sql", "views.sql is rewritten by the next query (or `cli.py views`)"),
    "release": ("removing its lease", "`cli.py validate --fix` moves the lease once this process has exited"),
    "gc": ("removing the files it replaced", "`cli.py validate --fix` moves them to _quarantine/"),
}


class AfterRecord(UserWarning):
    """Generation `generation` was committed, but `step` (a key of STEPS) failed after its record
    with `reason` (the error, one line)."""

    def __init__(self, generation: int, step: str, reason: BaseException | str):
        self.generation, self.step = generation, step
        self.reason = " ".join(str(reason).split())[:200] or type(reason).__name__
        super().__init__(after_record_line([self]))


def after_record_line(found: list[AfterRecord], what: str = "") -> str:
    """One line for one or more AfterRecord warnings of a command (`what`: e.g. "M@C " — what was
    committed)."""
    generation = max(w.generation for w in found)
    steps = list(dict.fromkeys(w.step for w in found))
    failed = " and ".join(STEPS[s][0] for s in steps)
    then = "; ".join(STEPS[s][1] for s in steps)
    reasons = "; ".join(dict.fromkeys(w.reason for w in found))
    return f"{what}committed (generation {generation}), but {failed} failed after the commit record ({reasons}); {then}"


@contextlib.contextmanager
def collect_after_record():
    """Collect the AfterRecord warnings raised inside into the list it yields (filled at exit);
    every other warning is passed on as it came."""
    found: list[AfterRecord] = []
    seen: list = []
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            yield found
    finally:
        for w in seen:
            if isinstance(w.message, AfterRecord):
                found.append(w.message)
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
