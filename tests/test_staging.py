"""The batches made ahead (extract/staging.py: Prefetch): errors reach the reader, no thread outlives
the loop, and the interpreter's switch interval is short while the thread runs and restored after."""

from __future__ import annotations

import pytest
import torch


def test_prefetch_hands_on_errors_and_stops_its_thread_when_the_reader_leaves(monkeypatch):
    """An error while making batches reaches the reader; a reader that stops early (Ctrl-C, a fault)
    leaves no thread behind, even with the producer blocked on a full queue.  While its thread runs
    the interpreter's switch interval is Prefetch.SWITCH_INTERVAL (the forward's ops do not wait 5 ms
    for the GIL after each return), and it is restored however the reader leaves."""
    import sys
    import threading

    from extract.staging import Prefetch

    default = sys.getswitchinterval()
    seen = []

    def watched():
        for i in range(3):
            seen.append(sys.getswitchinterval())
            yield (torch.full((1,), i),)

    with Prefetch(watched, "cpu", 2) as p:
        assert [int(t) for (t,) in p] == [0, 1, 2]
    assert seen == [pytest.approx(Prefetch.SWITCH_INTERVAL)] * 3 and Prefetch.SWITCH_INTERVAL < default
    assert sys.getswitchinterval() == default
    one, two = Prefetch(watched, "cpu", 2), Prefetch(watched, "cpu", 2)
    try:
        next(iter(one)), next(iter(two))  # two threads at once, closed in the order they started
        one.close()
        assert sys.getswitchinterval() == pytest.approx(Prefetch.SWITCH_INTERVAL)
    finally:
        one.close(), two.close()
    assert sys.getswitchinterval() == default
    with pytest.raises(RuntimeError, match="after close"):
        next(iter(one))  # not a reader waiting forever for a thread that was stopped
    assert sys.getswitchinterval() == default

    def no_thread(self):
        raise RuntimeError("can't start new thread")

    with monkeypatch.context() as m:
        m.setattr(threading.Thread, "start", no_thread)
        with pytest.raises(RuntimeError, match="can't start new thread"):
            with Prefetch(watched, "cpu", 2) as p:
                list(p)
    assert sys.getswitchinterval() == default
    with Prefetch(watched, "cpu", 0) as p:  # made in the loop: no thread, the interval untouched
        seen.clear()
        list(p)
    assert seen == [default] * 3

    def bad():
        yield (torch.zeros(1),)
        raise ValueError("bad source line")

    with pytest.raises(ValueError, match="bad source line"):
        with Prefetch(bad, "cpu", 2) as p:
            list(p)
    closed = threading.Event()

    def endless():
        try:
            i = 0
            while True:
                i += 1
                yield (torch.full((1,), i),)
        finally:
            closed.set()

    before = threading.active_count()
    with pytest.raises(KeyboardInterrupt):
        with Prefetch(endless, "cpu", 2) as p:
            for n, (t,) in enumerate(p):
                assert int(t) == n + 1  # in order
                if n == 5:
                    raise KeyboardInterrupt
    assert closed.wait(5) and threading.active_count() == before
    assert sys.getswitchinterval() == default
