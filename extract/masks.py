"""transformers' mask code, answered from the host: a batch's forward without a host synchronisation.

Before building a mask, transformers' `masking_utils` asks questions of device tensors whose answers are
known on the host for every batch this tool runs (no cache, no position ids passed, one window per row).
On a GPU each question is a host sync that drains the device's queue before the batch:

* a batch with padding: may the 2-D mask be dropped? (`_ignore_causal_mask_sdpa`,
  `_ignore_bidirectional_mask_sdpa` read `fast_all(padding_mask)`, `padding_mask.all()`.)  Never, for a
  batch that holds padding and runs without a cache (the key length is the query length): both answer
  False for it.
* a batch without padding goes in with no mask (extract/run/stream.py); transformers then asks whether
  the model's own position ids pack several sequences into a row (`find_packed_sequence_indices` reads
  `(mask[:, -1] == 0).all()`).  They never do: the model builds them as 0 … T-1 in every row, and the
  function answers None for that.

`known_batch(padded)` gives those answers without reading the device while the batch's forward runs;
transformers then builds the same mask as before (bit-identical hidden states: tests/test_gpu_path.py).
A transformers without these functions is left as it is (the sync stays; nothing else changes).  The
functions are module globals: while one of our forwards runs, another thread's forward gets the same
answers — a packed or padded-with-cache batch wrong ones, and an unpadded batch beside one of our padded
ones an explicit mask instead of the causal flag (the same values, possibly another attention kernel).
The CLI runs its forwards on one thread; an API user extracting from several threads at once shares this.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

_PADDED = ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa")
_UNPACKED = ("find_packed_sequence_indices",)
_lock = threading.Lock()
_depth: dict[str, int] = {}
_saved: dict = {}


def _never(*args, **kwargs) -> bool:
    """A padded batch without a cache: the mask is never dropped (what the originals answer for it)."""
    return False


def _unpacked(*args, **kwargs) -> None:
    """Position ids 0 … T-1 in every row: no packed sequences (what the original answers for them)."""
    return None


@contextlib.contextmanager
def _answered(module, names: tuple[str, ...], answer) -> Iterator[None]:
    """`module.NAME` for each of `names` returns `answer`'s value while inside; re-entrant and
    thread-safe (the originals come back when the last user leaves)."""
    names = tuple(n for n in names if hasattr(module, n))
    with _lock:
        for name in names:
            if _depth.get(name, 0) == 0:
                _saved[name] = getattr(module, name)
                setattr(module, name, answer)
            _depth[name] = _depth.get(name, 0) + 1
    try:
        yield
    finally:
        with _lock:
            for name in names:
                _depth[name] -= 1
                if _depth[name] == 0:
                    setattr(module, name, _saved.pop(name))


@contextlib.contextmanager
def known_batch(padded: bool) -> Iterator[None]:
    """While the forward of one of our batches runs (no cache, no position ids passed): transformers'
    questions about its mask (`padded`: it holds padding and goes in with its 2-D mask) or its position
    ids (not `padded`: it goes in without a mask) answered from the host."""
    try:
        from transformers import masking_utils
    except ImportError:  # no masking_utils in this transformers: nothing to answer
        yield
        return
    with _answered(masking_utils, _PADDED if padded else _UNPACKED, _never if padded else _unpacked):
        yield
