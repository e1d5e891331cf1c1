"""The CPU's token sums of one layer in one pass over its rows, compiled with Numba (`layer_sums`).

What it adds, per counted row r (float32 rows, upcast exactly to float64): ‖h‖, û = h · (1/‖h‖), and
into float64 sums Σh and Σû of the row's window, Σû of its token type's slot in the table, Σû² per
dimension; with the previous layer's rows, ‖û_prev − û‖ and ‖û_prev + û‖ (the layer change, each the
norm of its float64 differences or sums).  A row whose norm is not finite or is zero adds nothing and
is marked not ok.  The eager path (chunk_sums.py) makes the same sums with ~15 torch
operations per chunk, each a pass over the chunk; here each row is read from memory once (then from
the cache: its norm, its four sums, the change), without float64 temporaries.  The sums are the same to
~1e-16 relative per addition (the norms' float64 sums are taken in another order; both exact upcasts and
float64).

Numba compiles on first use (~1 s) and caches the machine code beside numba_rows.py (or in its user
cache where that is read-only; where no cache can be written or read, it compiles for the process
alone); `warm()` starts that in the background when an extract begins, so the forward loop does not
wait for it.  Without Numba, with NUMBA_DISABLE_JIT, or where it fails its check on a known input,
`kernel()` is None and the eager path runs (recorded with the run, with a warning).
"""

from __future__ import annotations

import math
import os
import threading

import numpy as np

from .paths import first_line

ENV = "ISO_CPU_KERNELS"  # "off": the eager torch path (benchmarks, and a way out should Numba misbehave)

_lock = threading.Lock()
_state: dict = {}  # "fn": the compiled kernel ("uncached": why not from the disk cache), or "error"


def wanted() -> bool:
    """Whether the CPU's token sums may take the compiled kernel ($ISO_CPU_KERNELS not `off`)."""
    return os.environ.get(ENV, "").strip().lower() not in ("off", "0", "no", "false")


def _build():
    """The kernel, checked on a known input: cached on disk, else (no cache to write, or a damaged one)
    compiled for this process alone.  Returns (kernel, why it is not cached or None)."""
    from . import numba_rows  # Numba imported here: the query side and GPU runs never pay for it

    try:
        fn = numba_rows.build(cache=True)
        _smoke(fn)
        return fn, None
    except Exception as e:  # noqa: BLE001 — a cache that cannot be written or read, or no JIT at all
        if "NUMBA_DISABLE_JIT" in str(e):
            raise
        why = e
    fn = numba_rows.build(cache=False)
    _smoke(fn)
    return fn, f"{type(why).__name__}: {first_line(why)}"


def _resolve() -> None:
    """Compile or load the kernel once per process (under the lock), or note why there is none."""
    with _lock:
        if "fn" in _state or "error" in _state:
            return
        try:
            _state["fn"], _state["uncached"] = _build()
        except Exception as e:  # noqa: BLE001 — no Numba, or it cannot compile here: the eager path
            _state["error"] = f"{type(e).__name__}: {first_line(e)}"


def kernel():
    """The compiled kernel (numba_rows.py), or None (no Numba, it failed, or $ISO_CPU_KERNELS is off); compiled or
    loaded from the cache once per process, by whichever thread asks first."""
    if not wanted():
        return None
    _resolve()
    return _state.get("fn")


def error() -> str | None:
    """Why there is no kernel (after `kernel()` said None), or None."""
    return _state.get("error") or (None if wanted() else f"${ENV}=off")


def uncached() -> str | None:
    """Why the kernel was compiled for this process alone (its cache could not be written or read), or None."""
    return _state.get("uncached")


def warm() -> threading.Thread | None:
    """Compile or load the kernel on a background thread (an extract's start, while the model loads)."""
    if not wanted() or _state:
        return None
    t = threading.Thread(target=_resolve, name="cpu-kernels", daemon=True)
    t.start()
    return t


