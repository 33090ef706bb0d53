"""Device code of the Triton kernels for codebook layers (method e8, format/codebook.py): an E8 block's
point decoded in registers from its code planes and the shared codebook table, then the SIMT GEMV or
one ``tl.dot`` per scale group. Only ``@triton.jit`` functions live here (:mod:`tools.triton_compile`
fingerprints them); the host side and the table's layout: :mod:`~vllm_latq.kernels.triton.codebook`.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .device import _and_or, _epilogue, _group_scale, _row_offset, _scale_base

BALL_AT = tl.constexpr(256)      # the ball's words follow E8P's 256 in the shared table


@triton.jit
def _e8p_fetch(c, tab_ptr):
    """16-bit E8P codes (int32; bits above 15 ignored) → (pattern words, their eight sign bits, the
    shift ±¼ in fp32). The eighth sign makes the signed sum even: the pattern's parity (word bit 24)
    xor the parity of the seven stored signs (a negated half-odd coordinate flips the sum's parity)."""
    t = tl.load(tab_ptr + (c & 255))
    neg = (c >> 8) & 127
    p = neg ^ (t >> 24)
    p = p ^ (p >> 4)
    p = p ^ (p >> 2)
    p = p ^ (p >> 1)
    sh = 0.25 - 0.5 * ((c >> 15) & 1).to(tl.float32)
    return t, neg | ((p & 1) << 7), sh


@triton.jit
def _e8p_coord(t, sgn, sh, j, ASM: tl.constexpr):
    """Coordinate ``j`` (a constant, or an index tensor broadcast with the words) of E8P points,
    fp32 and exact: the 3-bit field 2|a_j| made a float (OR-ed into 2^23, one FADD), its sign xor-ed
    in, halved, plus the shift."""
    f = t >> (3 * j)
    q = _and_or(f, 7, tl.full(f.shape, 0x4B000000, tl.int32), ASM).to(tl.float32, bitcast=True) - 8388608.0
    s = ((sgn >> j) & 1) << 31
    return (q.to(tl.int32, bitcast=True) ^ s).to(tl.float32, bitcast=True) * 0.5 + sh


@triton.jit
def _ball_coord(t, j, ASM: tl.constexpr):
    """Coordinate ``j`` of the ball stage's points over its gain 2: the 4-bit field 2·p_j + 8."""
    f = t >> (4 * j)
    u = _and_or(f, 15, tl.full(f.shape, 0x4B000000, tl.int32), ASM).to(tl.float32, bitcast=True)
    return (u - 8388616.0) * 0.25


@triton.jit
def _fetch(ca_ptr, cb_ptr, tab_ptr, off, mask, BITS: tl.constexpr):
    """The codes of blocks ``off`` → each stage's table words (and E8P's signs and shift): stage 1
    E8P; 3 bits: the ball's word second; 4 bits: the second E8P code (bits 16–31 of plane A)."""
    ca = tl.load(ca_ptr + off, mask=mask, other=0).to(tl.int32)
    t1, s1, h1 = _e8p_fetch(ca, tab_ptr)
    t2 = t1
    s2 = s1
    h2 = h1
    if BITS == 3:
        cb = tl.load(cb_ptr + off, mask=mask, other=0).to(tl.int32)
        t2 = tl.load(tab_ptr + BALL_AT + (cb & 255))
    elif BITS == 4:
        t2, s2, h2 = _e8p_fetch(ca >> 16, tab_ptr)
    return t1, s1, h1, t2, s2, h2


@triton.jit
def _coord(t1, s1, h1, t2, s2, h2, j, BITS: tl.constexpr, ASM: tl.constexpr):
    """Coordinate ``j`` of the blocks' points, Σ stages' points over their gains (fp32, exact)."""
    v = _e8p_coord(t1, s1, h1, j, ASM)
    if BITS == 3:
        v += _ball_coord(t2, j, ASM)
    elif BITS == 4:
        v += _e8p_coord(t2, s2, h2, j, ASM) * 0.25
    return v


@triton.jit
def _program(KB, BM: tl.constexpr, BN: tl.constexpr, BKB: tl.constexpr, SPLIT: tl.constexpr):
    """This program's rows of x and output rows, and its K split's steps ``[t_beg, t_end)`` of BKB
    blocks (grid: M tiles fastest, then output tiles, then splits)."""
    pid_k = tl.program_id(2)
    tiles = tl.cdiv(KB, BKB)
    per = tl.cdiv(tiles, SPLIT)
    t_beg = pid_k * per
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    return rm, rn, pid_k, t_beg, tl.minimum(t_beg + per, tiles)


@triton.jit(do_not_specialize=("M", "KB", "NGP"))
def _e8_gemv_kernel(x_ptr, y_ptr, b_ptr, ca_ptr, cb_ptr, s_ptr, tab_ptr, ws_ptr, cnt_ptr,
                    M, N, K, KB, stride_xm, stride_ym, N_PAD, NGP, M_WS,
                    BITS: tl.constexpr, GROUP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    BKB: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, ASM: tl.constexpr,
                    CODED: tl.constexpr):
    """y = x·Wᵀ (+ bias) on SIMT lanes for a few rows of x: one program per BN output rows × K split
    × BM rows of x, BKB blocks a K step; each block's point decoded once, scaled by its group's
    scale (the reference's fp32 product, exact) and multiplied with the BM rows' eight activations."""
    rm, rn, pid_k, t_beg, t_end = _program(KB, BM, BN, BKB, SPLIT)
    # every tensor of the K loop is [BM rows of x, BKB blocks, BN output rows] or a broadcastable
    # slice of it, the codes loaded in that shape too: one layout for the whole loop (a 2-D code
    # tile broadcast into it took a shared-memory round trip and a barrier per coordinate)
    rn3 = rn[None, None, :]
    kb3 = tl.arange(0, BKB)[None, :, None]
    rm3 = rm[:, None, None]
    xrow = x_ptr + _row_offset(rm3, stride_xm)
    mmask = rm3 < M
    sp = _scale_base(s_ptr, rn // 16, rn % 16, NGP, CODED)[None, None, :]
    rs = (rn % 16)[None, None, :]
    nmask = rn3 < N_PAD
    acc = tl.zeros([BM, BKB, BN], dtype=tl.float32)
    for t in range(t_beg, t_end):
        b = t * BKB + kb3
        bmask = (b < KB) & nmask
        t1, s1, h1, t2, s2, h2 = _fetch(ca_ptr, cb_ptr, tab_ptr, b * N_PAD + rn3, bmask, BITS)
        if GROUP % (8 * BKB) == 0:       # the step lies in one group: one scale per row
            sc = _group_scale(sp, (8 * BKB * t) // GROUP, rs, nmask, CODED, ASM)
        else:
            sc = _group_scale(sp, (8 * b) // GROUP, rs, bmask, CODED, ASM)
        xb = xrow + 8 * b
        xm = mmask & (b < KB)
        for j in tl.static_range(8):
            w = _coord(t1, s1, h1, t2, s2, h2, j, BITS, ASM) * sc
            xs = tl.load(xb + j, mask=xm, other=0.0).to(tl.float32)
            acc += xs * w
    out = tl.sum(acc, axis=1)
    _epilogue(out, y_ptr, b_ptr, ws_ptr, cnt_ptr, rm, rn, M, N, stride_ym, N_PAD, M_WS, pid_k,
              tl.program_id(1) * tl.num_programs(0) + tl.program_id(0), SPLIT, HAS_BIAS)


@triton.jit(do_not_specialize=("M", "KB", "NGP"))
def _e8_mma_kernel(x_ptr, y_ptr, b_ptr, ca_ptr, cb_ptr, s_ptr, tab_ptr, ws_ptr, cnt_ptr,
                   M, N, K, KB, stride_xm, stride_ym, N_PAD, NGP, M_WS,
                   BITS: tl.constexpr, GROUP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   BKB: tl.constexpr, GKB: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                   ASM: tl.constexpr, CODED: tl.constexpr, F32DOT: tl.constexpr):
    """y = x·Wᵀ (+ bias) on tensor cores: per K step of BKB blocks, GKB blocks at a time (one scale
    group, ≥ 16 columns) decoded to their exact points [8·GKB, BN] in x's dtype (multiples of 1/16
    with ≤ 7 significant bits: exact in bf16 and fp16), one ``tl.dot`` in fp32, scaled once."""
    if F32DOT:
        DT: tl.constexpr = tl.float32
    else:
        DT: tl.constexpr = x_ptr.dtype.element_ty
    rm, rn, pid_k, t_beg, t_end = _program(KB, BM, BN, BKB, SPLIT)
    rn3 = rn[None, None, :]
    kb3 = tl.arange(0, GKB)[:, None, None]
    j3 = tl.arange(0, 8)[None, :, None]
    kk = tl.arange(0, 8 * GKB)
    xrow = x_ptr + _row_offset(rm[:, None], stride_xm)
    mmask = (rm < M)[:, None]
    sp = _scale_base(s_ptr, rn // 16, rn % 16, NGP, CODED)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for t in range(t_beg, t_end):
        for q in tl.static_range(BKB // GKB):
            b0 = t * BKB + q * GKB
            b3 = b0 + kb3
            t1, s1, h1, t2, s2, h2 = _fetch(ca_ptr, cb_ptr, tab_ptr, b3 * N_PAD + rn3, (b3 < KB) & (rn3 < N_PAD),
                                            BITS)
            v = _coord(t1, s1, h1, t2, s2, h2, j3, BITS, ASM)                   # [GKB, 8, BN]
            w = tl.reshape(v, [8 * GKB, BN]).to(DT)
            cols = 8 * b0 + kk
            xs = tl.load(xrow + cols[None, :], mask=mmask & (cols < K)[None, :], other=0.0).to(DT)
            # a chunk past K (ragged last step) reads no scale: past the last group lies garbage
            # (the interpreter folds a scalar bool & a bool tensor into an int: a limit instead)
            sc = _group_scale(sp, (8 * b0) // GROUP, rn % 16, rn < tl.where(b0 < KB, N_PAD, 0), CODED, ASM)
            acc += tl.dot(xs, w) * sc[None, :]
    _epilogue(acc, y_ptr, b_ptr, ws_ptr, cnt_ptr, rm, rn, M, N, stride_ym, N_PAD, M_WS, pid_k,
              tl.program_id(1) * tl.num_programs(0) + tl.program_id(0), SPLIT, HAS_BIAS)
