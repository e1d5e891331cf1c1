"""A layer's token sums on a CPU with torch's eager operations, a chunk of rows at a time (`chunk_sums`).

The same float64 arithmetic as the general path of sums.py (the norm of the exact upcast, û = h · (1/‖h‖),
the same index-adds in the same row order, so Σû, Σh and the counts are bit-identical to it), done CHUNK
rows at a time in place on one float64 copy of the chunk: one upcast per row instead of three (the
norm's, the product's and Σh's type promotions each upcast all M rows) and no (M, d) float64 temporary,
so each pass reads cache instead of memory.  With the per-window measures (--sequences) their
`row_terms` are taken from the same chunks (each chunk upcast with the previous chunk's last two rows,
for the velocities across the boundary), so WindowMeasures does not read the rows again.

It runs where cpu_kernels.py's compiled pass does not: rows that are not float32, --sequences, no Numba.
"""

from __future__ import annotations

import torch

from .kernels import change_distance, change_sum_norm, chunk_terms, opposite_norm, reused


def chunk_sums(h: torch.Tensor, index: torch.Tensor, win: torch.Tensor, n_win: int, S: torch.Tensor, prev,
               chunk: int, bufs: list, terms: bool) -> tuple:
    """Add one layer's rows into S (slots, d) float64 at `index` (M,) and return the rest of its sums:
    (m, u (n_win, d) float64 Σh and Σû per window `win` (M,), u2 (d,) Σû², inv (M,) 1/‖h‖ (0 where
    excluded), ok (M,) finite and non-zero, finite (M,) or None where every row is ok, the change to the
    previous layer (‖a − x‖, ‖a + x‖) (M,) each or None, the row terms or None).  h: (M, d) the rows (not
    written: the moments read them later); prev: (rows (M, d), 1/‖h‖ (M,)) of the previous layer or None;
    bufs: two slots for the float64 chunk buffers kept between calls (`reused`: a fresh (chunk, d) tensor per
    chunk is a fresh mapping whose first writes fault page by page); terms: take the per-window measures'
    `row_terms` from the chunks."""
    M, d = h.shape
    f64 = torch.float64
    m = torch.zeros(n_win, d, dtype=f64)  # Σh per window
    u = torch.zeros(n_win, d, dtype=f64)  # Σû per window
    u2 = torch.zeros(d, dtype=f64)  # Σû² per dimension
    finites, oks, excluded = [], [], False  # per chunk: its finite rows, its finite non-zero rows (c,)
    invs, change = [], []  # per chunk: 1/‖h‖ (0 where excluded); ‖û_prev − û‖ (`change_distance`)
    up = reused(bufs, 0, (chunk + 2, d), f64, h.device)  # the upcast rows (2 more: the per-window terms)
    cb = reused(bufs, 1, (chunk, d), f64, h.device)  # the previous layer's rows, upcast
    row_terms = [] if terms else None  # per chunk: `row_terms` of its rows
    for a in range(0, M, chunk):
        b = min(a + chunk, M)
        o = 2 if row_terms is not None and a > 0 else 0  # the per-window terms: 2 rows of the previous chunk
        xe = up[: b - a + o]  # (o + c, d) exact upcast into the reused buffer, never h itself (the
        xe.copy_(h[a - o:b])  # moments read h later)
        x = xe[o:]  # (c, d) this chunk's rows
        norm = torch.linalg.vector_norm(x, dim=1)  # (c,) float64
        inv = norm.reciprocal()
        finite = torch.isfinite(norm)
        ok = finite & (norm > 0)  # (c,)
        finites.append(finite)
        oks.append(ok)
        if not bool(ok.all()):  # NaN/inf or zero vectors are zeroed out, counted by the caller (no sync to fear)
            excluded = True
            x.masked_fill_(~ok.unsqueeze(1), 0)
            inv = torch.where(ok, inv, 0.0)
        if row_terms is not None:  # the per-window measures' terms from the rows in cache (before û)
            row_terms.append(chunk_terms(xe, o, b == M))
        m.index_add_(0, win[a:b], x)
        x.mul_(inv.unsqueeze(1))  # û
        invs.append(inv)
        if prev is not None:  # the change from the previous layer's rows of the chunk, upcast exactly
            pe = cb[: b - a]  # into the second buffer (float64 throughout: the same bits as the mixed-dtype
            pe.copy_(prev[0][a:b])  # product, without its per-call float64 copy)
            change.append(change_distance(pe, prev[1][a:b], x, out=pe))
        u.index_add_(0, win[a:b], x)
        S.index_add_(0, index[a:b], x)
        u2 += x.mul_(x).sum(0)
    ok = torch.cat(oks)  # (M,)
    inv = torch.cat(invs)  # (M,)
    pair = None
    if prev is not None:  # `change_norms`' values, summed over all M rows at once as the general path does
        minus = torch.cat(change)  # (M,)
        plus = opposite_norm(minus)
        far = (minus * minus > 2.0).nonzero().squeeze(1)  # rows beyond π/2: ‖a + x‖ from their rows (an
        if len(far):  # excluded row is never one: its û is 0, ‖a − 0‖ ≤ 1)
            x = h.index_select(0, far).to(f64) * inv.index_select(0, far).unsqueeze(1)  # their û, as above
            plus[far] = change_sum_norm(prev[0].index_select(0, far), prev[1].index_select(0, far), x)
        pair = (minus, plus)
    if row_terms is not None:  # (M,) each, the chunks' pieces joined
        row_terms = tuple(torch.cat(t) for t in zip(*row_terms))
    return m, u, u2, inv, ok, torch.cat(finites) if excluded else None, pair, row_terms
