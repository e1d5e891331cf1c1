"""The compiled token-sum kernel of cpu_kernels.py, at module level so that Numba caches its machine code
(imported only there, on first use: Numba's import and compilation are paid only by CPU extracts)."""

from __future__ import annotations

import math

import numpy as np
from numba import njit


@njit(nogil=True, cache=True, fastmath={"reassoc"})
def sum_sq(h, r, d):
    """Σ_j h[r, j]² in float64 (reassociated: vectorised)."""
    acc = 0.0
    for j in range(d):
        x = np.float64(h[r, j])
        acc += x * x
    return acc


@njit(nogil=True, cache=True, fastmath={"reassoc"})
def change(h, r, inv, p, pinv, d):
    """(‖a − x‖², ‖a + x‖²) in float64 for row r: x = h[r] · inv, a = p[r] · pinv."""
    minus = 0.0
    plus = 0.0
    for j in range(d):
        a = np.float64(p[r, j]) * pinv
        x = np.float64(h[r, j]) * inv
        minus += (x - a) * (x - a)
        plus += (x + a) * (x + a)
    return minus, plus


@njit(nogil=True, cache=True)
def token_rows(h, slots, win, S, m, u, u2, inv, ok, p, pinv, minus, plus):
    """cpu_kernels.token_rows's arithmetic (arguments as there; p of 0 rows: no previous layer).
    Returns the rows not ok."""
    M, d = h.shape
    has_prev = p.shape[0] == M
    bad = 0
    for r in range(M):
        norm = math.sqrt(sum_sq(h, r, d))
        good = math.isfinite(norm) and norm > 0.0
        ok[r] = good
        if not good:
            inv[r] = 0.0
            bad += 1
            if has_prev:
                minus[r] = 0.0
                plus[r] = 0.0
            continue
        q = 1.0 / norm
        inv[r] = q
        w = win[r]
        s = slots[r]
        for j in range(d):
            x = np.float64(h[r, j])
            m[w, j] += x
            y = x * q
            u[w, j] += y
            S[s, j] += y
            u2[j] += y * y
        if has_prev:
            a, b = change(h, r, q, p, pinv[r], d)
            minus[r] = math.sqrt(a)
            plus[r] = math.sqrt(b)
    return bad
