"""Fault injection for the reliability tests: `ISO_FAULT=point[:n]` kills the process with
SIGKILL the n-th time (default 1st) execution reaches `point`.  Unset, `hit()` is one dict
lookup.  Points: read, forward, write, close, manifest, views, gc, derive."""

from __future__ import annotations

import os
import signal

_SPEC = os.environ.get("ISO_FAULT", "")
_POINT, _, _N = _SPEC.partition(":")
_COUNT = {"n": int(_N) if _N else 1}


def hit(point: str) -> None:
    if _POINT and point == _POINT:
        _COUNT["n"] -= 1
        if _COUNT["n"] <= 0:
            os.kill(os.getpid(), signal.SIGKILL)
