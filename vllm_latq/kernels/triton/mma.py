"""The tensor-core kernel's device code: M ≥ 8 on the GEMV's word tiles, the exact integers
multiplied on tensor cores and each group's dot scaled once (docs/KERNELS.md)."""
from __future__ import annotations

import triton
import triton.language as tl

from .device import (UNSPECIALIZED, _and_or, _ell_rows, _epilogue, _group_scale, _row_offset, _scale_base,
                     _word_tile_ptrs, _word_tiles)


@triton.jit
def _zslabs(wa, wb, wh, Q: tl.constexpr, DS: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr,
            DT: tl.constexpr):
    """Slabs [Q·DS, Q·DS + DS) of a step as exact integers z = u − 2^(b−1) in DT, [DS, 16, BN]: u
    OR-ed into the bits of 2^23 (one LOP3), 2^23 + 2^(b−1) subtracted (one FADD)."""
    jj = Q * DS + tl.arange(0, DS)[:, None, None]                # slab index j
    magic = tl.full([DS, 16, wa.shape[2]], 0x4B000000, tl.int32)
    if BITS == 4:
        f = _and_or(wa >> (4 * jj), 15, magic, ASM)
    elif BITS == 2:
        f = _and_or(wa >> (2 * jj), 3, magic, ASM)
    elif BITS == 5:                                             # wh: slab j at bit j
        f = _and_or(wa >> (4 * jj), 15, _and_or((wh >> jj) << 4, 16, magic, ASM), ASM)
    else:
        i = jj % 16
        if Q * DS < 16:                                         # DS divides 16: one lo tile
            lo = wa
        else:
            lo = wb
        hb = ((wh >> (16 * (jj // 16) + i)) << 2)
        f = _and_or(lo >> (2 * i), 3, _and_or(hb, 4, magic, ASM), ASM)
    OFF: tl.constexpr = 1 << (BITS - 1)
    return (f.to(tl.float32, bitcast=True) - (8388608.0 + OFF)).to(DT)


@triton.jit
def _zslabs3(lo, hi, Q: tl.constexpr, DS: tl.constexpr, ASM: tl.constexpr, DT: tl.constexpr):
    """3 bits: slots [Q·DS, Q·DS + DS) of a quarter step → exact z in DT, [DS, 16, BN]. ``lo``:
    the 2-bit word tile shifted to this 16-bit half (slot i at bits 2i), ``hi``: the 1-bit
    tile shifted so that slot i is at bit i."""
    ii = Q * DS + tl.arange(0, DS)[:, None, None]
    magic = tl.full([DS, 16, lo.shape[2]], 0x4B000000, tl.int32)
    f = _and_or(lo >> (2 * ii), 3, _and_or((hi >> ii) << 2, 4, magic, ASM), ASM)
    return (f.to(tl.float32, bitcast=True) - (8388608.0 + 4)).to(DT)


@triton.jit
def _mma_step(acc, wa, wb, wh, k0, xrow, mmask, K, sp, r16, rn, N_PAD,
              BITS: tl.constexpr, GROUP: tl.constexpr, SPG: tl.constexpr, BN: tl.constexpr,
              ASM: tl.constexpr, DT: tl.constexpr, CODED: tl.constexpr):
    """One K step of the tensor-core kernel (columns ``k0 + [0, STEP)``) added to ``acc``
    [BM, BN]. A 3-bit layer's main loop runs it at BITS = 3 and its 4-bit tail at BITS = 4
    (``SPG`` is capped at the step's slabs here)."""
    SLABS: tl.constexpr = 32 if BITS == 3 else (8 if BITS == 5 else 32 // BITS)   # 16-column slabs
    SG: tl.constexpr = SPG if SPG < SLABS else SLABS           # slabs per scale group within a step
    DSMAX: tl.constexpr = 4 if BITS == 3 else 8                # 3 bits: K = 64 per dot (registers)
    DS: tl.constexpr = SG if SG < DSMAX else DSMAX             # slabs per tl.dot
    ND: tl.constexpr = SLABS // DS                             # dots per step
    DPG: tl.constexpr = SG // DS                               # dots per scale group
    kd = tl.arange(0, DS * 16)
    if BITS == 3:
        # 3 bits: a runtime loop over the four 128-column quarters of the 512-column step
        # (2-bit tile c × 16-bit half hh), as in the GEMV: unrolling all eight dots of a
        # step made ptxas exceed 255 registers (measured spills on sm_86/89/90).
        for h in range(4):
            lo = tl.where(h < 2, wa, wb) >> (16 * (h % 2))
            hi = wh >> (16 * (h // 2) + 8 * (h % 2))     # slot i of this quarter at bit i
            for q in tl.static_range(8 // DS):
                z = tl.reshape(_zslabs3(lo, hi, q, DS, ASM, DT), [DS * 16, BN])
                c0 = k0 + 128 * h + q * (DS * 16)
                kk = c0 + kd
                xs = tl.load(xrow + kk[None, :], mask=mmask & (kk < K)[None, :], other=0.0).to(DT)
                sc = _group_scale(sp, c0 // GROUP, r16, rn < N_PAD, CODED, ASM)
                acc += tl.dot(xs, z) * sc[None, :]          # DS·16 columns: one scale group
    else:
        part = tl.zeros(acc.shape, dtype=tl.float32)
        for q in tl.static_range(ND):
            z = tl.reshape(_zslabs(wa, wb, wh, q, DS, BITS, ASM, DT), [DS * 16, BN])
            kk = k0 + q * (DS * 16) + kd
            xs = tl.load(xrow + kk[None, :], mask=mmask & (kk < K)[None, :], other=0.0).to(DT)
            part = tl.dot(xs, z, part)
            if (q + 1) % DPG == 0:
                gi = (k0 + (q + 1 - DPG) * (DS * 16)) // GROUP
                sc = _group_scale(sp, gi, r16, rn < N_PAD, CODED, ASM)
                acc += part * sc[None, :]
                part = tl.zeros(acc.shape, dtype=tl.float32)
    return acc


@triton.jit
def _ell_slots(col_ptr, val_ptr, e0, cnt, r0, r16, BR: tl.constexpr):
    # ELL slots r0 + [0, BR) of the tile's rows, [BR, BN]; past a row's count column 0, value 0 (as padding)
    rr = r0 + tl.arange(0, BR)
    em = rr[:, None] < cnt[None, :]
    idx = e0[None, :] + rr[:, None] * 16 + r16[None, :]
    return tl.load(col_ptr + idx, mask=em, other=0), tl.load(val_ptr + idx, mask=em, other=0.0)


@triton.jit
def _ell_dot(xt_ptr, stride_xt, rm, col, val):
    # Σ over slots of val · x[m, col] → [BM, BN]; xᵀ is padded to whole row tiles with a
    # 16-divisible stride, so the gather needs no row mask and loads a slot's BM rows as vectors
    # (the padding rows are unset: they reach only output rows never stored)
    xg = tl.load(xt_ptr + _row_offset(col[None, :, :], stride_xt) + rm[:, None, None]).to(tl.float32)
    return tl.sum(val.to(tl.float32)[None, :, :] * xg, axis=1)


@triton.jit
def _csr_outliers(start_ptr, row_ptr, col_ptr, val_ptr, xt_ptr, stride_xt, rm, rn, n0, N_PAD, pid_k,
                  BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr, SPLIT: tl.constexpr):
    # CSR outliers of the [BM, BN] tile, BR entries at a time, gathered from xᵀ, routed to rows one-hot
    oacc = tl.zeros([BM, BN], dtype=tl.float32)
    rb = tl.arange(0, BR)
    e0 = tl.load(start_ptr + n0)
    e1 = tl.load(start_ptr + tl.minimum(n0 + BN, N_PAD))
    for e in range(e0 + pid_k * BR, e1, SPLIT * BR):
        ee = e + rb
        em = ee < e1
        row = tl.load(row_ptr + ee, mask=em, other=-1)
        col = tl.load(col_ptr + ee, mask=em, other=0)
        val = tl.load(val_ptr + ee, mask=em, other=0.0)
        xg = tl.load(xt_ptr + _row_offset(col[None, :], stride_xt) + rm[:, None]).to(tl.float32)   # [BM, BR]
        hit = row[:, None] == rn[None, :]                                                          # [BR, BN]
        oacc += tl.sum(tl.where(hit[None, :, :], (xg * val[None, :])[:, :, None], 0.0), axis=1)
    return oacc


@triton.jit(do_not_specialize=UNSPECIALIZED)
def _mma_kernel(x_ptr, y_ptr, b_ptr, pa_ptr, ph_ptr, pt_ptr, s_ptr,
                start_ptr, row_ptr, col_ptr, val_ptr, ws_ptr, cnt_ptr,
                M, N, K, stride_xm, stride_ym, N_PAD, NCH_A, NCH_H, NGP, NSTEPS, TSTEPS, M_WS, xt_ptr, stride_xt,
                BITS: tl.constexpr, GROUP: tl.constexpr, SPG: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr,
                OUTL: tl.constexpr, HAS_BIAS: tl.constexpr, BR: tl.constexpr, F32DOT: tl.constexpr,
                ASM: tl.constexpr, CODED: tl.constexpr):
    """y = x·Wᵀ (+ bias) for M ≥ 8 on tensor cores, in 16-, 32- or 64-row tiles run M fastest:
    the GEMV's word tiles dequantised to exact integers in registers, one ``tl.dot`` per scale
    group scaled once, outliers on SIMT lanes after the K loop (docs/KERNELS.md)."""
    STEP: tl.constexpr = 512 if BITS == 3 else (128 if BITS == 5 else 512 // BITS)
    if F32DOT:
        DT: tl.constexpr = tl.float32
    else:
        DT: tl.constexpr = x_ptr.dtype.element_ty
    pid_m = tl.program_id(0)            # M fastest: the M tiles of a weight tile run side by side
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rn = pid_n * BN + tl.arange(0, BN)
    rm = pid_m * BM + tl.arange(0, BM)
    w16 = tl.arange(0, 16)
    g16 = rn // 16
    r16 = rn % 16
    rn3 = rn[None, None, :]
    w3 = w16[None, :, None]
    xrow = x_ptr + _row_offset(rm[:, None], stride_xm)
    mmask = (rm < M)[:, None]
    ta = _word_tile_ptrs(pa_ptr, g16, r16, w3, NCH_A)
    th = _word_tile_ptrs(ph_ptr, g16, r16, w3, NCH_H)
    sp = _scale_base(s_ptr, g16, r16, NGP, CODED)

    SPS = tl.cdiv(NSTEPS, SPLIT)
    s_beg = pid_k * SPS
    s_end = tl.minimum(s_beg + SPS, NSTEPS)
    wa_n, wb_n, wh_n = _word_tiles(ta, th, s_beg, s_end, rn3, w3, N_PAD, BITS)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    # ELL outliers ride the K loop, SR slots a step (step s: slots [s·SR, s·SR + SR)), their
    # entries prefetched a step ahead with the word tiles: the gathers' latency hides behind
    # the step's tensor-core work instead of queuing after it
    SR: tl.constexpr = BR if BR < STEP // 64 else STEP // 64
    if OUTL == 1:
        e0, cnt, rmax = _ell_rows(start_ptr, rn, N_PAD)
        oc_n, ov_n = _ell_slots(col_ptr, val_ptr, e0, cnt, s_beg * SR, r16, SR)
    for s in range(s_beg, s_end):
        wa = wa_n
        wb = wb_n
        wh = wh_n
        wa_n, wb_n, wh_n = _word_tiles(ta, th, s + 1, s_end, rn3, w3, N_PAD, BITS)   # prefetch the next step
        if OUTL == 1:
            oc = oc_n
            ov = ov_n
            oc_n, ov_n = _ell_slots(col_ptr, val_ptr, e0, cnt, (s + 1) * SR, r16, SR)
            if s * SR < rmax:
                acc += _ell_dot(xt_ptr, stride_xt, rm, oc, ov)
        acc = _mma_step(acc, wa, wb, wh, s * STEP, xrow, mmask, K, sp, r16, rn, N_PAD, BITS, GROUP, SPG, BN, ASM, DT,
                        CODED)
    if BITS == 3:
        # the 4-bit tail (< 512 columns from NSTEPS·512, 128 per step), its steps dealt to
        # the splits from the last one, which got the fewest main steps
        tt = _word_tile_ptrs(pt_ptr, g16, r16, w3, TSTEPS)
        for t in range(SPLIT - 1 - pid_k, TSTEPS, SPLIT):
            w4, _, _ = _word_tiles(tt, tt, t, TSTEPS, rn3, w3, N_PAD, 4)
            acc = _mma_step(acc, w4, w4, w4, NSTEPS * STEP + 128 * t, xrow, mmask, K, sp, r16, rn, N_PAD,
                            4, GROUP, SPG, BN, ASM, DT, CODED)
    if OUTL == 1:                # the slots past the K loop's, BR at a time
        for r0 in range(NSTEPS * SR + pid_k * BR, rmax, SPLIT * BR):
            oc, ov = _ell_slots(col_ptr, val_ptr, e0, cnt, r0, r16, BR)
            acc += _ell_dot(xt_ptr, stride_xt, rm, oc, ov)
    elif OUTL == 2:
        acc += _csr_outliers(start_ptr, row_ptr, col_ptr, val_ptr, xt_ptr, stride_xt, rm, rn, pid_n * BN, N_PAD, pid_k,
                             BM, BN, BR, SPLIT)

    _epilogue(acc, y_ptr, b_ptr, ws_ptr, cnt_ptr, rm, rn, M, N, stride_ym, N_PAD, M_WS, pid_k,
              pid_n * tl.num_programs(0) + pid_m, SPLIT, HAS_BIAS)
