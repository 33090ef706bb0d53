"""The pipelined GEMV and tensor-core kernels: :mod:`.device`'s and :mod:`.mma`'s at 2, 4 and 5
bits with DEPTH K steps of weights in flight, run where a launch config has ``DEPTH`` ≥ 2; the
same numbers (docs/KERNELS.md, "Pipelined kernels")."""
from __future__ import annotations

import triton
import triton.language as tl

from .device import (UNSPECIALIZED, _and_or, _csr_gemv, _ell_gemv, _ell_rows, _epilogue, _fbits, _group_scale,
                     _row_offset, _scale_base, _word_tile_ptrs)
from .mma import _csr_outliers, _ell_dot, _ell_slots, _mma_step, _zslabs


@triton.jit
def _step_loads(ta, th, sp, s, s_end, rn3, w3, rs, rns, N_PAD, BITS: tl.constexpr, STEP: tl.constexpr,
                GROUP: tl.constexpr, PRE: tl.constexpr, CODED: tl.constexpr):
    """Step ``s``'s word tiles (plane A, 5 bits: the 1-bit plane at its byte; zeros past ``s_end``) and,
    ``PRE`` (one scale group a step), the scale words of rows ``rns`` (slab rows ``rs``)."""
    # (a scalar bool & a bool tensor is int in the interpreter: conditions fold into limits)
    lim = tl.where(s < s_end, N_PAD, 0)
    pm = (rn3 < lim) & (w3 < 16)
    wa = tl.load(ta + s * 256, mask=pm, other=0, eviction_policy="evict_first")
    wh = wa
    if BITS == 5:
        wh = tl.load(th + (s // 4) * 256, mask=pm, other=0, eviction_policy="evict_first") >> (8 * (s % 4))
    sa = tl.zeros(rs.shape, dtype=tl.float32)
    sb = tl.zeros(rs.shape, dtype=tl.int32)
    if PRE:
        gi = (s * STEP) // GROUP
        sm = rns < lim
        if CODED:
            sa = tl.load(sp + gi * 3 + (rs >> 3), mask=sm, other=0, eviction_policy="evict_first")
            sb = tl.load(sp + gi * 3 + 2, mask=sm, other=0, eviction_policy="evict_first")
        else:
            sa = tl.load(sp + gi * 16, mask=sm, other=0.0, eviction_policy="evict_first").to(tl.float32)
    return wa, wh, sa, sb


@triton.jit
def _queue_init(ta, th, sp, s, s_end, rn3, w3, rs, rns, N_PAD, BITS: tl.constexpr, STEP: tl.constexpr,
                GROUP: tl.constexpr, PRE: tl.constexpr, CODED: tl.constexpr, DEPTH: tl.constexpr):
    """Steps ``s`` .. ``s + DEPTH − 1`` loaded, four tensors a slot (slots past DEPTH unread)."""
    a0, h0, x0, y0 = _step_loads(ta, th, sp, s, s_end, rn3, w3, rs, rns, N_PAD, BITS, STEP, GROUP, PRE, CODED)
    a1, h1, x1, y1 = _step_loads(ta, th, sp, s + 1, s_end, rn3, w3, rs, rns, N_PAD, BITS, STEP, GROUP, PRE, CODED)
    a2, h2, x2, y2 = a1, h1, x1, y1
    if DEPTH >= 3:
        a2, h2, x2, y2 = _step_loads(ta, th, sp, s + 2, s_end, rn3, w3, rs, rns, N_PAD, BITS, STEP, GROUP, PRE,
                                     CODED)
    a3, h3, x3, y3 = a2, h2, x2, y2
    if DEPTH >= 4:
        a3, h3, x3, y3 = _step_loads(ta, th, sp, s + 3, s_end, rn3, w3, rs, rns, N_PAD, BITS, STEP, GROUP, PRE,
                                     CODED)
    return a0, h0, x0, y0, a1, h1, x1, y1, a2, h2, x2, y2, a3, h3, x3, y3


@triton.jit
def _queue_push(a1, h1, x1, y1, a2, h2, x2, y2, a3, h3, x3, y3, ta, th, sp, s, s_end, rn3, w3, rs, rns, N_PAD,
                BITS: tl.constexpr, STEP: tl.constexpr, GROUP: tl.constexpr, PRE: tl.constexpr,
                CODED: tl.constexpr, DEPTH: tl.constexpr):
    """The queue without its head: slots move up, step ``s`` (head + DEPTH) loads into the last."""
    an, hn, xn, yn = _step_loads(ta, th, sp, s, s_end, rn3, w3, rs, rns, N_PAD, BITS, STEP, GROUP, PRE, CODED)
    if DEPTH == 2:
        return a1, h1, x1, y1, an, hn, xn, yn, a2, h2, x2, y2, a3, h3, x3, y3
    elif DEPTH == 3:
        return a1, h1, x1, y1, a2, h2, x2, y2, an, hn, xn, yn, a3, h3, x3, y3
    else:
        return a1, h1, x1, y1, a2, h2, x2, y2, a3, h3, x3, y3, an, hn, xn, yn


@triton.jit
def _scale_value(sa, sb, rs, CODED: tl.constexpr, ASM: tl.constexpr):
    """fp32 scale from :func:`_step_loads`' scale words (:func:`.device._group_scale`'s decode)."""
    if CODED:
        magic = tl.full(sa.shape, 0x4B000000, tl.int32)
        code = _and_or(sa >> (4 * (rs & 7)), 15, magic, ASM).to(tl.float32, bitcast=True) - 8388608.0
        smin = (sb & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        step = (sb >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        return (smin + code * step).to(tl.float16).to(tl.float32)
    else:
        return sa


@triton.jit
def _ell_step(oacc, col, val, xrow, mmask):
    """``oacc`` [BM, SR, BN] + val · x[:, col] of a step's ELL slots (no gather for an empty slot)."""
    xg = tl.load(xrow + col, mask=mmask & (val != 0), other=0.0, eviction_policy="evict_last").to(tl.float32)
    return oacc + val.to(tl.float32) * xg


@triton.jit
def _ell_step_slots(col_ptr, val_ptr, e03, cnt3, s, SR: tl.constexpr):
    """ELL slots ``s·SR + [0, SR)`` of the rows, [1, SR, BN] (past a row's count: column 0, value 0)."""
    rr = s * SR + tl.arange(0, SR)[None, :, None]
    em = rr < cnt3
    idx = e03 + rr * 16
    return (tl.load(col_ptr + idx, mask=em, other=0, eviction_policy="evict_first"),
            tl.load(val_ptr + idx, mask=em, other=0.0, eviction_policy="evict_first"))


@triton.jit
def _gemv_step_p(acc, wa, wh, sc, k0, xrow, mmask, K, sp, rs3, smask, w3, BITS: tl.constexpr,
                 GROUP: tl.constexpr, SPG: tl.constexpr, ONE_ROW: tl.constexpr, ASM: tl.constexpr,
                 CODED: tl.constexpr, PRE: tl.constexpr, MASK_K: tl.constexpr):
    """:func:`.device._gemv_step` unrolled, scaled by the prefetched ``sc`` (``PRE``); ``MASK_K``: the
    step reaches past K (else its activations load unmasked, one row without a row mask)."""
    PB: tl.constexpr = 4 if BITS == 5 else BITS                 # plane-A slot bits
    SPH: tl.constexpr = 16 // PB                                # slabs per 16-bit half
    NH: tl.constexpr = (8 if BITS == 5 else 32 // BITS) // SPH
    FL: tl.constexpr = SPG if SPG < SPH else SPH                # slabs per scale application
    OFF: tl.constexpr = 1 << (BITS - 1)
    for h in tl.static_range(NH):
        lo = wa >> (16 * h)
        hi = lo
        if BITS == 5:
            hi = wh >> (4 * h)                                  # 1-bit slot 4h + i of the step at bit i
        if ONE_ROW:
            part = tl.zeros(acc.shape, dtype=tl.float32)
        for i in tl.static_range(SPH):
            P = PB * i
            z = _fbits(lo, hi, P, BITS, ASM).to(tl.float32, bitcast=True) - ((1 << (23 - P)) + OFF)
            j = h * SPH + i
            kk = k0 + 16 * j + w3
            if MASK_K:
                xs = tl.load(xrow + kk, mask=mmask & (kk < K), other=0.0, eviction_policy="evict_last")
            elif ONE_ROW:
                xs = tl.load(xrow + kk, eviction_policy="evict_last")
            else:
                xs = tl.load(xrow + kk, mask=mmask, other=0.0, eviction_policy="evict_last")
            xs = xs.to(tl.float32)
            if ONE_ROW:
                part += z * xs
                if (i + 1) % FL == 0:
                    if PRE:
                        acc += part * sc
                    else:
                        acc += part * _group_scale(sp, (k0 + 16 * (j + 1 - FL)) // GROUP, rs3, smask, CODED, ASM)
                    part = tl.zeros(acc.shape, dtype=tl.float32)
            else:
                if i % FL == 0:
                    if PRE:
                        g = sc
                    else:
                        g = _group_scale(sp, (k0 + 16 * j) // GROUP, rs3, smask, CODED, ASM)
                acc += (z * g) * xs
    return acc


@triton.jit(do_not_specialize=UNSPECIALIZED)
def _gemv_pipelined_kernel(x_ptr, y_ptr, b_ptr, pa_ptr, ph_ptr, pt_ptr, s_ptr,
                           start_ptr, row_ptr, col_ptr, val_ptr, ws_ptr, cnt_ptr,
                           M, N, K, stride_xm, stride_ym, N_PAD, NCH_A, NCH_H, NGP, NSTEPS, TSTEPS, M_WS,
                           BITS: tl.constexpr, GROUP: tl.constexpr, SPG: tl.constexpr,
                           BM: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr,
                           OUTL: tl.constexpr, HAS_BIAS: tl.constexpr, ASM: tl.constexpr, CODED: tl.constexpr,
                           DEPTH: tl.constexpr):
    """:func:`.device._gemv_kernel` with DEPTH steps of words and scales ahead, steps inside K
    unmasked, SR ELL slots a row riding each step (entries a step ahead)."""
    tl.static_assert(BITS != 3, "3-bit layers run the unpipelined kernels")
    STEP: tl.constexpr = 128 if BITS == 5 else 512 // BITS
    PRE: tl.constexpr = GROUP % STEP == 0
    SR: tl.constexpr = STEP // 64             # ELL slots a row per step: rows up to 1/64 dense in the loop
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rn = pid_n * BN + tl.arange(0, BN)
    rm = pid_m * BM + tl.arange(0, BM)
    g16 = rn // 16
    r16 = rn % 16
    rn3 = rn[None, None, :]
    w3 = tl.arange(0, 16)[None, :, None]
    rm3 = rm[:, None, None]
    xrow = x_ptr + _row_offset(rm3, stride_xm)
    mmask = rm3 < M
    ta = _word_tile_ptrs(pa_ptr, g16, r16, w3, NCH_A)
    th = _word_tile_ptrs(ph_ptr, g16, r16, w3, NCH_H)
    sp = _scale_base(s_ptr, g16, r16, NGP, CODED)[None, None, :]
    rs3 = r16[None, None, :]
    smask = rn3 < N_PAD       # the rows with scales (padding rows of the last tile have none)

    SPS = tl.cdiv(NSTEPS, SPLIT)
    s_beg = pid_k * SPS
    s_end = tl.minimum(s_beg + SPS, NSTEPS)
    # steps wholly inside K, at most one more reaching past it; none in a split past NSTEPS
    s_full = tl.maximum(s_beg, tl.minimum(s_end, K // STEP))
    oacc = tl.zeros([BM, SR, BN], dtype=tl.float32)
    if OUTL == 1:          # the rows' slot ranges go out with the first word tiles
        e0, cnt, rmax = _ell_rows(start_ptr, rn, N_PAD)
        e03 = (e0 + r16)[None, None, :]
        cnt3 = cnt[None, None, :]
        col_n, val_n = _ell_step_slots(col_ptr, val_ptr, e03, cnt3, s_beg, SR)
    a0, h0, x0, y0, a1, h1, x1, y1, a2, h2, x2, y2, a3, h3, x3, y3 = _queue_init(
        ta, th, sp, s_beg, s_end, rn3, w3, rs3, rn3, N_PAD, BITS, STEP, GROUP, PRE, CODED, DEPTH)
    acc = tl.zeros([BM, 16, BN], dtype=tl.float32)
    for s in range(s_beg, s_full):
        wa, wh, sa, sb = a0, h0, x0, y0
        a0, h0, x0, y0, a1, h1, x1, y1, a2, h2, x2, y2, a3, h3, x3, y3 = _queue_push(
            a1, h1, x1, y1, a2, h2, x2, y2, a3, h3, x3, y3, ta, th, sp, s + DEPTH, s_end, rn3, w3, rs3, rn3, N_PAD,
            BITS, STEP, GROUP, PRE, CODED, DEPTH)
        if OUTL == 1:
            col, val = col_n, val_n
            col_n, val_n = _ell_step_slots(col_ptr, val_ptr, e03, cnt3, s + 1, SR)
            oacc = _ell_step(oacc, col, val, xrow, mmask)
        sc = sa
        if PRE:
            sc = _scale_value(sa, sb, rs3, CODED, ASM)
        acc = _gemv_step_p(acc, wa, wh, sc, s * STEP, xrow, mmask, K, sp, rs3, smask, w3, BITS, GROUP, SPG,
                           BM == 1, ASM, CODED, PRE, False)
    if s_full < s_end:     # the step reaching past K: the queue's head, activations masked
        if OUTL == 1:
            oacc = _ell_step(oacc, col_n, val_n, xrow, mmask)
        sc = x0
        if PRE:
            sc = _scale_value(x0, y0, rs3, CODED, ASM)
        acc = _gemv_step_p(acc, a0, h0, sc, s_full * STEP, xrow, mmask, K, sp, rs3, smask, w3, BITS, GROUP,
                           SPG, BM == 1, ASM, CODED, PRE, True)
    if OUTL == 1:          # the slots past the K loop's, 16 a row at a time
        acc = _ell_gemv(acc, e0, cnt, col_ptr, val_ptr, xrow, mmask, r16, w3, NSTEPS * SR + pid_k * 16, rmax,
                        SPLIT * 16)
    elif OUTL == 2:
        acc = _csr_gemv(acc, start_ptr, row_ptr, col_ptr, val_ptr, xrow, mmask, pid_n * BN, rn3, w3, N_PAD, BN,
                        pid_k, SPLIT)
    out = tl.sum(acc, axis=1) + tl.sum(oacc, axis=1)
    _epilogue(out, y_ptr, b_ptr, ws_ptr, cnt_ptr, rm, rn, M, N, stride_ym, N_PAD, M_WS, pid_k,
              pid_n * tl.num_programs(0) + pid_m, SPLIT, HAS_BIAS)


@triton.jit
def _mma_step_p(acc, wa, wh, sc, k0, xrow, mmask, K, BITS: tl.constexpr, BN: tl.constexpr,
                ASM: tl.constexpr, DT: tl.constexpr):
    """:func:`.mma._mma_step` of a step in one scale group, scaled once by the prefetched ``sc``."""
    SLABS: tl.constexpr = 8 if BITS == 5 else 32 // BITS
    DS: tl.constexpr = 8 if SLABS > 8 else SLABS
    kd = tl.arange(0, DS * 16)
    part = tl.zeros(acc.shape, dtype=tl.float32)
    for q in tl.static_range(SLABS // DS):
        z = tl.reshape(_zslabs(wa, wa, wh, q, DS, BITS, ASM, DT), [DS * 16, BN])
        kk = k0 + q * (DS * 16) + kd
        xs = tl.load(xrow + kk[None, :], mask=mmask & (kk < K)[None, :], other=0.0, eviction_policy="evict_last")
        part = tl.dot(xs.to(DT), z, part)
    return acc + part * sc[None, :]


@triton.jit
def _ell_slots_p(col_ptr, val_ptr, e0, cnt, r0, r16, SR: tl.constexpr):
    """ELL slots ``r0 + [0, SR)`` of the tile's rows, [SR, BN] (past a row's count: column 0, value 0)."""
    rr = r0 + tl.arange(0, SR)
    em = rr[:, None] < cnt[None, :]
    idx = e0[None, :] + rr[:, None] * 16 + r16[None, :]
    return (tl.load(col_ptr + idx, mask=em, other=0, eviction_policy="evict_first"),
            tl.load(val_ptr + idx, mask=em, other=0.0, eviction_policy="evict_first"))


@triton.jit
def _xt_gather(xt_ptr, stride_xt, rm, col, floor):
    """x[rm, col] from xᵀ, [BM, SR, BN], none if ``floor`` > every column (a slot's rows stay vectors)."""
    return tl.load(xt_ptr + _row_offset(col[None, :, :], stride_xt) + rm[:, None, None],
                   mask=col.to(tl.int32)[None, :, :] >= floor, other=0.0, eviction_policy="evict_last")


@triton.jit(do_not_specialize=UNSPECIALIZED)
def _mma_pipelined_kernel(x_ptr, y_ptr, b_ptr, pa_ptr, ph_ptr, pt_ptr, s_ptr,
                          start_ptr, row_ptr, col_ptr, val_ptr, ws_ptr, cnt_ptr,
                          M, N, K, stride_xm, stride_ym, N_PAD, NCH_A, NCH_H, NGP, NSTEPS, TSTEPS, M_WS, xt_ptr,
                          stride_xt, BITS: tl.constexpr, GROUP: tl.constexpr, SPG: tl.constexpr,
                          BM: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr,
                          OUTL: tl.constexpr, HAS_BIAS: tl.constexpr, BR: tl.constexpr, F32DOT: tl.constexpr,
                          ASM: tl.constexpr, CODED: tl.constexpr, DEPTH: tl.constexpr):
    """:func:`.mma._mma_kernel` with DEPTH steps of words and scales ahead, the loop's ELL slots
    loaded two steps and gathered one step ahead, summed apart from the MMA accumulator."""
    tl.static_assert(BITS != 3, "3-bit layers run the unpipelined kernels")
    STEP: tl.constexpr = 128 if BITS == 5 else 512 // BITS
    PRE: tl.constexpr = GROUP % STEP == 0
    if F32DOT:
        DT: tl.constexpr = tl.float32
    else:
        DT: tl.constexpr = x_ptr.dtype.element_ty
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rn = pid_n * BN + tl.arange(0, BN)
    rm = pid_m * BM + tl.arange(0, BM)
    g16 = rn // 16
    r16 = rn % 16
    rn3 = rn[None, None, :]
    w3 = tl.arange(0, 16)[None, :, None]
    xrow = x_ptr + _row_offset(rm[:, None], stride_xm)
    mmask = (rm < M)[:, None]
    ta = _word_tile_ptrs(pa_ptr, g16, r16, w3, NCH_A)
    th = _word_tile_ptrs(ph_ptr, g16, r16, w3, NCH_H)
    sp = _scale_base(s_ptr, g16, r16, NGP, CODED)

    SPS = tl.cdiv(NSTEPS, SPLIT)
    s_beg = pid_k * SPS
    s_end = tl.minimum(s_beg + SPS, NSTEPS)
    SR: tl.constexpr = BR if BR < STEP // 64 else STEP // 64
    NOT: tl.constexpr = 1 << 30          # a gather floor above every column: nothing gathered
    if OUTL == 1:          # slots [s·SR, s·SR + SR) ride step s
        e0, cnt, rmax = _ell_rows(start_ptr, rn, N_PAD)
        oc0, ov_n = _ell_slots_p(col_ptr, val_ptr, e0, cnt, s_beg * SR, r16, SR)
        xg_n = _xt_gather(xt_ptr, stride_xt, rm, oc0, tl.where(s_beg < s_end, tl.where(s_beg * SR < rmax, 0, NOT), NOT))
        oc_nn, ov_nn = _ell_slots_p(col_ptr, val_ptr, e0, cnt, (s_beg + 1) * SR, r16, SR)
    a0, h0, x0, y0, a1, h1, x1, y1, a2, h2, x2, y2, a3, h3, x3, y3 = _queue_init(
        ta, th, sp, s_beg, s_end, rn3, w3, r16, rn, N_PAD, BITS, STEP, GROUP, PRE, CODED, DEPTH)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    # the K loop's outlier products stay in their own layout, summed over the slots once at
    # the end: adding them to the MMA accumulator each step would move them through shared memory
    oacc = tl.zeros([BM, SR, BN], dtype=tl.float32)
    for s in range(s_beg, s_end):
        wa, wh, sa, sb = a0, h0, x0, y0
        a0, h0, x0, y0, a1, h1, x1, y1, a2, h2, x2, y2, a3, h3, x3, y3 = _queue_push(
            a1, h1, x1, y1, a2, h2, x2, y2, a3, h3, x3, y3, ta, th, sp, s + DEPTH, s_end, rn3, w3, r16, rn, N_PAD,
            BITS, STEP, GROUP, PRE, CODED, DEPTH)
        if OUTL == 1:
            ov, xg = ov_n, xg_n
            xg_n = _xt_gather(xt_ptr, stride_xt, rm, oc_nn,
                              tl.where(s + 1 < s_end, tl.where((s + 1) * SR < rmax, 0, NOT), NOT))
            ov_n = ov_nn
            oc_nn, ov_nn = _ell_slots_p(col_ptr, val_ptr, e0, cnt, (s + 2) * SR, r16, SR)
            oacc += ov.to(tl.float32)[None, :, :] * xg.to(tl.float32)
        if PRE:
            acc = _mma_step_p(acc, wa, wh, _scale_value(sa, sb, r16, CODED, ASM), s * STEP, xrow, mmask, K,
                              BITS, BN, ASM, DT)
        else:
            acc = _mma_step(acc, wa, wa, wh, s * STEP, xrow, mmask, K, sp, r16, rn, N_PAD, BITS, GROUP, SPG, BN,
                            ASM, DT, CODED)
    if OUTL == 1:          # the slots past the K loop's, BR at a time
        acc += tl.sum(oacc, axis=1)
        for r0 in range(NSTEPS * SR + pid_k * BR, rmax, SPLIT * BR):
            oc, ov = _ell_slots(col_ptr, val_ptr, e0, cnt, r0, r16, BR)
            acc += _ell_dot(xt_ptr, stride_xt, rm, oc, ov)
    elif OUTL == 2:
        acc += _csr_outliers(start_ptr, row_ptr, col_ptr, val_ptr, xt_ptr, stride_xt, rm, rn, pid_n * BN, N_PAD, pid_k,
                             BM, BN, BR, SPLIT)
    _epilogue(acc, y_ptr, b_ptr, ws_ptr, cnt_ptr, rm, rn, M, N, stride_ym, N_PAD, M_WS, pid_k,
              pid_n * tl.num_programs(0) + pid_m, SPLIT, HAS_BIAS)
