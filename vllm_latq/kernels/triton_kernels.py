"""Triton GPU kernels for latq dense + outlier linears (issue 5).

Two kernels read one load-time layout (:mod:`~vllm_latq.kernels.triton_layout`: 16×16
word blocks, 3 bits as a 2-bit + 1-bit plane, outliers as ELL-16 or CSR):

``_gemv_kernel`` — M = 1..7 (SIMT, no tensor cores)
    One program per BN output rows (× a K split × an M tile). Per K step it loads one
    [16 words × BN rows] int32 tile per plane (16-byte vector loads of contiguous 1 KiB
    blocks, prefetched one step ahead by hand); slot j of the tile is the 16-column slab
    ``k0 + 16j + [0, 16)``. A value is dequantised with no shift and no int→float convert:
    ``(word & (2^b−1) << P) | bits(2^(23−P))`` *is* the fp32 number 2^(23−P) + u (the
    mantissa unit of 2^(23−P) is 2^−P; P < 16: the step runs over the words' two 16-bit
    halves, each shifted down once), so one FADD gives z = u − 2^(b−1) exactly, and the
    mask + OR is one LOP3 (inline ``lop3.b32``). Per weight: 1 LOP3, 1 FADD, and one FFMA
    per activation row (3 bits: + 1 shift + 1 LOP3 to merge the 1-bit plane). At M = 1 the
    products accumulate per (slab lane, row) over the slabs of a scale group and are scaled
    once (``acc += part · s``, fp16 scales widened); at M > 1, z·s is formed once and
    shared by the rows. The slab-lane axis is reduced once at the end, so the K loop has no
    cross-thread traffic, no shared memory and no barrier. Split-K (``SPLIT`` programs per
    row tile, for long K / small N) writes fp32 partials; the last program of a tile (an
    acq_rel atomic ticket) sums them in fixed order, adds the bias and stores — one launch,
    deterministic, tickets self-reset. Outliers of the program's rows are added by the same
    program (16 ELL slots or 16 CSR entries per iteration, spread over the K splits), into
    the same accumulator.

``_mma_kernel`` — M ≥ 8 (tensor cores; 8 is padded to the 16-row MMA, 9..16 likewise)
    Same word tiles. Per group of ≤ 8 slabs (one scale group, ≤ 128 columns; 64 at 3 bits,
    where the 512-column step runs as a runtime loop over its four 128-column quarters, for
    registers) the [DS·16 × BN] B operand is built in registers by broadcasting per-slab
    shifts over the word tile ([DS, 16, BN] → reshape: K order k0 + 16j + w, the activation
    order, so the activation tile is one contiguous load). The integers z = u − 2^(b−1) are
    exact in fp16 and bf16, so ``tl.dot(x_tile, z_tile)`` multiplies exactly and accumulates
    in fp32, and the group's dot is scaled once (``acc += dot · s``): the result is the fp32
    reference up to summation order — no fp16/bf16 rounding of z·s. Operands are fp16/bf16 on
    GPU (bf16 native); in the interpreter (no bf16 arithmetic) both are cast to fp32 right
    after loading. Outliers run on SIMT lanes after the K loop of the same program
    ([BM × BR × BN] activation gathers reduced over BR, or CSR entries routed one-hot).
    **Larger M** (> 16) is the documented fallback: the same kernel over 16-row M tiles, a
    tiled GEMM that re-dequantises each weight tile per M tile (BM = 32/64 spill on sm_90 at
    3 bits). For prefill-sized M a dequantise-once + cuBLAS path would amortise the dequant,
    at the price of rounding z·s to bf16 (so not equal to the fp32 reference); not built.

fp32 activations use the SIMT kernel for every M (tiles of 8 rows): exact, no TF32.
Everything is checked against :func:`~vllm_latq.kernels.reference.latq_linear_ref` in the
interpreter (tests/test_triton.py) and compiled offline for sm_80/86/89/90
(:mod:`~vllm_latq.kernels.triton_compile`, ``bench/kernels.py``).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import triton_layout as tlay
from .reference import LatqWeight
from .selector import LatqKernel

log = logging.getLogger(__name__)
MAX_SPLIT = 8
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
ENV_INTERPRET_OK = "LATQ_TRITON_INTERPRET_OK"   # =1: accept CPU tensors when TRITON_INTERPRET=1
OUTL_NONE, OUTL_ELL, OUTL_CSR = 0, 1, 2
OUTL_CODE = {"none": OUTL_NONE, "ell": OUTL_ELL, "csr": OUTL_CSR}


# ============================================================================ device code

@triton.jit
def _and_or(a, MASK: tl.constexpr, c, ASM: tl.constexpr):
    """``(a & MASK) | c``. On GPU one ``lop3.b32`` (LUT 0xEA = (a & b) | c): written as two
    PTX ops, ptxas keeps two LOP3s because it cannot encode two constants in one. In the
    interpreter (no inline asm) plain integer ops."""
    if ASM:
        return tl.inline_asm_elementwise("lop3.b32 $0, $1, $2, $3, 0xEA;", "=r,r,r,r",
                                         [a, tl.full(a.shape, MASK, tl.int32), c],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        return (a & MASK) | c


@triton.jit
def _fbits(lo, hi, P: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr):
    """Slot at bit P of a 16-bit half of the plane-A word tile ``lo`` (3 bits: plus its bit
    P/2 of the 1-bit tile ``hi``, pre-shifted by the caller) → int32 bits of the fp32 number
    2^(23−P) + u: u sits at bits [P, P+b) of the word and is OR-ed, in place, into the bits
    of 2^(23−P), whose mantissa unit is 2^−P — so no shift is needed for 2/4 bits."""
    magic = tl.full(lo.shape, (150 - P) << 23, tl.int32)    # fp32 bits of 2^(23−P)
    if BITS == 4:
        r = _and_or(lo, 15 << P, magic, ASM)
    elif BITS == 2:
        r = _and_or(lo, 3 << P, magic, ASM)
    else:
        # hi bit P/2 → bit P + 2 (shift left by P/2 + 2), then both into the magic
        r = _and_or(lo, 3 << P, _and_or(hi << (P // 2 + 2), 4 << P, magic, ASM), ASM)
    return r


@triton.jit
def _finish(acc, y_ptr, b_ptr, rm, rn, M, N, stride_ym, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    omask = (rm < M)[:, None] & (rn < N)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _epilogue(acc, y_ptr, b_ptr, ws_ptr, cnt_ptr, rm, rn, M, N, stride_ym, N_PAD, M_WS, pid_k, tile,
              SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """fp32 ``acc`` [BM, BN] → y (+ bias). SPLIT > 1: partials to the workspace, and the last
    of the SPLIT programs of this tile (acq_rel ticket) reduces them in fixed order."""
    if SPLIT == 1:
        _finish(acc, y_ptr, b_ptr, rm, rn, M, N, stride_ym, HAS_BIAS)
    else:
        wmask = (rm < M_WS)[:, None] & (rn < N_PAD)[None, :]
        wsp = ws_ptr + rm[:, None] * N_PAD + rn[None, :]
        tl.store(wsp + pid_k * M_WS * N_PAD, acc, mask=wmask)
        tl.debug_barrier()
        ticket = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if ticket == SPLIT - 1:
            tot = tl.load(wsp, mask=wmask, other=0.0, cache_modifier=".cg")
            for s in range(1, SPLIT):
                tot += tl.load(wsp + s * M_WS * N_PAD, mask=wmask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(cnt_ptr + tile, 0)
            _finish(tot, y_ptr, b_ptr, rm, rn, M, N, stride_ym, HAS_BIAS)


@triton.jit
def _gemv_kernel(x_ptr, y_ptr, b_ptr, pa_ptr, ph_ptr, s_ptr,
                 o0_ptr, o1_ptr, o2_ptr, o3_ptr, ws_ptr, cnt_ptr,
                 M, N, K, stride_xm, stride_ym, N_PAD, NCH_A, NCH_H, NGP, NSTEPS, M_WS,
                 BITS: tl.constexpr, GROUP: tl.constexpr, SPG: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr,
                 OUTL: tl.constexpr, HAS_BIAS: tl.constexpr, ASM: tl.constexpr):
    # Every tensor of the K loop is 3-D [BM rows of x, 16 slab lanes, BN output rows] (or a
    # broadcastable slice of it), so the word tiles' coalesced layout (16-byte vectors along
    # BN) is the layout of the whole loop: no layout conversion, no shared memory, no barrier.
    SLABS: tl.constexpr = 32 if BITS == 3 else 32 // BITS     # 16-column slabs per K step
    STEP: tl.constexpr = 16 * SLABS
    SPH: tl.constexpr = 8 if BITS == 3 else 16 // BITS         # slabs per 16-bit half word
    NH: tl.constexpr = SLABS // SPH                            # halves per step
    FL: tl.constexpr = SPG if SPG < SPH else SPH               # slabs per scale application
    OFF: tl.constexpr = 1 << (BITS - 1)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rn = pid_n * BN + tl.arange(0, BN)
    rm = pid_m * BM + tl.arange(0, BM)
    w16 = tl.arange(0, 16)
    g16 = rn // 16
    r16 = rn % 16
    rn3 = rn[None, None, :]                                        # [1, 1, BN]
    w3 = w16[None, :, None]                                        # [1, 16, 1]
    rm3 = rm[:, None, None]                                        # [BM, 1, 1]
    xrow = x_ptr + rm3 * stride_xm
    mmask = rm3 < M
    # word-tile pointers of chunk 0: ((g·NCH + c)·16 + w)·16 + r
    ta = pa_ptr + (g16 * (NCH_A * 256) + r16)[None, None, :] + w3 * 16
    th = ph_ptr + (g16 * (NCH_H * 256) + r16)[None, None, :] + w3 * 16
    sp = s_ptr + (g16 * (NGP * 16) + r16)[None, None, :]           # scales of group 0

    SPS = tl.cdiv(NSTEPS, SPLIT)                                  # K steps per split
    s_beg = pid_k * SPS
    s_end = tl.minimum(s_beg + SPS, NSTEPS)
    CA: tl.constexpr = 512 if BITS == 3 else 256                   # plane-A words per step per row group
    # (a scalar bool & a bool tensor is int in the interpreter: fold conditions into limits)
    pm = (rn3 < tl.where(s_beg < s_end, N_PAD, 0)) & (w3 < 16)
    wa_n = tl.load(ta + s_beg * CA, mask=pm, other=0)
    wb_n = wa_n
    wh_n = wa_n
    if BITS == 3:
        wb_n = tl.load(ta + s_beg * CA + 256, mask=pm, other=0)
        wh_n = tl.load(th + s_beg * 256, mask=pm, other=0)
    acc = tl.zeros([BM, 16, BN], dtype=tl.float32)
    for s in range(s_beg, s_end):
        wa = wa_n
        wb = wb_n
        wh = wh_n
        pm = (rn3 < tl.where(s + 1 < s_end, N_PAD, 0)) & (w3 < 16)
        wa_n = tl.load(ta + (s + 1) * CA, mask=pm, other=0)           # prefetch the next step
        if BITS == 3:
            wb_n = tl.load(ta + (s + 1) * CA + 256, mask=pm, other=0)
            wh_n = tl.load(th + (s + 1) * 256, mask=pm, other=0)
        k0 = s * STEP
        # Runtime loop over the 16-bit halves of the plane-A words (3 bits: 2 word tiles × 2
        # halves), static over the SPH slots of a half: a quarter / half of the unrolled code
        # of a whole step, so ptxas cannot hoist a whole step's activation loads (measured:
        # fully unrolled 3-bit steps spill on sm_90 at any register cap).
        for h in range(NH):
            if BITS == 3:
                lo = tl.where(h < 2, wa, wb) >> (16 * (h % 2))
                hi = wh >> (16 * (h // 2) + 8 * (h % 2))     # 1-bit slot 16c + 8·hh + i at bit i
            else:
                lo = wa >> (16 * h)
                hi = lo
            if BM == 1:
                part = tl.zeros([BM, 16, BN], dtype=tl.float32)
            for i in tl.static_range(SPH):
                P = (2 if BITS == 3 else BITS) * i
                f = _fbits(lo, hi, P, BITS, ASM)
                z = f.to(tl.float32, bitcast=True) - ((1 << (23 - P)) + OFF)      # z = u − o, exact
                j = h * SPH + i
                kk = k0 + 16 * j + w3
                xs = tl.load(xrow + kk, mask=mmask & (kk < K), other=0.0).to(tl.float32)    # [BM, 16, 1]
                if BM == 1:
                    # one activation row: accumulate z·x per group, scale once per group
                    # (per weight: LOP3 + FADD + FFMA, no FMUL)
                    part += z * xs
                    if (i + 1) % FL == 0:
                        gi = (k0 + 16 * (j + 1 - FL)) // GROUP
                        sc = tl.load(sp + gi * 16, mask=rn3 < N_PAD, other=0.0).to(tl.float32)   # [1, 1, BN]
                        acc += part * sc
                        part = tl.zeros([BM, 16, BN], dtype=tl.float32)
                else:
                    # several rows: scale z once (FMUL amortised over the BM FFMAs) and keep a
                    # single accumulator (half the registers of part + acc)
                    if i % FL == 0:
                        gi = (k0 + 16 * j) // GROUP
                        sc = tl.load(sp + gi * 16, mask=rn3 < N_PAD, other=0.0).to(tl.float32)
                    acc += (z * sc) * xs

    # ---- outliers of these rows (same accumulator; entries spread over the K splits)
    if OUTL == 1:      # ELL-16: o0 = off [G+1], o1 = col, o2 = val
        gm = rn < N_PAD
        e0 = tl.load(o0_ptr + g16, mask=gm, other=0)
        cnt = (tl.load(o0_ptr + g16 + 1, mask=gm, other=0) - e0) // 16
        rmax = tl.max(cnt, axis=0)
        e03 = (e0 + r16)[None, None, :]
        cnt3 = cnt[None, None, :]
        for r0 in range(pid_k * 16, rmax, SPLIT * 16):
            rr = r0 + w3                                                        # [1, 16, 1]
            em = rr < cnt3                                                      # [1, 16, BN]
            idx = e03 + rr * 16
            col = tl.load(o1_ptr + idx, mask=em, other=0)
            val = tl.load(o2_ptr + idx, mask=em, other=0.0)
            xg = tl.load(xrow + col, mask=mmask & em, other=0.0).to(tl.float32)  # [BM, 16, BN]
            acc += val * xg
    elif OUTL == 2:    # CSR: o0 = crow [N_PAD+1], o1 = row, o2 = col, o3 = val
        n0 = pid_n * BN
        e0 = tl.load(o0_ptr + n0)
        e1 = tl.load(o0_ptr + tl.minimum(n0 + BN, N_PAD))
        for e in range(e0 + pid_k * 16, e1, SPLIT * 16):
            ee = e + w3                                                         # [1, 16, 1]
            em = ee < e1
            row = tl.load(o1_ptr + ee, mask=em, other=-1)
            col = tl.load(o2_ptr + ee, mask=em, other=0)
            val = tl.load(o3_ptr + ee, mask=em, other=0.0)
            xg = tl.load(xrow + col, mask=mmask & em, other=0.0).to(tl.float32)  # [BM, 16, 1]
            acc += tl.where(row == rn3, xg * val, 0.0)                          # one-hot routing

    out = tl.sum(acc, axis=1)
    _epilogue(out, y_ptr, b_ptr, ws_ptr, cnt_ptr, rm, rn, M, N, stride_ym, N_PAD, M_WS, pid_k,
              pid_m * tl.num_programs(0) + pid_n, SPLIT, HAS_BIAS)


@triton.jit
def _zslabs(wa, wb, wh, Q: tl.constexpr, DS: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr,
            DT: tl.constexpr):
    """Slabs [Q·DS, Q·DS + DS) of a step, dequantised to exact integers z = u − 2^(b−1) in
    DT: [DS, 16, BN] from the [1, 16, BN] word tiles (per-slab shift amounts broadcast along
    the first axis). u is OR-ed into the bits of 2^23 (one LOP3) and 2^23 + 2^(b−1)
    subtracted (one FADD): no integer → float conversion."""
    jj = Q * DS + tl.arange(0, DS)[:, None, None]                # slab index j
    magic = tl.full([DS, 16, wa.shape[2]], 0x4B000000, tl.int32)
    if BITS == 4:
        f = _and_or(wa >> (4 * jj), 15, magic, ASM)
    elif BITS == 2:
        f = _and_or(wa >> (2 * jj), 3, magic, ASM)
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
def _mma_kernel(x_ptr, y_ptr, b_ptr, pa_ptr, ph_ptr, s_ptr,
                o0_ptr, o1_ptr, o2_ptr, o3_ptr, ws_ptr, cnt_ptr,
                M, N, K, stride_xm, stride_ym, N_PAD, NCH_A, NCH_H, NGP, NSTEPS, M_WS,
                BITS: tl.constexpr, GROUP: tl.constexpr, SPG: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr,
                OUTL: tl.constexpr, HAS_BIAS: tl.constexpr, BR: tl.constexpr, F32DOT: tl.constexpr,
                ASM: tl.constexpr):
    # Per K step and per DS slabs (≤ 128 columns, one scale group): the [DS·16, BN] B tile is
    # built in registers from the step's word tiles by broadcasting per-slab shifts
    # ([DS, 16, BN] → reshape, K order k0 + 16j + w = the activation order), then ONE tl.dot
    # with the contiguous [BM, DS·16] activation tile: one shared-memory staging per 128
    # columns (Triton's MMAv2 operand path) instead of one per 16-column slab.
    SLABS: tl.constexpr = 32 if BITS == 3 else 32 // BITS     # 16-column slabs per K step
    STEP: tl.constexpr = 16 * SLABS
    DSMAX: tl.constexpr = 4 if BITS == 3 else 8                # 3 bits: K = 64 per dot (registers)
    DS: tl.constexpr = SPG if SPG < DSMAX else DSMAX           # slabs per tl.dot
    ND: tl.constexpr = SLABS // DS                             # dots per step
    DPG: tl.constexpr = SPG // DS                              # dots per scale group
    if F32DOT:
        DT: tl.constexpr = tl.float32
    else:
        DT: tl.constexpr = x_ptr.dtype.element_ty
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rn = pid_n * BN + tl.arange(0, BN)
    rm = pid_m * BM + tl.arange(0, BM)
    w16 = tl.arange(0, 16)
    kd = tl.arange(0, DS * 16)
    g16 = rn // 16
    r16 = rn % 16
    rn3 = rn[None, None, :]
    w3 = w16[None, :, None]
    xrow = x_ptr + rm[:, None] * stride_xm
    mmask = (rm < M)[:, None]
    ta = pa_ptr + (g16 * (NCH_A * 256) + r16)[None, None, :] + w3 * 16
    th = ph_ptr + (g16 * (NCH_H * 256) + r16)[None, None, :] + w3 * 16
    sp = s_ptr + g16 * (NGP * 16) + r16

    SPS = tl.cdiv(NSTEPS, SPLIT)
    s_beg = pid_k * SPS
    s_end = tl.minimum(s_beg + SPS, NSTEPS)
    CA: tl.constexpr = 512 if BITS == 3 else 256
    pm = (rn3 < tl.where(s_beg < s_end, N_PAD, 0)) & (w3 < 16)
    wa_n = tl.load(ta + s_beg * CA, mask=pm, other=0)
    wb_n = wa_n
    wh_n = wa_n
    if BITS == 3:
        wb_n = tl.load(ta + s_beg * CA + 256, mask=pm, other=0)
        wh_n = tl.load(th + s_beg * 256, mask=pm, other=0)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for s in range(s_beg, s_end):
        wa = wa_n
        wb = wb_n
        wh = wh_n
        pm = (rn3 < tl.where(s + 1 < s_end, N_PAD, 0)) & (w3 < 16)
        wa_n = tl.load(ta + (s + 1) * CA, mask=pm, other=0)           # prefetch the next step
        if BITS == 3:
            wb_n = tl.load(ta + (s + 1) * CA + 256, mask=pm, other=0)
            wh_n = tl.load(th + (s + 1) * 256, mask=pm, other=0)
        k0 = s * STEP
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
                    sc = tl.load(sp + (c0 // GROUP) * 16, mask=rn < N_PAD, other=0.0).to(tl.float32)
                    acc += tl.dot(xs, z) * sc[None, :]          # DS·16 columns: one scale group
        else:
            part = tl.zeros([BM, BN], dtype=tl.float32)
            for q in tl.static_range(ND):
                z = tl.reshape(_zslabs(wa, wb, wh, q, DS, BITS, ASM, DT), [DS * 16, BN])
                kk = k0 + q * (DS * 16) + kd
                xs = tl.load(xrow + kk[None, :], mask=mmask & (kk < K)[None, :], other=0.0).to(DT)
                part = tl.dot(xs, z, part)
                if (q + 1) % DPG == 0:
                    gi = (k0 + (q + 1 - DPG) * (DS * 16)) // GROUP
                    sc = tl.load(sp + gi * 16, mask=rn < N_PAD, other=0.0).to(tl.float32)
                    acc += part * sc[None, :]
                    part = tl.zeros([BM, BN], dtype=tl.float32)

    if OUTL != 0:       # outliers on SIMT lanes: [BM, BR, BN] activation gathers, reduced over BR
        oacc = tl.zeros([BM, BN], dtype=tl.float32)
        rb = tl.arange(0, BR)
        if OUTL == 1:
            gm = rn < N_PAD
            e0 = tl.load(o0_ptr + g16, mask=gm, other=0)
            cnt = (tl.load(o0_ptr + g16 + 1, mask=gm, other=0) - e0) // 16
            rmax = tl.max(cnt, axis=0)
            for r0 in range(pid_k * BR, rmax, SPLIT * BR):
                rr = r0 + rb
                em = rr[:, None] < cnt[None, :]                                 # [BR, BN]
                idx = e0[None, :] + rr[:, None] * 16 + r16[None, :]
                col = tl.load(o1_ptr + idx, mask=em, other=0)
                val = tl.load(o2_ptr + idx, mask=em, other=0.0)
                xg = tl.load(xrow[:, :, None] + col[None, :, :], mask=mmask[:, :, None] & em[None, :, :],
                             other=0.0).to(tl.float32)                          # [BM, BR, BN]
                oacc += tl.sum(val[None, :, :] * xg, axis=1)
        else:
            n0 = pid_n * BN
            e0 = tl.load(o0_ptr + n0)
            e1 = tl.load(o0_ptr + tl.minimum(n0 + BN, N_PAD))
            for e in range(e0 + pid_k * BR, e1, SPLIT * BR):
                ee = e + rb
                em = ee < e1
                row = tl.load(o1_ptr + ee, mask=em, other=-1)
                col = tl.load(o2_ptr + ee, mask=em, other=0)
                val = tl.load(o3_ptr + ee, mask=em, other=0.0)
                xg = tl.load(xrow + col[None, :], mask=mmask & em[None, :], other=0.0).to(tl.float32)
                hit = row[:, None] == rn[None, :]                               # [BR, BN]
                oacc += tl.sum(tl.where(hit[None, :, :], (xg * val[None, :])[:, :, None], 0.0), axis=1)
        acc += oacc

    _epilogue(acc, y_ptr, b_ptr, ws_ptr, cnt_ptr, rm, rn, M, N, stride_ym, N_PAD, M_WS, pid_k,
              pid_m * tl.num_programs(0) + pid_n, SPLIT, HAS_BIAS)


# ============================================================================ configs

def spg_of(bits: int, group: int) -> int:
    """Slabs per scale application: the largest power of two dividing group/16, at most the
    slabs of one K step (slab boundaries are multiples of 16·SPG, so all of them lie in one
    group). group % 16 == 0 is required (or a single group: group ≥ K_pad)."""
    slabs = tlay.step_of(bits) // 16
    q = group // 16
    spg = 1
    while spg < slabs and q % (2 * spg) == 0:
        spg *= 2
    return spg


# Autotune configs for Ampere (A100: 108 SMs, 164 KiB smem/SM, 64 K registers/SM;
# A10/A6000/RTX 30xx: 72–84 SMs, 100 KiB). Tiles per activation-row tile BM, chosen from
# offline compilation (ptxas registers; bench/kernels.py prints them): every listed tile
# compiles without spills on sm_80/86/89/90, at ≤ ~128 registers where possible.
#
# SIMT GEMV (BN, warps): register-only (shared memory only for the final cross-warp sum),
# so the knobs are the row tile BN (bytes in flight per program: BN·64 B per plane per step,
# two steps with the prefetch), warps (registers: BM·16·BN fp32 accumulators over 32·warps
# threads), and SPLIT: programs per row tile along K, for when N/BN alone cannot give
# ~2 programs per SM (o/down projections at TP > 1, K ≥ 8k).
GEMV_TILES = {1: [(32, 2), (64, 4), (128, 8)],
              2: [(32, 2), (64, 4), (128, 8)],
              4: [(32, 4), (64, 8)],
              8: [(16, 4)]}
GEMV_SPLITS = (1, 2, 4, 8)
# Tensor-core kernel (BN, warps, BR = outlier slots per iteration), BM = 16: M = 8..16 in one
# tile, larger M in 16-row tiles (the fallback: each M tile re-dequantises its weight tiles;
# BM = 32 and 64 were measured to spill on sm_90 at 3 bits — the accumulator, the group
# partial and a 128-column B tile do not fit next to each other).
MMA_TILES = {16: [(32, 4, 8), (64, 4, 8), (128, 8, 8)]}
MMA_SPLITS = {16: (1, 2, 4)}
# Register caps (.maxnreg) per kernel and bit width. Without a cap ptxas picks an
# occupancy tier (64/72/80/96/128/168 registers) and spills a few bytes to reach it
# (measured: 17 of 864 config × target variants, 8–32 B each); with a cap it allocates up
# to the cap and spills only if the code needs more. 2/4-bit GEMV fits 128 (≥ 16 warps/SM);
# 3-bit GEMV (three word planes, prefetched) and the tensor-core kernel (accumulator, group
# partial, B tile) take what they need (≤ 255).
GEMV_MAXNREG = {2: 128, 3: 255, 4: 128}
MMA_MAXNREG = {2: 255, 3: 255, 4: 255}
# The interpreter runs one config (autotuning needs a GPU); big tiles keep program counts low.
GEMV_INTERP = dict(BN=64, SPLIT=1, num_warps=4)
MMA_INTERP = dict(BN=64, SPLIT=1, BR=8, num_warps=4)


def gemv_configs(bm: int | None = None, bits: int = 4) -> list[dict]:
    return [dict(BN=bn, SPLIT=sp, num_warps=nw, maxnreg=GEMV_MAXNREG[bits]) for b, tiles in GEMV_TILES.items()
            if bm in (None, b) for bn, nw in tiles for sp in GEMV_SPLITS]


def mma_configs(bm: int | None = None, bits: int = 4) -> list[dict]:
    return [dict(BN=bn, SPLIT=sp, BR=br, num_warps=nw, maxnreg=MMA_MAXNREG[bits]) for b, tiles in MMA_TILES.items()
            if bm in (None, b) for bn, nw, br in tiles for sp in MMA_SPLITS[b]]


def _uniq(cfgs):
    out = []
    for c in cfgs:
        if c not in out:
            out.append(c)
    return out


def _prune(configs_for, bits):
    def prune(configs, named_args, **kw):
        bm = named_args.get("BM", kw.get("BM"))
        nsteps = named_args.get("NSTEPS", kw.get("NSTEPS"))
        allowed = configs_for(bm, bits)
        keep = [c for c in configs if dict(c.kwargs, num_warps=c.num_warps, maxnreg=c.maxnreg) in allowed
                and c.kwargs["SPLIT"] <= max(1, nsteps)]
        return keep or configs[:1]
    return prune


def _tuned(kernel, cfgs, configs_for, bits):
    return triton.autotune([triton.Config({k: v for k, v in c.items() if k not in ("num_warps", "maxnreg")},
                                          num_warps=c["num_warps"], num_stages=1, maxnreg=c.get("maxnreg"))
                            for c in _uniq(cfgs)],
                           key=["N_PAD", "K", "BM", "BITS", "OUTL", "GROUP"],
                           prune_configs_by={"early_config_prune": _prune(configs_for, bits)})(kernel)


# per bit width (register caps differ); one M tile (decode): split-K allowed; several M
# tiles: SPLIT = 1 (the tickets cover one row of tiles)
_CONFIGS = {"gemv": gemv_configs, "mma": mma_configs}
_KERNELS = {"gemv": _gemv_kernel, "mma": _mma_kernel}
_TUNED = {(k, one, bits): _tuned(_KERNELS[k], [c for c in _CONFIGS[k](None, bits) if one or c["SPLIT"] == 1],
                                 _CONFIGS[k], bits)
          for k in _KERNELS for one in (True, False) for bits in (2, 3, 4)}


# ============================================================================ host side

@dataclass
class TritonState:
    """Prepared layer, flat (tensor and int fields only) so the vLLM plugin can keep it as
    module buffers + static ints (selector ``flatten``/``unflatten``). See
    :mod:`~vllm_latq.kernels.triton_layout` for the tensors' layout."""
    plane_a: torch.Tensor                 # int32 word blocks: the b-bit plane (3 bits: the 2-bit plane)
    plane_h: torch.Tensor | None          # int32 word blocks: 3 bits: the 1-bit plane
    scales: torch.Tensor                  # fp16 [N_pad/16, ngroups_pad, 16]
    o0: torch.Tensor | None               # ELL: off [G+1]          CSR: crow [N_pad+1]
    o1: torch.Tensor | None               # ELL: col                CSR: row
    o2: torch.Tensor | None               # ELL: val (fp32)         CSR: col
    o3: torch.Tensor | None               #                         CSR: val (fp32)
    tickets: torch.Tensor                 # int32 [N_pad/16] split-K tickets, always back to 0
    bits: int
    group: int
    spg: int
    n: int
    k: int
    n_pad: int
    k_pad: int
    outl: int                             # OUTL_NONE / OUTL_ELL / OUTL_CSR
    nnz: int

    @classmethod
    def from_layout(cls, L: tlay.TritonLayout) -> "TritonState":
        o = L.outliers
        if L.outlier_mode == "ell":
            oo = [o["off"], o["col"], o["val"], None]
        elif L.outlier_mode == "csr":
            oo = [o["crow"], o["row"], o["col"], o["val"]]
        else:
            oo = [None] * 4
        tickets = torch.zeros(L.n_pad // 16, dtype=torch.int32, device=L.scales.device)
        return cls(L.planes[0], L.planes[1] if len(L.planes) > 1 else None, L.scales, *oo, tickets,
                   L.bits, L.group, spg_of(L.bits, L.group), L.n, L.k, L.n_pad, L.k_pad,
                   OUTL_CODE[L.outlier_mode], L.nnz)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def launch(st: TritonState, x2: torch.Tensor, bias: torch.Tensor | None, kernel: str,
           config: dict | None = None) -> torch.Tensor:
    """y [M, N] = x2 [M, K] @ Wᵀ (+ bias) with kernel "gemv" or "mma". ``config``: a fixed
    config (a dict from gemv_configs() / mma_configs(), plus optional "BM"); default: the
    interpreter's fixed config, or autotuning on a GPU. Split-K only for one M tile (the
    tickets cover one row of tiles; for more M tiles there is parallelism enough)."""
    M, K = x2.shape
    dev = x2.device
    y = torch.empty(M, st.n, dtype=x2.dtype, device=dev)
    if M == 0:
        return y
    if kernel == "gemv":
        bm = min(8, _next_pow2(M))
    else:
        bm = 16
    if config is not None and "BM" in config:
        bm = config["BM"]
    m_tiles = triton.cdiv(M, bm)
    spare = st.scales                                   # any tensor for pointers a variant never reads
    optr = [t if t is not None else spare for t in (st.o0, st.o1, st.o2, st.o3)]
    step = tlay.step_of(st.bits)
    nch_a = st.k_pad // (256 if st.bits == 3 else step)
    nch_h = st.k_pad // 512 if st.bits == 3 else 0
    m_ws = m_tiles * bm
    ws = torch.empty(MAX_SPLIT * m_ws * st.n_pad if m_tiles == 1 else 1, dtype=torch.float32, device=dev)
    has_bias = bias is not None
    args = [x2, y, bias if has_bias else y, st.plane_a, st.plane_h if st.plane_h is not None else st.plane_a,
            st.scales, *optr, ws, st.tickets,
            M, st.n, K, x2.stride(0), y.stride(0), st.n_pad, nch_a, nch_h, st.scales.shape[1],
            st.k_pad // step, m_ws]
    meta = dict(BITS=st.bits, GROUP=st.group, SPG=st.spg, BM=bm, OUTL=st.outl,
                HAS_BIAS=has_bias, ASM=not INTERPRET)
    if kernel == "mma":
        meta["F32DOT"] = INTERPRET or x2.dtype == torch.float32

    def grid(META):
        return (triton.cdiv(st.n_pad, META["BN"]), META["SPLIT"], m_tiles)

    if config is None and INTERPRET:
        config = dict(GEMV_INTERP if kernel == "gemv" else MMA_INTERP)
    if config is None:
        _TUNED[kernel, m_tiles == 1, st.bits][grid](*args, **meta)
    else:
        cfg = {k: v for k, v in config.items() if k not in ("BM", "num_warps", "num_stages", "maxnreg")}
        if cfg["SPLIT"] > MAX_SPLIT or (cfg["SPLIT"] > 1 and m_tiles > 1):
            raise ValueError(f"SPLIT must be ≤ {MAX_SPLIT}, and 1 when M spans several tiles")
        fn = _gemv_kernel if kernel == "gemv" else _mma_kernel
        cap = config.get("maxnreg", (GEMV_MAXNREG if kernel == "gemv" else MMA_MAXNREG)[st.bits])
        opts = {"maxnreg": cap} if cap and not INTERPRET else {}
        fn[grid(cfg)](*args, **meta, **cfg, num_warps=config.get("num_warps", 4),
                      num_stages=config.get("num_stages", 1), **opts)
    return y


class TritonKernel(LatqKernel):
    """Triton GPU kernels: SIMT GEMV (M ≤ 7), tensor-core GEMM (M ≥ 8), fused outliers."""
    name = "triton"
    state_cls = TritonState

    @classmethod
    def can_implement(cls, w: LatqWeight, device: torch.device, act_dtype: torch.dtype):
        device = torch.device(device)
        if device.type != "cuda":
            if not (INTERPRET and os.environ.get(ENV_INTERPRET_OK) == "1"):
                return False, (f"needs a CUDA device (got {device.type}); for CPU tensors set "
                               f"TRITON_INTERPRET=1 and {ENV_INTERPRET_OK}=1 (Triton interpreter)")
        elif torch.cuda.get_device_capability(device) < (8, 0):
            return False, f"needs compute capability ≥ 8.0 (got {torch.cuda.get_device_capability(device)})"
        if w.bits not in (2, 3, 4):
            return False, f"{w.bits}-bit inliers (kernels exist for 2, 3, 4)"
        if act_dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return False, f"activation dtype {act_dtype}"
        if w.scales.shape[1] > 1 and w.group_size % 16:
            return False, f"group size {w.group_size} is not a multiple of 16"
        if w.out_features * w.in_features >= 2**35 or w.nnz >= 2**31 // 16:
            return False, "layer too large for int32 offsets"
        return True, None

    @classmethod
    def prepare(cls, w: LatqWeight, outlier_mode: str | None = None) -> TritonState:
        L = tlay.build(w, outlier_mode)
        log.debug("latq triton layout %dx%d %d-bit: outliers %s", w.out_features, w.in_features, w.bits,
                  L.outlier_reason)
        return TritonState.from_layout(L)

    @classmethod
    def apply(cls, state: TritonState, x: torch.Tensor, bias: torch.Tensor | None = None,
              kernel: str | None = None, config: dict | None = None) -> torch.Tensor:
        K = state.k
        if x.shape[-1] != K:
            raise ValueError(f"x has {x.shape[-1]} features, layer expects {K}")
        x2 = x.reshape(-1, K)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        if kernel is None:
            kernel = "gemv" if (x2.shape[0] < 8 or x2.dtype == torch.float32) else "mma"
        y = launch(state, x2, bias, kernel, config)
        return y.reshape(*x.shape[:-1], state.n)
