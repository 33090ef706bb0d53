"""Device code of the Triton kernels for codebook layers (method e8, format/codebook.py): an E8 block's
point decoded in registers from its code planes and the shared table, as fields read in place less one
constant a block, then the SIMT GEMV, one ``tl.dot`` per scale group, or (large M) stored as the
dequantized weight for one cuBLAS GEMM. Only ``@triton.jit`` functions
(:mod:`tools.triton_compile` fingerprints them); host side, table: :mod:`~vllm_latq.kernels.triton.codebook`.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .dequant import _round
from .device import _and_or, _epilogue, _group_scale, _row_offset, _scale_base

TABLE_ENTRIES = tl.constexpr(512)   # the shared table: E8P's 256 pattern entries, then the ball's 256
BALL_AT = tl.constexpr(256)
H_BIT = tl.constexpr(-2**31)   # bit 31 of a word: where the ±¼ sign of an E8P stage sits


@triton.jit
def _field(w, AT: tl.constexpr, LOG_GAIN: tl.constexpr, MASK: tl.constexpr, ASM: tl.constexpr):
    """``((w >> AT) & MASK) / 2^LOG_GAIN`` in fp32, exact, with no shift: the bits in place OR-ed into
    2^(23 − AT − LOG_GAIN) (one LOP3) are that number plus the field's value, which one FADD leaves."""
    magic = tl.full(w.shape, (150 - AT - LOG_GAIN) << 23, tl.int32)
    return _and_or(w, MASK << AT, magic, ASM).to(tl.float32, bitcast=True) - magic.to(tl.float32, bitcast=True)


@triton.jit
def _field_at(w, at, LOG_GAIN: tl.constexpr, MASK: tl.constexpr, ASM: tl.constexpr):
    """The same with ``at`` a tensor (no constant): the field shifted down first."""
    magic = tl.full(w.shape, (150 - LOG_GAIN) << 23, tl.int32)
    return _and_or(w >> at, MASK, magic, ASM).to(tl.float32, bitcast=True) - magic.to(tl.float32, bitcast=True)


@triton.jit
def _table(tab_ptr, LDS: tl.constexpr):
    """The shared table as a program reads it: its pointer (L1), or (LDS) a copy held, read through shared memory."""
    if LDS:
        return tl.load(tab_ptr + tl.arange(0, TABLE_ENTRIES))
    else:
        return tab_ptr


@triton.jit
def _lookup(tab, i, LDS: tl.constexpr):
    """``table[i]`` for an index tensor ``i`` of any shape (``tab``: :func:`_table`'s)."""
    if LDS:
        return tl.reshape(tl.gather(tab, tl.reshape(i, [i.numel]), 0), i.shape)
    else:
        return tl.load(tab + i)


@triton.jit
def _halves(e):   # a table entry (int64) → its words: coordinates 0–3, coordinates 4–7
    return e.to(tl.int32), (e >> 32).to(tl.int32)


@triton.jit
def _parity7(s, ASM: tl.constexpr):
    """The parity of bits 0–6 of ``s`` (a sign byte's seven signs): one POPC on GPU, xor folds in the interpreter."""
    if ASM:
        n = tl.inline_asm_elementwise("popc.b32 $0, $1;", "=r,r", [s & 127], dtype=tl.int32, is_pure=True, pack=1)
    else:
        n = s & 127
        n = n ^ (n >> 4)
        n = n ^ (n >> 2)
        n = n ^ (n >> 1)
    return n & 1


@triton.jit
def _spread6(v):   # bits 0–3 of v (< 16) to bits 0, 6, 12, 18: the product's four copies of v never overlap
    return (v * 0x8421) & 0x41041


@triton.jit
def _sign_words(s, ASM: tl.constexpr):
    """A sign byte (seven signs, the ±¼'s at bit 7) → the words its pattern entry is xor-ed with: 7 in each
    negated coordinate's field (u → 7 − u), the eighth's by the seven's parity, the ±¼'s sign at bit 31."""
    lo = (_spread6(s & 15) * 7) | ((0 - (s >> 7)) & H_BIT)   # no shift past bit 31
    hi = _spread6(((s >> 4) & 7) | (_parity7(s, ASM) << 3)) * 7
    return lo, hi


@triton.jit
def _e8p_words(c, tab, LDS: tl.constexpr, ASM: tl.constexpr):
    """16-bit E8P codes (int32) → their pattern entry xor their sign byte's words, as two int32 words
    (coordinates 0–3, 4–7): coordinate j = u_j − 7/2 ± ¼, the ¼'s sign at bit 31 (codebook.table_words)."""
    lo, hi = _halves(_lookup(tab, c & 255, LDS))
    s_lo, s_hi = _sign_words((c >> 8) & 255, ASM)
    return lo ^ s_lo, hi ^ s_hi


