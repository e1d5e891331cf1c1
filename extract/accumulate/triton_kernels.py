"""The Triton kernels of fused.py (its docstring says what each one does and why) and of gram.py (the
bf16 moments' products), imported by them on first use.  Under TRITON_INTERPRET=1 (set before Triton
is imported) they run in Triton's interpreter on CPU tensors: that is how the tests run them without a
GPU."""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["P", "stride", "pstride"])
def norms_kernel(h, stride, dest, inv, counts, P, prev, pstride, pinv, minus_out, plus_out, change_n, change_cos,
                 D: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr, CHANGE: tl.constexpr):
    p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)  # (BLOCK_P,) positions
    pm = p < P
    row = p.to(tl.int64) * stride
    acc = tl.zeros([BLOCK_P], dtype=tl.float64)
    for d0 in range(0, D, BLOCK_D):
        c = d0 + tl.arange(0, BLOCK_D)
        x = tl.load(h + row[:, None] + c[None, :], mask=pm[:, None] & (c[None, :] < D), other=0.0)
        x = x.to(tl.float64)
        acc += tl.sum(x * x, axis=1)
    norm = tl.sqrt(acc)
    counted = pm & (tl.load(dest + p, mask=pm, other=-1) >= 0)
    finite = (norm - norm) == 0.0  # False for NaN and inf
    ok = counted & finite & (norm > 0.0)
    iv = tl.where(ok, 1.0 / tl.where(ok, norm, 1.0), 0.0)  # (BLOCK_P,) 1/‖h‖, 0 where excluded
    tl.store(inv + p, iv, mask=pm)
    tl.atomic_add(counts, tl.sum((counted & ~finite).to(tl.int64), axis=0))
    tl.atomic_add(counts + 1, tl.sum((counted & finite & (norm == 0.0)).to(tl.int64), axis=0))
    if CHANGE:  # the change from the previous layer: a = prev · (1/‖prev‖), x = û, both float64
        pv = tl.load(pinv + p, mask=pm, other=0.0)  # (BLOCK_P,) 0 where excluded there
        prow = p.to(tl.int64) * pstride
        dm = tl.zeros([BLOCK_P], dtype=tl.float64)  # ‖x − a‖²
        dp = tl.zeros([BLOCK_P], dtype=tl.float64)  # ‖x + a‖²
        for d0 in range(0, D, BLOCK_D):  # h's rows again (just read: in cache), the previous layer's once
            c = d0 + tl.arange(0, BLOCK_D)
            mk = pm[:, None] & (c[None, :] < D)
            x = tl.load(h + row[:, None] + c[None, :], mask=mk, other=0.0).to(tl.float64) * iv[:, None]
            a = tl.load(prev + prow[:, None] + c[None, :], mask=mk, other=0.0).to(tl.float64) * pv[:, None]
            dm += tl.sum((x - a) * (x - a), axis=1)
            dp += tl.sum((x + a) * (x + a), axis=1)
        pair = ok & (pv > 0.0)  # rows excluded at either layer (NaN · 0 included) are dropped here
        minus = tl.sqrt(dm)
        plus = tl.where(minus * minus > 2.0, tl.sqrt(dp), tl.sqrt(tl.maximum(4.0 - minus * minus, 0.0)))
        cos = (plus - minus) * (plus + minus) * 0.25
        tl.store(minus_out + p, tl.where(pair, minus, 0.0), mask=pm)  # atan2(0, 1) = 0 for the rows not paired
        tl.store(plus_out + p, tl.where(pair, plus, 1.0), mask=pm)
        tl.atomic_add(change_n, tl.sum(pair.to(tl.int64), axis=0))
        tl.atomic_add(change_cos, tl.sum(tl.where(pair, cos, 0.0), axis=0))


