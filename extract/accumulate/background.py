"""Where the moments' (and the per-window measures') work runs off the forward's path.

Both executors take `submit(fn, *args, nbytes=)`, `wait()` and `close()`, and run the calls in the
order submitted, so the sums are added in the same order as inline — bit-identical results:

* `Worker` (a CPU): one low-priority background thread with a byte-bounded queue;
* `SideStream` (a GPU): a CUDA side stream, no host synchronisation.

**Where a CPU's moments run** (`cpu_plan`, `ISO_MOMENTS_WORKER`): `crew` (the default) — on the
crew's helper threads at each layer's hook, beside the token sums, while the forward waits (crew.py);
`thread` — on the `Worker` at nice 19, overlapping the forward, its products on `ISO_WORKER_THREADS`
intra-op threads (default 1), so the process never runs more busy OpenMP teams than it has cores
plus one idle-priority thread; `inline` — on the forward's thread, after the token sums.
"""

from __future__ import annotations

import os
import queue
import threading

import torch

from common.errors import UserError

WORKER_ENV = "ISO_MOMENTS_WORKER"  # crew | thread | inline: where a CPU's moments run (default: crew)
THREADS_ENV = "ISO_WORKER_THREADS"  # intra-op threads of the thread's worker (default 1)
PLACES = ("crew", "thread", "inline")


def cpu_plan(env=None) -> tuple[str, int]:
    """(where a CPU's moments run: crew, thread or inline; the thread's intra-op threads), from
    ISO_MOMENTS_WORKER and ISO_WORKER_THREADS.  A bad value is an error naming the variable."""
    env = os.environ if env is None else env
    where = env.get(WORKER_ENV, "crew").strip().lower() or "crew"
    if where not in PLACES:
        raise UserError(f"{WORKER_ENV}={env[WORKER_ENV]!r}: expected {', '.join(PLACES)}")
    try:
        threads = int(env.get(THREADS_ENV, "1"))
    except ValueError:
        threads = 0
    if threads < 1:
        raise UserError(f"{THREADS_ENV}={env[THREADS_ENV]!r}: expected a positive integer")
    return where, threads


class SideStream:
    """The `Worker` interface on a CUDA side stream: each call is queued on the side stream after
    the work the current stream has queued so far (so it sees the layer's hidden states), and runs
    while the forward's next kernels run — no host synchronisation; `wait` makes the current stream
    wait for it.  The inputs are marked as used by the side stream (`record_stream`), so the
    caching allocator does not hand their memory out before the side stream is done with them."""

    def __init__(self, device: torch.device):
        self._stream = torch.cuda.Stream(device)
        self.peak_bytes = 0

    def submit(self, fn, *args, nbytes: int = 0) -> None:
        main = torch.cuda.current_stream(self._stream.device)
        self._stream.wait_stream(main)
        with torch.cuda.stream(self._stream):
            fn(*args)
        for a in args:  # tensors given directly or in a tuple (a batch's indices)
            for t in (a if isinstance(a, tuple) else (a,)):
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    t.record_stream(self._stream)

    def wait(self) -> None:
        torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)

    def close(self) -> None:
        self.wait()


class Worker:
    """One background thread that runs submitted calls in order, so the sums are added in the same
    order as inline (bit-identical results).  The queued calls' tensors (`nbytes` each) stay under
    `max_bytes` — the caller blocks beyond, but a call always fits into an empty queue: memory
    stays bounded whatever the batch and model; the first error is re-raised by the next `submit`
    or `wait`.  torch releases the GIL inside its kernels, so the products run while
    the main thread drives the model.  The thread (and the OpenMP threads it starts, which inherit
    it) runs at the lowest priority, nice 19: on a CPU the forward keeps its cores and the products
    take what it leaves idle (Python between kernels, tokenising, single-threaded ops) — until the
    queue is full and the main thread waits for them (docs/views-guide.md, "Moments by default").
    Its products run on `threads` intra-op threads (the module's docstring: the thread budget)."""

    NICE = 19

    def __init__(self, max_bytes: int, threads: int = 1):
        self.threads = threads
        self._q: queue.Queue = queue.Queue()  # bounded by bytes, below
        self._max_bytes = max_bytes
        self._pending = 0  # bytes of the queued calls' tensors
        self.peak_bytes = 0
        self._room = threading.Condition()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def _loop(self) -> None:
        try:  # Linux: niceness is per thread (elsewhere this may fail: then the normal priority)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.NICE)
        except (AttributeError, OSError):
            pass
        # This thread's OpenMP team and MKL threads (per thread; torch also keeps the number as the
        # default of threads that start later — the main thread's own team is left as it is).
        torch.set_num_threads(self.threads)
        with torch.inference_mode():
            while True:
                item = self._q.get()
                if item is None:
                    self._q.task_done()
                    return
                fn, args, nbytes = item
                item = None
                try:
                    if self._error is None:
                        fn(*args)
                except BaseException as e:  # noqa: BLE001 — handed to the submitting thread
                    self._error = e
                finally:
                    args = None  # the rows are freed before room is made for more
                    with self._room:
                        self._pending -= nbytes
                        self._room.notify_all()
                    self._q.task_done()

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def submit(self, fn, *args, nbytes: int = 0) -> None:
        self._check()
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="moments", daemon=True)
            self._thread.start()
        with self._room:
            while self._pending > 0 and self._pending + nbytes > self._max_bytes:
                self._room.wait()
            self._pending += nbytes
            self.peak_bytes = max(self.peak_bytes, self._pending)
        self._q.put((fn, args, nbytes))

    def wait(self) -> None:
        if self._thread is not None:
            self._q.join()
        self._check()

    def close(self) -> None:
        if self._thread is not None:
            self._q.put(None)
            self._thread.join()
            self._thread = None