@triton.jit
def _e8p_offset(u):
    """7/2 − the ±¼ of E8P words: 3.25, or 3.75 where bit 31 is set."""
    return tl.where(u < 0, 3.75, 3.25)


@triton.jit
def _codes(ca_ptr, cb_ptr, off, mask, BITS: tl.constexpr):
    """Code planes of blocks ``off``: plane A as int32, and the ball's (3 bits; else plane A again)."""
    ca = tl.load(ca_ptr + off, mask=mask, other=0).to(tl.int32)
    cb = ca
    if BITS == 3:
        cb = tl.load(cb_ptr + off, mask=mask, other=0).to(tl.int32)
    return ca, cb


@triton.jit
def _decode_words(ca, cb, tab, BITS: tl.constexpr, LDS: tl.constexpr, ASM: tl.constexpr):
    # (lo, hi): coordinate j is field j % 4 of lo (j < 4) or hi over the gain, less _constant; two stages
    # in one field, the first's ×4 plus the second's (≤ 40: no carry); ±¼ signs at bit 31 (stage 1's in hi at 4 bits)
    lo, hi = _e8p_words(ca, tab, LDS, ASM)
    if BITS == 3:
        b_lo, b_hi = _halves(_lookup(tab, (cb & 255) + BALL_AT, LDS))
        lo, hi = ((lo << 2) + b_lo) | (lo & H_BIT), (hi << 2) + b_hi
    elif BITS == 4:
        lo2, hi2 = _e8p_words(ca >> 16, tab, LDS, ASM)
        lo, hi = (lo << 2) + lo2, ((hi << 2) + hi2) | (lo & H_BIT)
    return lo, hi


@triton.jit
def _constant(lo, hi, BITS: tl.constexpr):
    # what a coordinate is less than its field over the gain: 7/2 ∓ ¼, + the ball's 8/4 or a second E8P's (7/2 ∓ ¼)/4
    if BITS == 2:
        c = _e8p_offset(lo)
    elif BITS == 3:
        c = _e8p_offset(lo) + 2.0
    else:
        c = _e8p_offset(hi) + 0.25 * _e8p_offset(lo)
    return c


@triton.jit
def _words(ca_ptr, cb_ptr, tab, off, mask, BITS: tl.constexpr, LDS: tl.constexpr, ASM: tl.constexpr):
    """Codes of blocks ``off`` → :func:`_decode_words`."""
    ca, cb = _codes(ca_ptr, cb_ptr, off, mask, BITS)
    return _decode_words(ca, cb, tab, BITS, LDS, ASM)


@triton.jit
def _coordinate(lo, hi, j: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr):
    """Coordinate ``j`` (a constant) plus :func:`_constant`, exact."""
    if j < 4:
        w = lo
    else:
        w = hi
    if BITS == 2:
        v = _field(w, 6 * (j % 4), 0, 7, ASM)
    elif j % 4 == 3:   # bits 18–23: the top one would land on the exponent, so read it 6 bits lower
        v = _field(w >> 6, 12, 2, 63, ASM)
    else:
        v = _field(w, 6 * (j % 4), 2, 63, ASM)
    return v


