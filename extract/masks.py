"""The attention mask of a padded batch, without a host synchronisation.

transformers' mask code (`masking_utils`) first asks whether a 2-D padding mask may be dropped —
`_ignore_causal_mask_sdpa` / `_ignore_bidirectional_mask_sdpa`, which read the device mask's values
(`fast_all(padding_mask)`, `padding_mask.all()`) into a Python bool: on a GPU a host sync that drains
the device's queue before every padded batch.  The answer is known on the host: a batch that holds
padding, run without a cache (the key length is the query length), can never drop its mask — both
functions return False for it.  `known_padding()` makes them return False without reading the device
while the forward of such a batch runs; transformers then builds the same 4-D mask as before from the
same 2-D mask (bit-identical hidden states: tests/test_gpu_path.py).  Batches without padding go in
with no mask at all (extract/run/stream.py), so neither function reads anything.  A transformers
without these functions is left as it is (the sync stays; nothing else changes).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

_NAMES = ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa")
_lock = threading.Lock()
_depth = 0
_saved: dict = {}


def _never(*args, **kwargs) -> bool:
    """A padded batch without a cache: the mask is never dropped (what the originals answer for it)."""
    return False


@contextlib.contextmanager
def known_padding() -> Iterator[None]:
    """While the forward of a batch that holds padding runs (no cache): transformers' checks whether
    its mask may be dropped answer False from the host.  Re-entrant and thread-safe; restores them."""
    global _depth
    try:
        from transformers import masking_utils
    except ImportError:  # no masking_utils in this transformers: nothing to patch
        yield
        return
    with _lock:
        if _depth == 0:
            _saved.clear()
            for name in _NAMES:
                if hasattr(masking_utils, name):
                    _saved[name] = getattr(masking_utils, name)
                    setattr(masking_utils, name, _never)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                for name, fn in _saved.items():
                    setattr(masking_utils, name, fn)
                _saved.clear()
