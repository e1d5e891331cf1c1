"""The CPU's token sums of one layer in one pass over its rows, compiled with Numba (`token_rows`).

What it adds, per counted row r (float32 rows, upcast exactly to float64): ‖h‖, û = h · (1/‖h‖), and
into float64 sums Σh and Σû of the row's window, Σû of its token type's slot in the table, Σû² per
dimension; with the previous layer's rows, ‖û_prev − û‖ and ‖û_prev + û‖ (the layer change, each the
norm of its float64 differences or sums).  A row whose norm is not finite or is zero adds nothing and
is marked not ok.  The eager path (chunk_sums.py) makes the same sums with ~15 torch
operations per chunk, each a pass over the chunk; here each row is read once, its float64 copy kept
in registers and cache, and the four sums take it in turn.  The sums are the same to ~1e-16 relative
per addition (the norms' float64 sums are taken in another order; both exact upcasts and float64).

Numba compiles on first use (~1 s) and caches the machine code beside this file (or in its user cache
where that is read-only); `warm()` starts that in the background when an extract begins, so the
forward loop does not wait for it.  Without Numba, or where it fails, `available()` is False and the
eager path runs (recorded with the run).
"""

from __future__ import annotations

import os
import threading

import numpy as np

ENV = "ISO_CPU_KERNELS"  # "off": the eager torch path (benchmarks, and a way out should Numba misbehave)

_lock = threading.Lock()
_state: dict = {}  # "fn": the compiled kernel, or "error": why there is none


def wanted() -> bool:
    """Whether the CPU's token sums may take the compiled kernel ($ISO_CPU_KERNELS not `off`)."""
    return os.environ.get(ENV, "").strip().lower() not in ("off", "0", "no", "false")


def _compile():
    from . import numba_rows  # Numba imported here: the query side and GPU runs never pay for it

    return numba_rows.token_rows


def kernel():
    """The compiled `token_rows`, or None (no Numba, it failed, or $ISO_CPU_KERNELS is off); compiled or
    loaded from the cache once per process, by whichever thread asks first."""
    if not wanted():
        return None
    with _lock:
        if "fn" not in _state and "error" not in _state:
            try:
                fn = _compile()
                _smoke(fn)
                _state["fn"] = fn
            except Exception as e:  # noqa: BLE001 — no Numba, or it cannot compile here: the eager path
                _state["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return _state.get("fn")


def error() -> str | None:
    """Why there is no kernel (after `kernel()` said None), or None."""
    return _state.get("error") or (None if wanted() else f"${ENV}=off")


def available() -> bool:
    return kernel() is not None


def warm() -> threading.Thread | None:
    """Compile or load the kernel on a background thread (an extract's start, while the model loads)."""
    if not wanted() or _state:
        return None
    t = threading.Thread(target=kernel, name="cpu-kernels", daemon=True)
    t.start()
    return t


def _smoke(fn) -> None:
    """One tiny call of every signature the token sums use (float32 rows; with and without a previous
    layer), which also compiles them."""
    d = 4
    h = np.arange(8, dtype=np.float32).reshape(2, d)
    z = np.zeros((0, d), np.float32)
    i = np.zeros(2, np.int64)
    for p in (h, z):
        S, m, u = np.zeros((1, d)), np.zeros((1, d)), np.zeros((1, d))
        fn(h, i, i, S, m, u, np.zeros(d), np.zeros(2), np.zeros(2, np.bool_), p, np.ones(2), np.zeros(2), np.zeros(2))
    if not np.allclose(m[0], h.astype(np.float64).sum(0)):
        raise RuntimeError("the compiled token sums gave a wrong sum on a known input")


def token_rows(h: np.ndarray, slots: np.ndarray, win: np.ndarray, S: np.ndarray, m: np.ndarray, u: np.ndarray,
               u2: np.ndarray, prev: np.ndarray | None = None, prev_inv: np.ndarray | None = None):
    """Add one layer's rows into the sums (in place) and return (inv (M,) 1/‖h‖ or 0, ok (M,) bool, minus,
    plus (M,) float64 the change's norms, or None without `prev`, bad: rows not ok).
    h (M, d) float32 C-contiguous; slots, win (M,) int64 each row's table row and window; S (slots, d),
    m, u (B, d) float64 Σû per slot, Σh and Σû per window; u2 (d,) float64 Σû²; prev (M, d) float32 and
    prev_inv (M,) float64: the previous layer's rows (excluded ones zero) and their 1/‖h‖ (0 where
    excluded).  Rows with zero or non-finite norms add nothing (the caller counts them)."""
    fn = kernel()
    M, d = h.shape
    inv, ok = np.empty(M), np.empty(M, np.bool_)
    if prev is None:
        p, pinv, minus, plus = np.zeros((0, d), np.float32), np.zeros(0), np.zeros(0), np.zeros(0)
    else:
        p, pinv, minus, plus = prev, prev_inv, np.empty(M), np.empty(M)
    bad = fn(h, slots, win, S, m, u, u2, inv, ok, p, pinv, minus, plus)
    return inv, ok, (minus if prev is not None else None), (plus if prev is not None else None), bad


def layer_sums(h, slots, win, n_win: int, S, prev) -> tuple:
    """chunk_sums.py's `chunk_sums` (without the row terms) through `token_rows`, torch in and out: h (M, d)
    float32 rows, slots, win (M,) int64, S (slots, d) float64 table (added into), prev: (rows, 1/‖h‖) of the
    previous layer or None.  Returns (m, u, u2, inv, ok, finite or None, (minus, plus) or None, None)."""
    import torch

    d = h.shape[1]
    m = torch.zeros(n_win, d, dtype=torch.float64)
    u = torch.zeros(n_win, d, dtype=torch.float64)
    u2 = torch.zeros(d, dtype=torch.float64)
    p = (prev[0].contiguous().numpy(), prev[1].contiguous().numpy()) if prev is not None else (None, None)
    inv, ok, minus, plus, bad = token_rows(h.contiguous().numpy(), slots.numpy(), win.numpy(), S.numpy(), m.numpy(),
                                           u.numpy(), u2.numpy(), *p)
    inv, ok = torch.from_numpy(inv), torch.from_numpy(ok)
    finite = None
    if bad:  # which of the rows left out are NaN/inf (the rest are zero vectors): rare, from their norms
        finite = torch.ones_like(ok)
        out = (~ok).nonzero().squeeze(1)
        finite[out] = torch.isfinite(torch.linalg.vector_norm(h.index_select(0, out).to(torch.float64), dim=1))
    change = (torch.from_numpy(minus), torch.from_numpy(plus)) if prev is not None else None
    return m, u, u2, inv, ok, finite, change, None
