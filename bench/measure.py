"""Run a Python script as a child process and measure its wall time and its own peak RSS."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

# The child's own high-water mark: VmHWM belongs to the process's memory map, which exec replaces;
# ru_maxrss would also carry the parent's RSS at fork time across the exec (Linux).
_WRAPPER = ("import runpy, sys; sys.argv = sys.argv[1:]; "
            "exec(\"try:\\n runpy.run_path(sys.argv[0], run_name='__main__')\\nfinally:\\n "
            "print('RSS', [l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')][0], "
            "file=sys.stderr)\")")


def run_script(script: Path, *args: str, cwd: Path | None = None, env: dict | None = None
               ) -> tuple[float, float, subprocess.CompletedProcess]:
    """(seconds, peak RSS in GB, the completed process) of `python script args…`; the process also
    carries `cpu_seconds`, the child's user + system CPU time (all its threads).  `env`: variables
    set for the child on top of this process's environment."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", _WRAPPER, str(script), *args], capture_output=True, text=True, cwd=cwd,
                       env=None if env is None else {**os.environ, **env})
    seconds = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    r.cpu_seconds = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    rss = [int(line.split()[1]) for line in r.stderr.splitlines() if line.startswith("RSS ")]
    return seconds, (rss[0] * 1024 / 1e9 if rss else float("nan")), r
