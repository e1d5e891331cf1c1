"""Batches made ahead of the forward: tokenising, windowing and packing run on a background thread
that stays at most a few batches ahead (a bounded queue), so the device never waits for the
tokenizer; on CUDA each batch's host tensors are staged in pinned (page-locked) memory, so the
`non_blocking` copies to the device really are asynchronous (a copy from pageable memory makes the
host wait for it).  The batches come out in the order the generator makes them: the sums are the
same, bit for bit, as in the calling thread (tests/test_gpu_path.py).

Shutdown: the thread is a daemon and never outlives the loop that reads it — leaving the loop for
any reason (end, error, Ctrl-C's KeyboardInterrupt, a fault) sets a stop flag, drains the queue and
joins the thread (it checks the flag between batches and while waiting for room), so no thread is
left tokenising when the interpreter exits.  An error in the thread is re-raised in the reader.

The GIL: the thread's work is mostly Python holding the GIL (sentence splitting, windowing), while
the forward releases it inside every torch op and must take it back when the op returns — after up
to the interpreter's switch interval (5 ms by default) of the thread's Python: a convoy in which each
of the forward's ops waits for the tokeniser.  While the thread runs, the switch interval is
SWITCH_INTERVAL (restored when the last one closes), so the thread gives the GIL back within ~0.1 ms
(the worst case, a thread that never pauses, measured: bench/bench_gil_convoy.py --busy)."""

from __future__ import annotations

import queue
import sys
import threading
from typing import Iterator

import torch

_DONE = object()
_GIL = {"holders": 0, "saved": 0.0}  # prefetch threads running, the switch interval before the first
_GIL_LOCK = threading.Lock()


def _responsive_gil(change: int, interval: float) -> None:
    """The first running Prefetch thread shortens the interpreter's switch interval, the last one
    to close restores it (in whatever order several close)."""
    with _GIL_LOCK:
        if _GIL["holders"] == 0 and change > 0:
            _GIL["saved"] = sys.getswitchinterval()
            sys.setswitchinterval(min(_GIL["saved"], interval))
        _GIL["holders"] += change
        if _GIL["holders"] == 0 and change < 0:
            sys.setswitchinterval(_GIL["saved"])


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


def stage(batch: tuple, device: torch.device | str) -> tuple:
    """The batch's host tensors in pinned memory where the device is CUDA (else as they are).  Pinned
    blocks come from torch's caching host allocator, which reuses a block only after the copies that
    read it have finished: the host may drop the batch right after queuing its copies."""
    if torch.device(device).type != "cuda":
        return batch
    return tuple(t.pin_memory() if isinstance(t, torch.Tensor) else t for t in batch)


class Prefetch:
    """Iterate `make()`'s batches, made by a background thread at most `ahead` batches ahead and
    staged for `device`.  Use as a context manager (or call `close`) so the thread is always joined.
    ahead = 0: made in the calling thread (the old behaviour)."""

    JOIN_SECONDS = 10.0  # at close: how long to wait for a thread busy inside one tokenizer call
    SWITCH_INTERVAL = 1e-4  # seconds of Python a thread runs before another waiting for the GIL gets it

    def __init__(self, make, device: torch.device | str, ahead: int = 4):
        self._make, self._device, self._ahead = make, device, ahead
        self._stop = threading.Event()
        self._q: queue.Queue = queue.Queue(maxsize=max(ahead, 1))
        self._thread: threading.Thread | None = None
        self._responsive = False  # whether this instance holds the short switch interval

    def __enter__(self) -> "Prefetch":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __iter__(self) -> Iterator[tuple]:
        if self._ahead <= 0:
            for batch in self._make():
                yield stage(batch, self._device)
            return
        if self._stop.is_set():
            raise RuntimeError("Prefetch iterated after close()")
        self._thread = threading.Thread(target=self._produce, name="batches", daemon=True)
        if not self._responsive:
            _responsive_gil(+1, self.SWITCH_INTERVAL)
            self._responsive = True
        try:
            self._thread.start()
        except BaseException:
            self._thread = None  # (close() must not join a thread that never started)
            self.close()
            raise
        while True:
            item = self._q.get()
            if item is _DONE:
                return
            if isinstance(item, _Failed):
                raise item.error
            yield item

    def _put(self, item) -> bool:
        """Queue `item`, waiting for room while the reader runs; False once the reader has stopped."""
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self) -> None:
        gen = None
        try:
            gen = self._make()
            for batch in gen:
                if not self._put(stage(batch, self._device)):
                    return
            self._put(_DONE)
        except BaseException as e:  # noqa: BLE001 — handed to the reader
            self._put(_Failed(e))
        finally:
            if gen is not None and hasattr(gen, "close"):
                gen.close()  # the generator's own cleanup (open files) runs in its thread

    def close(self) -> None:
        """Stop the thread and wait for it (idempotent); the switch interval is given back even if
        the wait is interrupted."""
        self._stop.set()
        try:
            if self._thread is not None:
                while True:  # room for a put that is waiting, so the thread sees the flag at once
                    try:
                        self._q.get_nowait()
                    except queue.Empty:
                        break
                self._thread.join(self.JOIN_SECONDS)
        finally:
            self._thread = None
            if self._responsive:
                self._responsive = False
                _responsive_gil(-1, self.SWITCH_INTERVAL)
