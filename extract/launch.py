"""Which shard and device this process takes, from the launcher that started it.

* torchrun (torch.distributed.run): RANK, WORLD_SIZE, LOCAL_RANK → each rank reads documents
  RANK+1 of WORLD_SIZE of every source (of its --shard I/N if one is given: I + N·RANK of
  N·WORLD_SIZE) on device cuda:LOCAL_RANK (CPU when there is no GPU); the ranks add their sums with
  collectives (extract/reduce.py: NCCL on GPUs, gloo on the CPU) and rank 0 alone writes and
  commits one partial per (checkpoint, source), labelled with the job's whole share (1/1, or I/N).
* Slurm job arrays: SLURM_ARRAY_TASK_ID, SLURM_ARRAY_TASK_COUNT (and SLURM_ARRAY_TASK_MIN) → shard
  ID − MIN + 1 of COUNT.  A re-submitted array with --skip-done skips the finished units.
* Otherwise one process: shard 1/1.

An explicit --shard always wins over the environment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from common.errors import UserError


@dataclass(frozen=True)
class Launch:
    shard: tuple[int, int]
    launcher: str  # single | torchrun | slurm-array | explicit
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    reads: tuple[int, int] | None = None  # the documents this process reads, where not `shard` (a torchrun rank)

    @property
    def distributed(self) -> bool:
        return self.launcher == "torchrun" and self.world_size > 1


def _int(env: dict, name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise UserError(f"environment variable {name}={env[name]!r} is not an integer") from None


def detect(shard: tuple[int, int] | None, env: dict | None = None) -> Launch:
    """The shard of this process: --shard if given, else torchrun's rank, else the Slurm array task."""
    env = os.environ if env is None else env
    if "WORLD_SIZE" in env and "RANK" in env and "LOCAL_RANK" in env:
        rank, world, local = _int(env, "RANK"), _int(env, "WORLD_SIZE"), _int(env, "LOCAL_RANK")
        if not 0 <= rank < world:
            raise UserError(f"RANK={rank} is outside WORLD_SIZE={world}")
        if world > 1:  # documents ≡ I − 1 (mod N) are those ≡ I − 1 + N·r (mod N·W) over the W ranks r
            i, n = shard or (1, 1)
            return Launch((i, n), "torchrun", rank, world, local, reads=(i + n * rank, n * world))
    if shard is not None:
        return Launch(shard, "explicit")
    if "SLURM_ARRAY_TASK_ID" in env and "SLURM_ARRAY_TASK_COUNT" in env:
        task, count = _int(env, "SLURM_ARRAY_TASK_ID"), _int(env, "SLURM_ARRAY_TASK_COUNT")
        first = _int(env, "SLURM_ARRAY_TASK_MIN") if "SLURM_ARRAY_TASK_MIN" in env else 0
        index = task - first + 1
        if not 1 <= index <= count:
            raise UserError(f"Slurm array task {task} (first {first}) is outside the array's {count} tasks; "
                            "use a contiguous --array=0-(N-1), or give --shard I/N")
        return Launch((index, count), "slurm-array")
    return Launch((1, 1), "single")


def device_for(launch: Launch, device: str | None, cuda_available: bool) -> str:
    """--device if given; under torchrun cuda:LOCAL_RANK where there is a GPU; else cuda or cpu."""
    if device is not None:
        if launch.distributed and device == "cuda":
            return f"cuda:{launch.local_rank}"
        return device
    if not cuda_available:
        return "cpu"
    return f"cuda:{launch.local_rank}" if launch.distributed else "cuda"


def reducer_for(launch: Launch, device: str, spill_dir: str | None = None):
    """The collectives of a torchrun job (extract/reduce.py), None for one process."""
    if not launch.distributed:
        return None
    from extract.reduce import Reducer

    return Reducer(launch.rank, launch.world_size, device, spill_dir)


def finish(launch: Launch, reducer=None) -> None:
    """Under torchrun: wait until rank 0 has committed (a barrier), then close the process group."""
    if not launch.distributed:
        return
    if reducer is None:
        reducer = reducer_for(launch, "cpu")
    try:
        reducer.barrier()
    finally:
        reducer.close()