@triton.jit(do_not_specialize=["T", "stride"])
def windows_kernel(h, stride, inv, dest, rows, ok_rows, m, u, u2, nw, T, D: tl.constexpr, WRITE: tl.constexpr,
                   T_TILES: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    j = tl.program_id(1)
    c = j * BLOCK_D + tl.arange(0, BLOCK_D)
    cm = c < D
    am = tl.zeros([BLOCK_D], dtype=tl.float64)
    au = tl.zeros([BLOCK_D], dtype=tl.float64)
    a2 = tl.zeros([BLOCK_D], dtype=tl.float64)
    n = tl.zeros([BLOCK_T], dtype=tl.int64)
    for k in range(T_TILES):  # a power of 2 ≥ T / BLOCK_T: a few compiled variants whatever T is
        t = k * BLOCK_T + tl.arange(0, BLOCK_T)
        tm = t < T
        p = b.to(tl.int64) * T + t
        iv = tl.load(inv + p, mask=tm, other=0.0)
        ok = iv > 0.0
        x = tl.load(h + p[:, None] * stride + c[None, :], mask=tm[:, None] & cm[None, :], other=0.0)
        hm = tl.where(ok[:, None], x.to(tl.float64), 0.0)
        xu = hm * iv[:, None]
        am += tl.sum(hm, axis=0)
        au += tl.sum(xu, axis=0)
        a2 += tl.sum(xu * xu, axis=0)
        n += ok.to(tl.int64)
        if WRITE:
            dd = tl.load(dest + p, mask=tm, other=-1)
            wm = dd >= 0
            tl.store(rows + dd[:, None] * D + c[None, :], tl.where(ok[:, None], x, 0.0),
                     mask=wm[:, None] & cm[None, :])
            if j == 0:
                tl.store(ok_rows + dd, ok.to(tl.int8), mask=wm)
    out = b.to(tl.int64) * D + c
    tl.store(m + out, am, mask=cm)
    tl.store(u + out, au, mask=cm)
    tl.store(u2 + out, a2, mask=cm)
    if j == 0:
        tl.store(nw + b, tl.sum(n, axis=0))


@triton.jit
def _run_sum(a, a_first, b, b_first):
    """The combine of a segmented sum (a before b): b alone where b begins a run, else a + b."""
    return tl.where(b_first != 0, b, a + b), a_first | b_first


@triton.jit(do_not_specialize=["M", "stride"])
def slots_kernel(h, stride, inv, order, slot, sums, counts, M, D: tl.constexpr, R: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    i = tl.arange(0, R)
    r = tl.program_id(0) * R + i  # (R,) rows of the slot-sorted order
    j = tl.program_id(1)
    rm = r < M
    s = tl.load(slot + r, mask=rm, other=-1)
    start = s != tl.load(slot + r - 1, mask=rm & (r > 0), other=-2)  # a run's first row
    end = s != tl.load(slot + r + 1, mask=(r + 1) < M, other=-3)  # a run's last row
    first = start | (i == 0)  # a run's first row in this block
    last = rm & (end | (i == R - 1))  # a run's last row in this block: where its sum is added
    run = tl.cumsum(first.to(tl.int32), axis=0)  # (R,) which run of the block each row is in
    same = run[:, None] == run[None, :]  # (R, R) rows of one run
    began = tl.sum(tl.where(same & (first & start)[None, :], 1, 0), axis=1) > 0  # the run began in this block
    own = last & end & began  # the whole run is in this block: no other program touches it
    shared = last & ~own
    pos = tl.load(order + r, mask=rm, other=0)
    iv = tl.load(inv + pos, mask=rm, other=0.0)
    ok = iv > 0.0
    c = j * BLOCK_D + tl.arange(0, BLOCK_D)
    cm = c < D
    x = tl.load(h + pos[:, None] * stride + c[None, :], mask=rm[:, None] & cm[None, :], other=0.0)
    x = tl.where(ok[:, None], x.to(tl.float64) * iv[:, None], 0.0)  # (R, BLOCK_D) û
    # each row: the sum of its run's rows up to it (a segmented scan over the block, float64 adds in
    # registers); at a run's last row in the block, the run's total there
    f = tl.broadcast_to(first[:, None], (R, BLOCK_D)).to(tl.int32)  # (R, BLOCK_D) 1 where a run starts
    v, _ = tl.associative_scan((x, f), 0, _run_sum)
    ptr = sums + s[:, None].to(tl.int64) * D + c[None, :]
    mo = own[:, None] & cm[None, :]
    tl.store(ptr, tl.load(ptr, mask=mo, other=0.0) + v, mask=mo)
    tl.atomic_add(ptr, v, mask=shared[:, None] & cm[None, :])
    if j == 0:
        k = tl.sum(tl.where(same & ok[None, :], 1, 0).to(tl.int64), axis=1)  # (R,) vectors counted per run
        tl.store(counts + s, tl.load(counts + s, mask=own, other=0) + k, mask=own)
        tl.atomic_add(counts + s, k, mask=shared)


@triton.jit(do_not_specialize=["B"])
def epilogue_kernel(m, u, u2, nw, B, D: tl.constexpr, s_out, counts, sum_h, sum_u2, nonfinite, zero, windows,
                    window_cos, unit_windows, sum_ubar, sum_ubar_sq, N_COLS: tl.constexpr, B_TILES: tl.constexpr,
                    BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    if pid < N_COLS:  # a column block: sums over the windows
        c = pid * BLOCK_D + tl.arange(0, BLOCK_D)
        cm = c < D
        a = tl.zeros([BLOCK_D], dtype=tl.float64)
        a2 = tl.zeros([BLOCK_D], dtype=tl.float64)
        ub = tl.zeros([BLOCK_D], dtype=tl.float64)  # Σ_w ū_w
        ub2 = tl.zeros([BLOCK_B], dtype=tl.float64)  # Σ_w ‖ū_w‖² over this column block
        for k in range(B_TILES):  # a power of 2 ≥ B / BLOCK_B
            bb = k * BLOCK_B + tl.arange(0, BLOCK_B)
            at = bb[:, None].to(tl.int64) * D + c[None, :]
            mk = (bb[:, None] < B) & cm[None, :]
            a += tl.sum(tl.load(m + at, mask=mk, other=0.0), axis=0)
            a2 += tl.sum(tl.load(u2 + at, mask=mk, other=0.0), axis=0)
            n = tl.load(nw + bb, mask=bb < B, other=0)  # (BLOCK_B,) vectors per window
            mean = tl.load(u + at, mask=mk, other=0.0) / tl.maximum(n, 1).to(tl.float64)[:, None]  # ū = Σû / n
            mean = tl.where((n > 0)[:, None], mean, 0.0)
            ub += tl.sum(mean, axis=0)
            ub2 += tl.sum(mean * mean, axis=1)
        tl.store(s_out + c, a, mask=cm)
        tl.store(sum_h + c, tl.load(sum_h + c, mask=cm, other=0.0) + a, mask=cm)
        tl.store(sum_u2 + c, tl.load(sum_u2 + c, mask=cm, other=0.0) + a2, mask=cm)
        tl.store(sum_ubar + c, tl.load(sum_ubar + c, mask=cm, other=0.0) + ub, mask=cm)
        tl.atomic_add(sum_ubar_sq, tl.sum(ub2, axis=0))
        if pid == 0:  # the counts of `norms_kernel`, and the vectors counted (for the moments)
            tl.atomic_add(nonfinite, tl.load(counts))
            tl.atomic_add(zero, tl.load(counts + 1))
    else:  # a block of windows: each one's mean cosine to its mean, over d
        bb = (pid - N_COLS) * BLOCK_B + tl.arange(0, BLOCK_B)
        bm = bb < B
        nm2 = tl.zeros([BLOCK_B], dtype=tl.float64)
        dot = tl.zeros([BLOCK_B], dtype=tl.float64)
        for d0 in range(0, D, BLOCK_D):
            c = d0 + tl.arange(0, BLOCK_D)
            at = bb[:, None].to(tl.int64) * D + c[None, :]
            mk = bm[:, None] & (c[None, :] < D)
            mt = tl.load(m + at, mask=mk, other=0.0)
            nm2 += tl.sum(mt * mt, axis=1)
            dot += tl.sum(tl.load(u + at, mask=mk, other=0.0) * mt, axis=1)
        n = tl.load(nw + bb, mask=bm, other=0)
        norm = tl.sqrt(nm2)
        valid = bm & (n >= 2) & (norm > 0.0)
        den = tl.maximum(norm * n.to(tl.float64), 1e-300)
        tl.atomic_add(window_cos, tl.sum(tl.where(valid, dot / den, 0.0), axis=0))
        tl.atomic_add(windows, tl.sum(valid.to(tl.int64), axis=0))
        tl.atomic_add(unit_windows, tl.sum((bm & (n > 0)).to(tl.int64), axis=0))
        tl.atomic_add(counts + 2, tl.sum(n, axis=0))


@triton.jit
def bf16_rne(x):
    """float32 x rounded to the nearest bf16 value, ties to even, as float32 (finite x): the GPU's
    rounding, spelled out because Triton's interpreter truncates when it converts float32 to bf16."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["M"])
def gram_kernel(a, sa, ok_a, c_a, b, sb, ok_b, c_b, tiles, M, out, D: tl.constexpr, SPLIT_A: tl.constexpr,
                SPLIT_B: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FLUSH: tl.constexpr,
                DOT: tl.constexpr, PRECISION: tl.constexpr):
    t = tl.program_id(0)
    cm = tl.load(tiles + 2 * t) * BM + tl.arange(0, BM)  # the tile's columns of a: rows of the product
    cn = tl.load(tiles + 2 * t + 1) * BN + tl.arange(0, BN)  # its columns of b
    mm = cm < D
    mn = cn < D
    ca = tl.load(c_a + cm, mask=mm, other=0.0)  # (BM,) float32 centre: 0 for raw rows
    cb = tl.load(c_b + cn, mask=mn, other=0.0)
    total = tl.zeros((BM, BN), dtype=tl.float64)
    acc = tl.zeros((BM, BN), dtype=tl.float32)  # the float32 sum of ≤ FLUSH rows' products
    for k0 in range(0, M, BK):
        r = k0 + tl.arange(0, BK)
        rm = r < M
        oka = tl.load(ok_a + r, mask=rm, other=0) != 0
        okb = tl.load(ok_b + r, mask=rm, other=0) != 0
        xa = tl.load(a + r[:, None].to(tl.int64) * sa + cm[None, :], mask=rm[:, None] & mm[None, :], other=0.0)
        xb = tl.load(b + r[:, None].to(tl.int64) * sb + cn[None, :], mask=rm[:, None] & mn[None, :], other=0.0)
        fa = tl.where(oka[:, None], xa.to(tl.float32) - ca[None, :], 0.0)  # (BK, BM) h − c: exact in float32
        fb = tl.where(okb[:, None], xb.to(tl.float32) - cb[None, :], 0.0)  # (BK, BN)
        ha = bf16_rne(fa)  # hi: x rounded to bf16 (x itself for raw rows), a float32 holding a bf16 value
        hb = bf16_rne(fb)
        # the operands in DOT: bf16 on a GPU (tensor cores, float32 accumulation); float32 in the interpreter,
        # which multiplies bf16 operands' bit patterns — the same values either way, every product exact
        ha_t = tl.trans(ha.to(DOT))
        hb_d = hb.to(DOT)
        acc = tl.dot(ha_t, hb_d, acc, input_precision=PRECISION)
        if SPLIT_B:  # lo: x − hi (exact in float32) rounded to bf16
            lb = bf16_rne(fb - hb).to(DOT)
            acc = tl.dot(ha_t, lb, acc, input_precision=PRECISION)
        if SPLIT_A:
            la_t = tl.trans(bf16_rne(fa - ha).to(DOT))
            acc = tl.dot(la_t, hb_d, acc, input_precision=PRECISION)
            if SPLIT_B:
                acc = tl.dot(la_t, lb, acc, input_precision=PRECISION)
        if (k0 + BK) % FLUSH == 0:  # every FLUSH rows the float32 sum goes into the float64 one
            total += acc.to(tl.float64)
            acc = tl.zeros((BM, BN), dtype=tl.float32)
    total += acc.to(tl.float64)
    at = out + cm[:, None].to(tl.int64) * D + cn[None, :]
    mk = mm[:, None] & mn[None, :]
    tl.store(at, tl.load(at, mask=mk, other=0.0) + total, mask=mk)  # the tile is this program's alone