def _smoke(fn) -> None:
    """One tiny call (which also compiles the one signature the token sums use), checked against sums
    known exactly: the rows, their unit vectors' squares, the change between two rows."""
    h = np.array([[3, 4, 0, 0], [0, 0, 0, 0], [0, 0, 5, 12]], np.float32)
    p = np.array([[0, 4, 3, 0], [1, 0, 0, 0], [0, 0, 5, 12]], np.float32)
    i = np.zeros(3, np.int64)
    S, m, u, u2 = np.zeros((1, 4)), np.zeros((1, 4)), np.zeros((1, 4)), np.zeros(4)
    inv, ok, minus, plus = np.zeros(3), np.zeros(3, np.bool_), np.zeros(3), np.zeros(3)
    bad = fn(h, i, i, S, m, u, u2, inv, ok, p, np.array([0.2, 1.0, 1 / 13]), minus, plus, True)
    unit = np.array([0.6, 0.8, 5 / 13, 12 / 13])
    if not (bad == 1 and ok.tolist() == [True, False, True] and np.array_equal(m[0], [3, 4, 5, 12])
            and np.allclose(S[0], unit, rtol=1e-15) and np.allclose(u2, unit ** 2, rtol=1e-15)
            and np.allclose(minus, [math.sqrt(0.72), 0, 0], atol=1e-15)
            and np.allclose(plus, [math.sqrt(3.28), 0, 2], atol=1e-15)):
        raise RuntimeError("the compiled token sums gave a wrong sum on a known input")


def layer_sums(fn, h, slots, win, n_win: int, S, prev) -> tuple:
    """chunk_sums.py's `chunk_sums` (without the row terms) through the compiled kernel `fn` (`kernel()`),
    torch in and out: h (M, d) float32 rows, slots, win (M,) int64 each row's table row and window, S (slots,
    d) float64 table (added into), prev: (rows (M, d) float32, 1/‖h‖ (M,) float64) of the previous layer or
    None.  Returns (m, u (n_win, d) Σh and Σû per window, u2 (d,) Σû², inv (M,) 1/‖h‖ or 0, ok (M,), finite
    (M,) or None where every row is ok, (‖a − x‖, ‖a + x‖) (M,) each or None, None).  Rows with zero or
    non-finite norms add nothing (the caller counts them).  Raises on slots or windows out of range, or
    previous rows of another shape (the kernel does not check its indices)."""
    import torch

    M, d = h.shape
    if M and (int(slots.min()) < 0 or int(slots.max()) >= S.shape[0] or int(win.min()) < 0
              or int(win.max()) >= n_win):
        raise ValueError(f"token sums: a slot or window out of range (table {S.shape[0]} rows, {n_win} windows)")
    if prev is not None and (prev[0].shape != h.shape or prev[1].shape != (M,) or prev[0].dtype != h.dtype):
        raise ValueError(f"token sums: the previous layer's rows {tuple(prev[0].shape)} do not match {tuple(h.shape)}")
    m = torch.zeros(n_win, d, dtype=torch.float64)
    u = torch.zeros(n_win, d, dtype=torch.float64)
    u2 = torch.zeros(d, dtype=torch.float64)
    inv, ok = np.empty(M), np.empty(M, np.bool_)
    minus, plus = (np.empty(M), np.empty(M)) if prev is not None else (np.zeros(0), np.zeros(0))
    p = (prev[0].contiguous().numpy(), prev[1].contiguous().numpy()) if prev is not None else \
        (np.zeros((0, d), np.float32), np.zeros(0))
    bad = fn(h.contiguous().numpy(), slots.numpy(), win.numpy(), S.numpy(), m.numpy(), u.numpy(), u2.numpy(), inv,
             ok, *p, minus, plus, prev is not None)
    inv, ok = torch.from_numpy(inv), torch.from_numpy(ok)
    finite = None
    if bad:  # which of the rows left out are NaN/inf (the rest are zero vectors): rare, from their norms
        finite = torch.ones_like(ok)
        out = (~ok).nonzero().squeeze(1)
        finite[out] = torch.isfinite(torch.linalg.vector_norm(h.index_select(0, out).to(torch.float64), dim=1))
    change = (torch.from_numpy(minus), torch.from_numpy(plus)) if prev is not None else None
    return m, u, u2, inv, ok, finite, change, None
