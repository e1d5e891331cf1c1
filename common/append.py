"""Appending lines to a local file that several processes append to at once (the caches of verified
files and of weight fingerprints): one O_APPEND write per call, so racing writers' lines never
interleave, and a torn last line (a writer killed mid-write) is closed before ours starts."""

from __future__ import annotations

import os
from pathlib import Path


def append_lines(path: Path, text: bytes) -> None:
    """Append `text` (whole lines, each ending in a newline) to `path`, creating it and its folder.
    Raises OSError; the callers' caches treat a failure as a miss."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":  # a torn last line: ours starts a new one
            text = b"\n" + text
        os.write(fd, text)
    finally:
        os.close(fd)
