"""Never silent for minutes: with stderr not a terminal (a log file, nohup, a notebook), train, extract and
report print plain progress lines (common/progress.py); on a terminal the tqdm bar as before."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import fork_run, run_cli
from common.progress import Lines, progress
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent


def test_train_prints_progress_lines_when_stderr_is_no_terminal(tmp_path, sources, monkeypatch):
    monkeypatch.setenv("ISO_PROGRESS_INTERVAL", "0")
    out = tmp_path / "micro"
    code, _, err = run_cli("train", "--source", f"alpha={sources['alpha']}", "--out", out, "--steps", 4,
                           "--save-every", 2, "--width", 16, "--depth", 1, "--heads", 2, "--context", 8,
                           "--vocab", 300, "--batch-size", 2)
    assert code == 0, err
    lines = [x for x in err.splitlines() if x.startswith("train micro: ")]
    step = r"train micro: (\d)/4 step \((\d+)%\), loss \d+\.\d{3}, [\d.]+ step/s \([\d.]+k? tok/s\)"
    assert [re.fullmatch(step + r", ETA \w+", x) is not None for x in lines[:-1]] == [True] * 3, lines
    assert re.fullmatch(step + r", done in \w+", lines[-1]), lines
    assert [re.match(step, x).group(1) for x in lines] == ["1", "2", "3", "4"]


def test_extract_writes_progress_lines_into_a_log_file(tmp_path, sources, model_factory):
    log = tmp_path / "log"
    env = {**os.environ, "ISO_PROGRESS_INTERVAL": "0", "PYTHONPATH": str(ROOT)}
    with open(log, "w") as f:
        done = fork_run([sys.executable, str(ROOT / "cli.py"), "extract", "--model", str(model_factory("gpt_neox")),
                         "--source", f"alpha={sources['alpha']}", "--max-tokens", "300", "--max-length", "16",
                         "--batch-size", "4", "--warehouse", str(tmp_path / "wh")],
                         stdout=subprocess.DEVNULL, stderr=f, env=env, cwd=tmp_path)
    text = log.read_text()
    assert done.returncode == 0, text
    lines = re.findall(r"^\S+@main alpha: \d+/300 tok .*$", text, re.MULTILINE)
    assert len(lines) >= 3, text  # a line per batch at interval 0, and the last
    assert all(re.search(r" tok \(\d+%\), [\d.]+k? tok/s, ETA \w+$", x) for x in lines[:-1]), lines
    assert re.search(r"^\S+ alpha: 300/300 tok \(100%\), [\d.]+k? tok/s, done in \w+$", lines[-1]), lines
    assert "\r" not in text


def test_lines_every_interval_or_ten_percent(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr("common.progress.time.monotonic", lambda: clock[0])
    f = io.StringIO()
    bar = Lines("x", total=10_000, unit="tok", file=f, every=30)
    for _ in range(99):  # 99 tokens a second: 10 % after 10.1 s, then every ~10 s; 30 s never passes first
        clock[0] += 1.0
        bar.update(99)
    bar.close()
    got = f.getvalue().splitlines()
    assert [x.split(" tok")[0] for x in got] == [f"x: {n}/10000" for n in (*range(1089, 9010, 990), 9801)], got
    f = io.StringIO()
    bar = Lines("y", total=None, unit="step", file=f, every=30)
    for _ in range(100):  # no total: a line every 30 s
        clock[0] += 1.0
        bar.update(1)
    assert [x.split(" step")[0] for x in f.getvalue().splitlines()] == ["y: 30", "y: 60", "y: 90"]


def test_a_terminal_gets_the_tqdm_bar_alone():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    f = Tty()
    bar = progress("t", total=3, unit="step", file=f, mininterval=0)
    assert isinstance(bar, tqdm)
    for _ in range(3):
        bar.update(1)
    bar.close()
    text = f.getvalue()
    assert "\r" in text and "3/3" in text and "step/s" in text
    assert text.count("\n") <= 1 and "ETA" not in text and "done in" not in text  # one bar, redrawn in place
    assert list(progress("t", iterable=[1, 2], file=f)) == [1, 2]
    assert list(progress("u", iterable=[1, 2], file=io.StringIO())) == [1, 2]


def test_a_short_step_or_a_failed_one_prints_no_done_line(monkeypatch):
    """A step shorter than a sixth of the interval that printed nothing ends silently (the command's
    own summary or one-line error follows); a failed step never says "done"."""
    clock = [0.0]
    monkeypatch.setattr("common.progress.time.monotonic", lambda: clock[0])
    f = io.StringIO()
    with Lines("short", total=100, unit="tok", file=f, every=30) as bar:
        clock[0] += 4.0
        bar.update(100)
    assert f.getvalue() == ""
    with Lines("long", total=100, unit="tok", file=f, every=30) as bar:
        clock[0] += 6.0
        bar.update(100)
    assert f.getvalue().startswith("long: 100/100 tok (100%)") and "done in" in f.getvalue()
    f = io.StringIO()
    with pytest.raises(ValueError):
        with Lines("failed", total=100, unit="tok", file=f, every=30) as bar:
            clock[0] += 60.0
            bar.update(10)
            raise ValueError("x")
    assert "done in" not in f.getvalue()
