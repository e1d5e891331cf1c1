"""The compiled token-sum kernel of cpu_kernels.py (imported only there, on first use: Numba's import and
compilation are paid only by CPU extracts).  `build(cache)` compiles `token_rows_py` with Numba, its
machine code cached on disk (beside this file, else in Numba's user cache) or not."""

from __future__ import annotations

import math

import numba
import numpy as np


def token_rows_py(h, slots, win, S, m, u, u2, inv, ok, p, pinv, minus, plus, has_prev):
    """The arithmetic of cpu_kernels.layer_sums (arguments as its call there: the rows, their slots and
    windows, the table, the window sums Σh and Σû, Σû², and per row 1/‖h‖, ok, the change's two norms
    to the previous layer's rows p · pinv where has_prev).  Returns the rows not ok.  Compiled with
    reassociated float64 sums (the norms' and the change's: vectorised); nothing else is reordered."""
    M, d = h.shape
    bad = 0
    for r in range(M):
        acc = 0.0
        for j in range(d):
            x = np.float64(h[r, j])
            acc += x * x
        norm = math.sqrt(acc)
        if not (math.isfinite(norm) and norm > 0.0):
            ok[r] = False
            inv[r] = 0.0
            bad += 1
            if has_prev:
                minus[r] = 0.0
                plus[r] = 0.0
            continue
        ok[r] = True
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
            pq = pinv[r]
            a2 = 0.0
            b2 = 0.0
            for j in range(d):
                a = np.float64(p[r, j]) * pq
                y = np.float64(h[r, j]) * q
                a2 += (y - a) * (y - a)
                b2 += (y + a) * (y + a)
            minus[r] = math.sqrt(a2)
            plus[r] = math.sqrt(b2)
    return bad


def build(cache: bool):
    """`token_rows_py` compiled (nogil: the crew's other helper runs beside it), cached on disk or not.
    Raises where Numba would not compile it (NUMBA_DISABLE_JIT: it would run as Python)."""
    if numba.config.DISABLE_JIT:
        raise RuntimeError("NUMBA_DISABLE_JIT is set (the kernel would run as Python)")
    return numba.njit(nogil=True, cache=cache, fastmath={"reassoc"})(token_rows_py)
