"""The per-layer arithmetic of the token-sum pass, as functions on tensors: the compiled GPU step
(`layer_step` under torch.compile), the eager path's per-window sums (`window_sums`), the row
terms the per-window measures need (`row_terms` and its chunked forms), computed by whichever pass
already holds the rows in float64 — so the rows are not read again — the layer-to-layer change of
each row (`change_distance`, `change_norms`, `change_sums`) and the windows' mean unit vectors
(`unit_means`).

**Precision.**  The norm is taken in float64 from the activations as they are (`dtype=` upcasts
inside the kernel) and û = h · (1/‖h‖) is formed in float64 by type promotion, so ‖û‖² = 1 to
~1e-16.  Vectors with a NaN/inf component or zero norm are counted and excluded, never summed.
The angle between a row's unit vectors at two layers is 2·atan2(‖a − b‖, ‖a + b‖), ‖a − b‖ the norm
of the float64 differences and ‖a + b‖ from it up to π/2, the norm of the float64 sums beyond
(`change_norms`): accurate to a few 1e-16 radians at any angle, where arccos of the cosine would
lose half the digits near 0 (arccos(1 − ε) ≈ √(2ε): 1.5e-8 at ε = 1e-16).
"""

from __future__ import annotations

import functools
import math

import torch


def reused(bufs: list, i: int, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A `shape` view of bufs[i], a flat buffer kept between calls and replaced by a larger one (or one of
    another dtype) when it falls short: the hot path's scratch without a fresh tensor per call, whose
    first writes would fault its pages in one by one."""
    n = math.prod(shape)
    buf = bufs[i]
    if buf is None or buf.numel() < n or buf.dtype != dtype:
        buf = bufs[i] = torch.empty(n, dtype=dtype, device=device)
    return buf[:n].view(shape)


def window_sums(h: torch.Tensor, norm: torch.Tensor, x: torch.Tensor, ok: torch.Tensor, win: torch.Tensor,
                n_win: int, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per window (B of them): Σh (B, d) and Σû (B, d) of the eager path.

    h: (M, d) the raw rows (excluded ones zero), norm: (M,) float64 ‖h‖ (0 where excluded), x:
    (M, d) float64 û (excluded rows zero), ok: (M,) 0/1, win: (M,) each row's window, cols =
    arange(M).  On the CPU both are scatter-adds onto B rows, O(M·d) whatever B is (with token
    batching B reaches hundreds of sentences; a (B, M) matrix product would grow with B·M·d); Σh
    adds h upcast exactly to float64.  On a
    GPU, where float64 atomics onto a handful of rows serialise, one float64 GEMM of a (2B, M)
    matrix of norms and 0/1 with x (the eager GPU path: --accumulator-device cpu or --sample; the
    compiled `layer_step` reduces over T instead)."""
    M, d = x.shape
    if x.device.type == "cpu":
        zeros = lambda: torch.zeros(n_win, d, dtype=torch.float64)  # noqa: E731
        return zeros().index_add_(0, win, h.to(torch.float64)), zeros().index_add_(0, win, x)
    E = torch.zeros(2 * n_win, M, dtype=torch.float64, device=x.device)  # rows: Σh, then Σû
    E[win, cols] = norm
    E[win + n_win, cols] = ok.to(torch.float64)
    mu = E @ x  # (2B, d)
    return mu[:n_win], mu[n_win:]


def unit_means(u: torch.Tensor, n_w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What random-word similarity needs of one batch's windows: u (B, d) float64 Σû per window, n_w
    (B,) the vectors counted in each.  With ū_w = Σû / n_w the window's mean unit vector (ū = û for a
    window of one vector; a window of none is left out): returns (windows with n_w ≥ 1 () int64,
    Σ_w ū_w (d,) float64, Σ_w ‖ū_w‖² () float64).  O(B·d): the window sums are made anyway."""
    has = n_w > 0  # (B,)
    ubar = u / n_w.clamp(min=1).unsqueeze(1).to(u.dtype)  # (B, d); rows of empty windows are 0 / 1 = 0
    ubar = torch.where(has.unsqueeze(1), ubar, 0.0)
    return has.sum(), ubar.sum(0), (ubar * ubar).sum()


def change_distance(prev: torch.Tensor, prev_inv: torch.Tensor, x: torch.Tensor,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """‖a − x‖ (n,) float64 of a row's unit vectors at two layers: prev (n, d) the previous layer's rows in
    their own dtype (excluded ones zero), prev_inv (n,) float64 1/‖prev‖ (0 where excluded), x (n, d)
    float64 this layer's û (0 where excluded); a = prev · prev_inv, the previous layer's û formed in
    float64 as the token sums form û.  One pass (`addcmul`: x − prev · prev_inv, into `out` (n, d)
    float64 where given) and the norm of those float64 differences: ~1e-16 relative however small."""
    return torch.linalg.vector_norm(torch.addcmul(x, prev, prev_inv.unsqueeze(-1), value=-1, out=out), dim=-1)


def change_sum_norm(prev: torch.Tensor, prev_inv: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """‖a + x‖ (n,) float64, the norm of the float64 sums (arguments as `change_distance`)."""
    return torch.linalg.vector_norm(torch.addcmul(x, prev, prev_inv.unsqueeze(-1)), dim=-1)


def opposite_norm(minus: torch.Tensor) -> torch.Tensor:
    """‖a + x‖ = √(4 − ‖a − x‖²) of unit vectors a, x, from `change_distance`'s ‖a − x‖: ~1e-16 relative
    where ‖a − x‖² ≤ 2 (an angle ≤ π/2, ‖a + x‖ ≥ √2; ‖a‖ = ‖x‖ = 1 to ~1e-16); beyond, where it
    cancels, `change_norms` takes `change_sum_norm` instead."""
    return (4.0 - minus * minus).clamp_min(0.0).sqrt()


def change_norms(prev: torch.Tensor, prev_inv: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(‖a − x‖, ‖a + x‖) (n,) float64 for `change_sums` (arguments as `change_distance`; any leading
    dims): ‖a + x‖ is `opposite_norm` where ‖a − x‖² ≤ 2, else `change_sum_norm` — both computed for
    every row here (the GPU's paths).  The CPU's chunked path gets the same values with
    `change_distance` per chunk and `change_sum_norm` only for the rows beyond π/2 (rare between
    consecutive layers)."""
    minus = change_distance(prev, prev_inv, x)
    return minus, torch.where(minus * minus > 2.0, change_sum_norm(prev, prev_inv, x), opposite_norm(minus))


def change_sums(minus: torch.Tensor, plus: torch.Tensor, pair: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer-change sums of rows `pair` (…,) bool (counted, finite and non-zero at both layers)
    from `change_norms`' (‖a − b‖, ‖a + b‖) of unit vectors a, b: (pairs () int64, Σ cos(a, b),
    Σ θ/π) float64, with cos = (‖a + b‖² − ‖a − b‖²)/4 = ⟨a, b⟩ and θ = 2·atan2(‖a − b‖, ‖a + b‖) the
    angle between them (= arccos(cos), without its loss of precision near cos = ±1)."""
    cos = (plus - minus) * (plus + minus) * 0.25  # (…,)
    theta = 2.0 * torch.atan2(minus, plus)  # (…,) radians
    return (pair.sum(), torch.where(pair, cos, 0.0).sum(),
            torch.where(pair, theta, 0.0).sum() * (1.0 / math.pi))


@functools.cache
def compiled_layer_step():
    """`layer_step` under torch.compile, one compiled function per process.  Shapes: the sizes that
    change between batches (B, T, the counted rows M, the table's slots U) are marked *unbacked* on
    every call (`run_compiled`): the graph is compiled once for any size — no 0/1 specialisation (a
    source's last batch with B = 1, a one-token window T = 1) and no duck sizing (T equal to d in
    the first batch would tie T to d) — and d, the same in every call, stays static.  With
    `dynamic=True` each of those cost a recompile and, past torch's recompile limit, torch ran
    the step eagerly without a word."""
    return torch.compile(layer_step, dynamic=None)


def run_compiled(fn, sums, counts, index, hidden, sel, counted, nxt=None, prev=None, prev_inv=None):
    """Call the compiled `layer_step`, its changing sizes marked unbacked (see `compiled_layer_step`),
    and with torch's recompile limit made an error (caught by `add`: the eager path, with a warning)
    instead of a silent fallback to eager inside torch."""
    import torch._dynamo.decorators  # loaded by torch.compile already; named here for the linters

    mark = torch._dynamo.decorators.mark_unbacked
    for t in (sums, counts, index, sel, nxt):
        if t is not None:
            mark(t, 0)
    for t in (hidden, counted, prev, prev_inv):
        if t is not None:
            mark(t, 0)
            mark(t, 1)
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        return fn(sums, counts, index, hidden, sel, counted, nxt, prev, prev_inv)


def layer_step(sums: torch.Tensor, counts: torch.Tensor, index: torch.Tensor, hidden: torch.Tensor,
               sel: torch.Tensor, counted: torch.Tensor, nxt: torch.Tensor | None = None,
               prev: torch.Tensor | None = None, prev_inv: torch.Tensor | None = None):
    """One layer of one batch, written for `torch.compile` (the GPU path): sums (U, d) float64 +=
    û of the counted positions of hidden (B, T, d) (flat positions `sel` (M,), slots `index`
    (M,)), counts += 1 per finite non-zero vector; plus the per-window sums the eager path gets
    from `window_sums`, here as plain reductions over T (no atomics on B rows).  Returns (vectors with NaN/inf, with zero norm,
    the counted finite non-zero positions (B, T) (for the moments),
    Σh per window (B, d), Σû per window (B, d), vectors per window (B,), Σû² (d,), 1/‖h‖ (B, T)
    float64 (0 where not counted, finite and non-zero: the next layer's `prev_inv`), and the
    layer-change sums of `change_sums` from the previous layer to this one (zeros without `prev`))
    as device tensors: no sync.  Compiled, the upcast, scaling and masking fuse into the reductions and the
    scatter-add, so no (B, T, d) float64 tensor is materialised; eager, it is the same arithmetic.
    With `nxt` (B·T,) (each counted position's next counted position, `--sequences`): also the
    per-window measures' `row_terms` of the counted rows (float64, masked; (M,) each).  With `prev`
    (B, T, d) and `prev_inv` (B, T): the previous layer's hidden states of the same batch and their
    `1/‖h‖` as this step returned it for that layer.

    The reductions are written in two shapes, so that a compiler that makes one kernel per shape
    (Triton: per (outputs, reduction length)) reads h in as few kernels as it can: per position, over
    d — the norm, the layer change and the row terms (the successor rows by index: neighbouring rows) — and per
    window, over T — Σh, Σû and Σû² (taken per window, then over the B windows: a reduction over
    all B·T rows at once would be a third shape, another pass over h)."""
    d = hidden.shape[-1]
    norm = torch.linalg.vector_norm(hidden, dim=-1, dtype=torch.float64)  # (B, T)
    finite = norm.isfinite()
    ok = counted & finite & (norm > 0)  # (B, T)
    inv = torch.where(ok, norm.reciprocal(), 0.0)  # (B, T)
    hm = torch.where(ok.unsqueeze(-1), hidden.to(torch.float64), 0.0)  # (B, T, d)
    x = hm * inv.unsqueeze(-1)  # (B, T, d) û, zero where not counted
    sums.index_add_(0, index, x.reshape(-1, d).index_select(0, sel))
    counts.index_add_(0, index, ok.reshape(-1).index_select(0, sel).long())
    if prev is None:
        change = (torch.zeros((), dtype=torch.int64, device=hidden.device),
                  torch.zeros((), dtype=torch.float64, device=hidden.device),
                  torch.zeros((), dtype=torch.float64, device=hidden.device))
    else:  # the same batch's positions: tell the compiler the unbacked sizes agree
        torch._check(prev.shape[0] == hidden.shape[0])
        torch._check(prev.shape[1] == hidden.shape[1])
        torch._check(prev_inv.shape[0] == hidden.shape[0])
        torch._check(prev_inv.shape[1] == hidden.shape[1])
        pm = torch.where((prev_inv > 0).unsqueeze(-1), prev, 0.0)  # (B, T, d) excluded rows zero (NaN · 0 is NaN)
        change = change_sums(*change_norms(pm, prev_inv, x), ok & (prev_inv > 0))
    out = ((counted & ~finite).sum(), (counted & finite & (norm == 0)).sum(), ok,
           hm.sum(1), x.sum(1), ok.sum(1), (x * x).sum(1).sum(0), inv, *change)
    if nxt is None:
        return out
    return out + tuple(t.index_select(0, sel) for t in row_terms(hm.reshape(-1, d), nxt))


def row_terms(x: torch.Tensor, nxt: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """What the per-window measures need of a batch's rows, in one pass over them: x (n, d) float64
    rows (zero where not counted); nxt (n,) each row's successor (a row that has none: itself, v = 0),
    or None for the next row (the last: itself).  Returns (n,) each, float64: Σ_i |x_i| and max_i |x_i|
    of each row, and with v_k = x_nxt(k) − x_k the curvature's ‖v_k‖ and ⟨v_nxt(k), v_k⟩ (0 in the
    padding rows).

    One function for every path: the CPU's token-sum pass calls it on each cache-resident float64
    chunk of rows it has just upcast (`TokenSums._add_chunked`, chunks overlapping by two rows), the
    compiled `layer_step` on the masked float64 rows it forms anyway (all B·T positions, each
    counted one's successor the next counted position: the reductions per position over d that the
    norm makes, the upcast fused into them, no float64 tensor written), and
    `WindowMeasures` on rows it is given without them.  The compiled step gives `nxt`: slicing a
    size the compiler marks unbacked fails to compile (a data-dependent guard); eager, slices (the
    same values without two gathers).  The reductions chosen are the faster ones on a CPU: max(amax,
    −amin) rather than the ∞-norm, the 2-norm of v rather than its vecdot."""
    n = x.shape[0]
    if nxt is None:
        v = torch.empty_like(x)
        torch.sub(x[1:], x[:-1], out=v[: n - 1])  # (n, d) velocities, exact for bf16/float16/float32 rows
        v[n - 1:].zero_()
        dot = torch.zeros(n, dtype=x.dtype, device=x.device)
        dot[: max(n - 2, 0)] = torch.linalg.vecdot(v[1: n - 1], v[: max(n - 2, 0)], dim=1)
    else:  # v spelled twice (xn − x, −x + xn: the same values), never indexed or shared, so that a
        # compiler computes it inside each reduction instead of writing v (n, d) to memory
        xn = x.index_select(0, nxt)  # (n, d) each row's successor
        v = xn - x
        dot = torch.linalg.vecdot(x.index_select(0, nxt.index_select(0, nxt)) - xn, x.neg() + xn, dim=1)
    return (torch.linalg.vector_norm(x, 1, dim=1), torch.maximum(x.amax(1), -x.amin(1)),
            torch.linalg.vector_norm(v, dim=1), dot)


def chunk_terms(xe: torch.Tensor, o: int, last: bool, block: int = 128) -> tuple[torch.Tensor, ...]:
    """`row_terms` of one chunk of rows, xe (o + c, d) float64: the chunk's c rows after o (0 or 2)
    rows of the previous chunk, so that the velocities and dot products across the boundary are
    computed here.  Returns the pieces that, concatenated over the chunks, are `row_terms` of all
    M rows: Σ|x|, max|x| of the c rows; ‖v‖ of the pairs from the row before the chunk's first on,
    ⟨v', v⟩ from two rows before; the chunk's own last one or two (padding) rows only in the last chunk.
    The previous chunk's rows need not be masked (a pair with an excluded row is dropped by its mask).
    Done `block` rows at a time (overlapping by two the same way), so that the velocities (block, d)
    stay in the core's cache beside the chunk."""
    n = len(xe)
    pieces = []
    for s in range(o, n, block):
        e = min(s + block, n)
        so = 2 if s > 0 else 0
        abs_sum, row_max, nv, dot = row_terms(xe[s - so:e])
        k, end = e - s + so, last and e == n
        pieces.append((abs_sum[so:], row_max[so:], nv[max(so - 1, 0): k if end else k - 1],
                       dot[: k if end else max(k - 2, 0)]))
    return tuple(torch.cat(t) for t in zip(*pieces)) if len(pieces) > 1 else pieces[0]


def rows_terms(h: torch.Tensor, ok: torch.Tensor, chunk: int = 512) -> tuple[torch.Tensor, ...]:
    """`row_terms` of rows h (M, d) in any float dtype, those not ok taken as zero, computed `chunk`
    rows at a time on a float64 copy of each chunk (cache-sized: no (M, d) float64 tensor)."""
    M = len(h)
    out = []
    for a in range(0, M, chunk):
        b = min(a + chunk, M)
        o = 2 if a > 0 else 0
        xe = h[a - o:b].to(torch.float64, copy=True)  # (o + c, d) exact upcast
        xe.masked_fill_(~ok[a - o:b].unsqueeze(1), 0)
        out.append(chunk_terms(xe, o, b == M))
    return tuple(torch.cat(t) for t in zip(*out))
