"""The code paths an accumulator takes (`paths`: recorded with each source's stats and shown by
`doctor`), and the one-line warning when it has to take a slower one."""

from __future__ import annotations

import warnings


def slow_path(paths: dict, key: str, value: str, message: str) -> None:
    """Record that `key` takes the slower path `value` (kept with the run's stats) and say so once, in one
    line (a RuntimeWarning: the CLI prints it, a test can catch it)."""
    if paths.get(key) == value:
        return
    paths[key] = value
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def first_line(e: BaseException) -> str:
    """An error's first line, at most 200 characters (for a one-line warning)."""
    text = str(e).strip().splitlines()
    return text[0][:200] if text else ""