@triton.jit
def _points(lo, hi, j, BITS: tl.constexpr, ASM: tl.constexpr):
    """Coordinates ``j`` (an index tensor) of the blocks' points, exact: fields shifted down, less the constant."""
    c = _constant(lo, hi, BITS)
    w = tl.where(j < 4, lo, hi)
    if BITS == 2:
        v = _field_at(w, 6 * (j % 4), 0, 7, ASM)
    else:
        v = _field_at(w, 6 * (j % 4), 2, 63, ASM)
    return v - c


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
                    CODED: tl.constexpr, LDS: tl.constexpr, AHEAD: tl.constexpr):
    """y = x·Wᵀ (+ bias) on SIMT lanes for a few rows of x: a program per BN output rows × K split × BM rows
    of x, BKB blocks a K step (AHEAD: its codes loaded a step before), the table read as :func:`_table`
    says. A block's point is its fields (both stages' in one) less one constant, so a weight costs a
    LOP3, an FADD and an FFMA at every width: each row of x takes Σ_j x_j · fields_j (exact products)
    less the constant · Σ_j x_j, then times the block's scale."""
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
    tab = _table(tab_ptr, LDS)
    acc = tl.zeros([BM, BKB, BN], dtype=tl.float32)
    if AHEAD:   # (a scalar bool & a bool tensor is int in the interpreter: the step's bound is a row limit)
        b = t_beg * BKB + kb3
        na, nb = _codes(ca_ptr, cb_ptr, b * N_PAD + rn3, (b < KB) & (rn3 < tl.where(t_beg < t_end, N_PAD, 0)), BITS)
    for t in range(t_beg, t_end):
        b = t * BKB + kb3
        bmask = (b < KB) & nmask
        if AHEAD:
            ca, cb = na, nb
            na, nb = _codes(ca_ptr, cb_ptr, (b + BKB) * N_PAD + rn3,
                            (b + BKB < KB) & (rn3 < tl.where(t + 1 < t_end, N_PAD, 0)), BITS)
        else:
            ca, cb = _codes(ca_ptr, cb_ptr, b * N_PAD + rn3, bmask, BITS)
        lo, hi = _decode_words(ca, cb, tab, BITS, LDS, ASM)
        c = _constant(lo, hi, BITS)
        if GROUP % (8 * BKB) == 0:       # the step lies in one group: one scale per row
            sc = _group_scale(sp, (8 * BKB * t) // GROUP, rs, nmask, CODED, ASM)
        else:
            sc = _group_scale(sp, (8 * b) // GROUP, rs, bmask, CODED, ASM)
        xb = xrow + 8 * b
        xm = mmask & (b < KB)
        part = tl.zeros([BM, BKB, BN], dtype=tl.float32)
        xsum = tl.zeros([BM, BKB, 1], dtype=tl.float32)
        for j in tl.static_range(8):
            xs = tl.load(xb + j, mask=xm, other=0.0).to(tl.float32)
            xsum += xs
            part += xs * _coordinate(lo, hi, j, BITS, ASM)
        acc += (part - c * xsum) * sc
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
            lo, hi = _words(ca_ptr, cb_ptr, tab_ptr, b3 * N_PAD + rn3, (b3 < KB) & (rn3 < N_PAD), BITS, False, ASM)
            v = _points(lo, hi, j3, BITS, ASM)                                  # [GKB, 8, BN]
            w = tl.reshape(v, [8 * GKB, BN]).to(DT)
            cols = 8 * b0 + kk
            xs = tl.load(xrow + cols[None, :], mask=mmask & (cols < K)[None, :], other=0.0).to(DT)
            # a chunk past K (ragged last step) reads no scale: past the last group lies garbage
            # (the interpreter folds a scalar bool & a bool tensor into an int: a limit instead)
            sc = _group_scale(sp, (8 * b0) // GROUP, rn % 16, rn < tl.where(b0 < KB, N_PAD, 0), CODED, ASM)
            acc += tl.dot(xs, w) * sc[None, :]
    _epilogue(acc, y_ptr, b_ptr, ws_ptr, cnt_ptr, rm, rn, M, N, stride_ym, N_PAD, M_WS, pid_k,
              tl.program_id(1) * tl.num_programs(0) + tl.program_id(0), SPLIT, HAS_BIAS)


@triton.jit(do_not_specialize=("KB", "NGP"))
def _e8_dequant_kernel(w_ptr, ca_ptr, cb_ptr, s_ptr, tab_ptr, ROW0, ROW1, K, KB, stride_wn, N_PAD, NGP,
                       BITS: tl.constexpr, GROUP: tl.constexpr, BN: tl.constexpr, BKB: tl.constexpr,
                       ASM: tl.constexpr, CODED: tl.constexpr):
    """Rows ROW0 .. ROW1 − 1 of the layer → rows 0 .. of ``w`` [R, K] (fp16/bf16): each point times its
    group's scale in fp32 (exact: ≤ 7 significant bits times fp16's 11), rounded once, as
    ``dequantize(w).to(dtype)``. One program: BN rows × BKB blocks, stored along K."""
    rn = ROW0 + tl.program_id(0) * BN + tl.arange(0, BN)
    b3 = tl.program_id(1) * BKB + tl.arange(0, BKB)[:, None, None]
    rn3 = rn[None, None, :]
    pm = (b3 < KB) & (rn3 < N_PAD)
    lo, hi = _words(ca_ptr, cb_ptr, tab_ptr, b3 * N_PAD + rn3, pm, BITS, False, ASM)
    v = _points(lo, hi, tl.arange(0, 8)[None, :, None], BITS, ASM)                  # [BKB, 8, BN]
    sp = _scale_base(s_ptr, rn3 // 16, rn3 % 16, NGP, CODED)
    v = v * _group_scale(sp, (8 * b3) // GROUP, rn3 % 16, pm, CODED, ASM)
    cols = tl.program_id(1) * (8 * BKB) + tl.arange(0, 8 * BKB)
    wv = tl.trans(tl.reshape(v, [8 * BKB, BN]))                                      # [BN, 8·BKB], along K
    tl.store(w_ptr + (rn - ROW0).to(tl.int64)[:, None] * stride_wn + cols[None, :],
             _round(wv, w_ptr.dtype.element_ty), mask=(rn < ROW1)[:, None] & (cols < K)[None, :])
