"""The C allocator's settings for an extract: freed memory kept for reuse instead of handed back.

glibc's malloc (Linux) serves a block above its mmap threshold (128 KiB, raised as such blocks are
freed, to at most 32 MiB) with a fresh mapping, unmapped again when freed, and hands the free top of
its heap back to the system beyond a trim threshold.  A forward allocates and frees activations of
megabytes per operation — a model's MLP activations at 4,096 tokens × 4 × d 512 are 32 MiB — so each
batch maps them again, and the kernel zeroes them page by page as the forward first writes them.
`keep_freed_memory` raises both thresholds: blocks below MMAP_THRESHOLD come from the heap and are
reused, and up to TRIM_THRESHOLD of freed memory stays resident for the next batch.  The cost is that
memory: the process's resident size stays near its peak (measured: docs/performance.md).

Only glibc is changed, and only where the user set none of its malloc settings (`GLIBC_TUNABLES`'
glibc.malloc.*, the MALLOC_*_ variables): a user's choice stays.
"""

from __future__ import annotations

import ctypes
import os

MMAP_THRESHOLD = 256 << 20  # bytes: smaller blocks come from the heap
TRIM_THRESHOLD = 1 << 30  # bytes of freed heap kept resident
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def keep_freed_memory(env=None) -> int:
    """Raise glibc's mmap and trim thresholds for this process (`mallopt`); returns the mmap threshold set:
    MMAP_THRESHOLD, or 32 MiB where this glibc refuses more (some releases cap it at half their heap
    size), or 0 where nothing was changed: not glibc, or the user set malloc's settings in `env` (the
    process's environment)."""
    env = os.environ if env is None else env
    if "glibc.malloc." in env.get("GLIBC_TUNABLES", "") or any(name in env for name in USER_SETTINGS):
        return 0
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, TypeError):  # no C library to ask, or one without mallopt
        return 0
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    threshold = next((t for t in (MMAP_THRESHOLD, 32 << 20) if mallopt(_M_MMAP_THRESHOLD, t)), 0)
    if threshold:
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    return threshold
