"""Progress of long steps (train, extract, report): a tqdm bar on a terminal, plain lines otherwise.

A notebook cell, `nohup`, `> log 2>&1` or a Slurm log has no terminal on stderr, where tqdm's bar is
off (`disable=None`) and a long run would say nothing for minutes.  There `progress()` prints one plain
line every ISO_PROGRESS_INTERVAL seconds (default 30) or every 10 % of a known total, whichever comes
first (but not within a sixth of the interval of the last line), and one when it ends — if it printed a
line before or took at least a sixth of the interval (a step of a second says nothing: the command's
own summary follows):

    train micro-tied: 120/600 step (20%), loss 3.412, 4.1 step/s (8.4k tok/s), ETA 1m57s
    minilm@main stdlib-docs: 40.0k/100k tok (40%), 12.3k tok/s, ETA 5s
"""

from __future__ import annotations

import os
import sys
import time

from tqdm import tqdm

DEFAULT_INTERVAL = 30.0
PERCENT_STEP = 10  # a line at every 10 % of a known total


def interval() -> float:
    """Seconds between plain lines: ISO_PROGRESS_INTERVAL (0: a line at every update), default 30."""
    try:
        return max(0.0, float(os.environ.get("ISO_PROGRESS_INTERVAL", DEFAULT_INTERVAL)))
    except ValueError:
        return DEFAULT_INTERVAL


def _is_tty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _amount(x: float, scale: bool) -> str:
    if not scale:
        return f"{x:g}" if x != int(x) else f"{int(x)}"
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.1f}{suffix}"
    return f"{int(x)}" if x == int(x) else f"{x:.1f}"


def _duration(s: float) -> str:
    s = int(round(s))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s" if m else f"{sec}s"


class Lines:
    """tqdm's update/set_postfix/close, written as plain lines (see the module's docstring)."""

    def __init__(self, desc: str, total: float | None = None, unit: str = "it", unit_scale: bool = False,
                 file=None, every: float | None = None, per_unit: tuple[float, str] | None = None):
        self.desc, self.total, self.unit, self.scale = desc, total, unit, unit_scale
        self.per_unit = per_unit  # (k, "tok"): also the rate in k tok per unit
        self.file = file if file is not None else sys.stderr
        self.every = interval() if every is None else every
        self.n = 0
        self.postfix = ""
        self.start = self.last = time.monotonic()
        self.last_step = 0  # the last PERCENT_STEP multiple printed
        self.printed = False
        self.closed = False

    def set_postfix(self, refresh: bool = True, **kw) -> None:
        self.postfix = ", ".join(f"{k} {v}" for k, v in kw.items())

    def line(self, done: bool = False) -> str:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        rate = self.n / elapsed
        head = _amount(self.n, self.scale)
        if self.total:
            head += f"/{_amount(self.total, self.scale)} {self.unit} ({100 * self.n / self.total:.0f}%)"
        else:
            head += f" {self.unit}"
        speed = (_amount(rate, True) if self.scale else f"{rate:.2f}" if rate < 100 else f"{rate:.0f}") + f" {self.unit}/s"
        if self.per_unit:
            speed += f" ({_amount(rate * self.per_unit[0], True)} {self.per_unit[1]}/s)"
        parts = [head] + ([self.postfix] if self.postfix else []) + [speed]
        if done:
            parts.append(f"done in {_duration(elapsed)}")
        elif self.total and rate > 0 and self.n < self.total:
            parts.append(f"ETA {_duration((self.total - self.n) / rate)}")
        return f"{self.desc}: " + ", ".join(parts)

    def _print(self, done: bool = False) -> None:
        print(self.line(done), file=self.file, flush=True)
        self.last = time.monotonic()
        self.printed = True

    def update(self, n: float = 1) -> None:
        self.n += n
        step = int(100 * self.n / self.total) // PERCENT_STEP if self.total else 0
        if self.total and self.n >= self.total:
            return  # the last line is close()'s
        since = time.monotonic() - self.last
        if since >= self.every or (step > self.last_step and since >= self.every / 6):  # 10 % steps: ≤ 1 line / 5 s
            self.last_step = max(self.last_step, step)
            self._print()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.printed or time.monotonic() - self.start >= self.every / 6:
                self._print(done=True)

    def wrap(self, iterable):
        """tqdm(iterable): yields its items, counting each; the last line when it is exhausted."""
        for item in iterable:
            yield item
            self.update(1)
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, kind, *exc) -> None:
        if kind is None:
            self.close()
        else:  # the step failed: its error says so, not a "done" line
            self.closed = True


def progress(desc: str, total: float | None = None, unit: str = "it", unit_scale: bool = False, file=None,
             per_unit: tuple[float, str] | None = None, iterable=None, **tqdm_kw):
    """A tqdm bar when `file` (default stderr) is a terminal (tqdm_kw: its options), else `Lines`: the same
    update/set_postfix/close; with `iterable`, an iterator over it as tqdm(iterable).  per_unit=(k, "tok"):
    the lines also give the rate in tok/s (k tok per unit)."""
    file = file if file is not None else sys.stderr
    if _is_tty(file):
        return tqdm(iterable, desc=desc, total=total, unit=unit, unit_scale=unit_scale, file=file, **tqdm_kw)
    if iterable is not None and total is None and hasattr(iterable, "__len__"):
        total = len(iterable)
    lines = Lines(desc, total, unit, unit_scale, file, per_unit=per_unit)
    return lines if iterable is None else lines.wrap(iterable)
