"""Host memory: what is free, and handing freed memory back to the OS (glibc / Linux; no-ops elsewhere).

Extraction of a 128k-vocabulary model on a small machine is bounded by resident memory, not by
what Python frees: glibc keeps freed chunks in its heaps and spreads threads' temporaries over
many arenas, and memory-mapped weights stay resident once read.  These helpers undo that."""

from __future__ import annotations

import ctypes
import functools
import gc
import mmap
import os
from pathlib import Path

import torch


@functools.cache
def _libc():
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None


def available_memory(device: torch.device) -> int:
    """Bytes free on `device` now (CUDA: the driver's free memory; CPU: MemAvailable)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def release_memory() -> None:
    """Collect garbage and return freed heap memory to the OS (malloc_trim): a pass over a
    128k × d matrix in chunks otherwise leaves hundreds of MB of RSS in glibc's heap."""
    gc.collect()
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def settle_imports() -> None:
    """For a process that extracts and then exits (the command line): collect once, then freeze every
    object alive so far (the imported modules: ~440k objects with torch and transformers) out of the
    garbage collector's generations, so that each `release_memory` walks only what extraction made
    instead of all of them (~0.2 s a call).  Not for a library caller's process (extract/api.py):
    cycles among objects frozen there would never be collected."""
    gc.collect()
    gc.freeze()


def limit_malloc_arenas(n: int = 2) -> None:
    """Cap glibc's heap arenas (M_ARENA_MAX): PyTorch's intra-op threads otherwise fragment the
    per-batch temporaries over up to 8 × cores arenas, each holding freed memory as RSS."""
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(-8, n)  # M_ARENA_MAX


def page_out(t: torch.Tensor) -> None:
    """Ask the kernel to reclaim the resident pages of a CPU tensor (MADV_PAGEOUT, Linux ≥ 5.4).

    Weights loaded from safetensors are file-backed memory maps: reading all of W for the
    partition function makes every page resident, though afterwards the forward touches only
    the embedding rows of the tokens seen (and never the unembedding).  Clean file pages are
    dropped and fault back in from the page cache when read; nothing is lost.  Anonymous
    memory without swap stays."""
    libc = _libc()
    if libc is None or t.device.type != "cpu" or t.numel() == 0:
        return
    page = mmap.PAGESIZE
    start = -(-t.data_ptr() // page) * page
    end = (t.data_ptr() + t.numel() * t.element_size()) // page * page
    if end > start:
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 21)  # MADV_PAGEOUT
