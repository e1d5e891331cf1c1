"""The CPU's crew: helper threads, one per core, that share a layer's accumulation while the forward waits.

At each layer's hook the forward is paused, so every core is free: the layer's token sums and the
moments' chunk copies and panel products are handed to the crew as tasks (`Task`), each helper
running one task at a time on one intra-op thread (a task may ask for more: on a CPU with more cores
than the moments have tasks, the token sums take the rest).  Independent single-threaded tasks keep both kinds
of work on every core at once, where a background thread beside the forward's own OpenMP team would
stall that team (docs/cost-model.md, "The CPU's thread budget").  For the forward's idle OpenMP
threads to give their cores up quickly, they must not spin long after a parallel region
(common/openmp.py sets that before torch loads).

`run(tasks)` returns when every task is done, re-raising the first error (the tasks after it are
skipped).  A task starts once the tasks it names in `after` are done, in list order otherwise (the
longest first is the caller's choice).  Each task's arithmetic does not depend on which helper runs
it, so the sums are bit-identical to running the same tasks in order on one thread of the caller's
(with one intra-op thread per task: the token sums' own float64 reductions may split by threads).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

WAITING, RUNNING, DONE = 0, 1, 2


@dataclass(eq=False)
class Task:
    """A call the crew runs once, after the tasks in `after`, on `threads` intra-op threads."""

    fn: Callable[[], None]
    after: tuple["Task", ...] = field(default_factory=tuple)
    threads: int = 1


class Crew:
    """`size` helper threads (started on first use), each with one intra-op thread, in the caller's
    grad and inference modes (tensors made by a task are what the caller's thread would make)."""

    def __init__(self, size: int):
        self.size = size
        self._cv = threading.Condition()
        self._tasks: list[Task] = []
        self._state: dict[Task, int] = {}
        self._modes = (False, True)  # (grad enabled, inference mode) of the current `run`'s caller
        self._error: BaseException | None = None
        self._threads: list[threading.Thread] = []
        self._closed = False

    def run(self, tasks: list[Task]) -> None:
        """Run every task on the helpers and wait for them all."""
        if not tasks:
            return
        if not self._threads:
            self._closed = False
            self._threads = [threading.Thread(target=self._loop, name=f"crew-{i}", daemon=True)
                             for i in range(self.size)]
            for t in self._threads:
                t.start()
        with self._cv:
            self._tasks = list(tasks)
            self._state = {t: WAITING for t in self._tasks}
            self._modes = (torch.is_grad_enabled(), torch.is_inference_mode_enabled())
            self._error = None
            self._cv.notify_all()
            while any(s != DONE for s in self._state.values()):
                self._cv.wait()
            error, self._error, self._tasks = self._error, None, []
        if error is not None:
            raise error

    def _next(self) -> Task | None:
        """The first waiting task whose `after` are done (under the lock)."""
        for task in self._tasks:
            if self._state[task] == WAITING and all(self._state.get(t, DONE) == DONE for t in task.after):
                self._state[task] = RUNNING
                return task
        return None

    def _loop(self) -> None:
        torch.set_num_threads(1)  # this thread's intra-op threads (the caller's own team is left as it is)
        while True:
            with self._cv:
                while (task := self._next()) is None:
                    if self._closed:
                        return
                    self._cv.wait()
                grad, inference = self._modes
            error = None
            try:
                if task.threads != 1:
                    torch.set_num_threads(task.threads)
                with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                    task.fn()
            except BaseException as e:  # noqa: BLE001 — handed to the caller of `run`
                error = e
            finally:
                if task.threads != 1:
                    torch.set_num_threads(1)
            with self._cv:
                self._state[task] = DONE
                if error is not None and self._error is None:
                    self._error = error
                    for t, s in self._state.items():  # the tasks not started are skipped
                        if s == WAITING:
                            self._state[t] = DONE
                self._cv.notify_all()

    def close(self) -> None:
        """Stop the helpers once their current tasks end (idempotent); tasks not started are dropped (a
        caller interrupted inside `run` leaves some)."""
        with self._cv:
            self._closed = True
            for t, s in self._state.items():
                if s == WAITING:
                    self._state[t] = DONE
            self._cv.notify_all()
        for t in self._threads:
            t.join()
        self._threads = []
