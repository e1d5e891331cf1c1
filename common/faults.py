"""Fault injection for the reliability tests: `ISO_FAULT=point[:n]` kills the process with
SIGKILL the n-th time (default 1st) execution reaches `point`.  Unset, `hit()` is one dict
lookup.  Points: read, forward, write, close, merge (merged files written, manifest not yet),
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

# ISO_FAULT_RANK=r limits the fault to the process whose RANK (torchrun) is r.
_RANK = os.environ.get("ISO_FAULT_RANK")
_SPEC = os.environ.get("ISO_FAULT", "") if _RANK in (None, os.environ.get("RANK")) else ""
_POINT, _, _N = _SPEC.partition(":")
_COUNT = {"n": int(_N) if _N else 1}
_ACTION = os.environ.get("ISO_FAULT_ACTION", "kill")


def hit(point: str) -> None:
    if point == "merge" and os.environ.get("ISO_PAUSE_FILE"):
        _pause(os.environ["ISO_PAUSE_FILE"])
    if _POINT and point == _POINT:
        _COUNT["n"] -= 1
        if _COUNT["n"] == 0 and _ACTION == "enospc":  # once: the disk is full at this moment
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if _COUNT["n"] <= 0 and _ACTION != "enospc":
            os.kill(os.getpid(), signal.SIGINT if _ACTION == "int" else signal.SIGKILL)


def _pause(flag: str) -> None:
    """Announce the pause (flag + '.reached') and wait while `flag` exists (at most 10 minutes)."""
    import time

    open(flag + ".reached", "w").close()
    deadline = time.monotonic() + 600
    while os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.05)
