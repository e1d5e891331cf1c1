"""Fault injection for the reliability tests: `ISO_FAULT=point[:n]` kills the process with
SIGKILL the n-th time (default 1st) execution reaches `point`.  Unset, `hit()` is two lookups in
the environment.  Points: read, forward, write, close, merge (merged files written, manifest not yet),
manifest, views, gc, compact, spill (between the layers of a spill run, extract/accumulate/spill.py), reduce (a
torchrun rank, before its sums are reduced), lease (before a writer's lease is created), release (record
created, lease not yet removed), quarantine (before validate --fix moves a file), move (S3: copied
into the quarantine, original not yet deleted), pause (merged files written, record not yet: waits
while the file named by ISO_PAUSE_FILE exists — the race tests' writer held in flight).
`ISO_FAULT_ACTION=int` sends SIGINT instead (Ctrl-C at that point), `ISO_FAULT_ACTION=enospc` raises
OSError(ENOSPC) there (a full disk at that point)."""

from __future__ import annotations

import errno
import os
import signal

# The environment is read when a point is hit, not at import: a process forked from one that imported
# this module (the tests' fork server) arms its own fault.  Counts are kept per setting, so a changed
# ISO_FAULT starts counting afresh.  ISO_FAULT_RANK=r limits the fault to the process whose RANK
# (torchrun) is r.
_COUNTS: dict[tuple[str, str], int] = {}


def hit(point: str) -> None:
    env = os.environ
    if point == "merge" and env.get("ISO_PAUSE_FILE"):
        _pause(env["ISO_PAUSE_FILE"])
    spec = env.get("ISO_FAULT")
    if not spec or spec.partition(":")[0] != point:
        return
    rank = env.get("ISO_FAULT_RANK")
    if rank is not None and rank != env.get("RANK"):
        return
    action = env.get("ISO_FAULT_ACTION", "kill")
    n = spec.partition(":")[2]
    key = (spec, action)
    _COUNTS[key] = left = _COUNTS.get(key, int(n) if n else 1) - 1
    if left == 0 and action == "enospc":  # once: the disk is full at this moment
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if left <= 0 and action != "enospc":
        os.kill(os.getpid(), signal.SIGINT if action == "int" else signal.SIGKILL)


def _pause(flag: str) -> None:
    """Announce the pause (flag + '.reached') and wait while `flag` exists (at most 10 minutes)."""
    import time

    open(flag + ".reached", "w").close()
    deadline = time.monotonic() + 600
    while os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.05)
