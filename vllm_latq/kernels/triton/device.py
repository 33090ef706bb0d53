"""Device code of the Triton kernels: the SIMT GEMV and the helpers the tensor-core, dequantize
and grouped MoE kernels share. Only ``@triton.jit`` functions live here, because
:mod:`~tools.triton_compile` fingerprints this code; the host side is
:mod:`~vllm_latq.kernels.triton.kernel`. The K loop's design: docs/KERNELS.md.
"""
from __future__ import annotations

import triton
import triton.language as tl


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
    """Slot at bit P of a 16-bit half of the word tile ``lo`` (3 / 5 bits: plus its bit of the
    pre-shifted 1-bit tile ``hi``) → the int32 bits of the fp32 number 2^(23−P) + u."""
    magic = tl.full(lo.shape, (150 - P) << 23, tl.int32)    # fp32 bits of 2^(23−P)
    if BITS == 4:
        r = _and_or(lo, 15 << P, magic, ASM)
    elif BITS == 2:
        r = _and_or(lo, 3 << P, magic, ASM)
    elif BITS == 5:
        # hi bit P/4 → bit P + 4 (shift left by 3P/4 + 4), then both into the magic
        r = _and_or(lo, 15 << P, _and_or(hi << (3 * P // 4 + 4), 16 << P, magic, ASM), ASM)
    else:
        # hi bit P/2 → bit P + 2 (shift left by P/2 + 2), then both into the magic
        r = _and_or(lo, 3 << P, _and_or(hi << (P // 2 + 2), 4 << P, magic, ASM), ASM)
    return r


@triton.jit
def _row_offset(rows, stride):
    """``rows · stride`` in int64: M·K or M·N passes 2³¹ in a long prefill (a 128k-row
    vocabulary head at 16k tokens), where int32 would wrap to a wrong address."""
    return rows.to(tl.int64) * stride


@triton.jit
def _finish(acc, y_ptr, b_ptr, rm, rn, M, N, stride_ym, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    omask = (rm < M)[:, None] & (rn < N)[None, :]
    tl.store(y_ptr + _row_offset(rm[:, None], stride_ym) + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=omask)


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
def _word_tiles(ta, th, s, s_end, rn3, w3, N_PAD, BITS: tl.constexpr):
    """The [1, 16, BN] word tiles of K step ``s`` (zeros when ``s ≥ s_end``): plane A, its second
    half (3 bits) and the 1-bit plane (3 and 5 bits); 2/4 bits: plane A three times."""
    CA: tl.constexpr = 512 if BITS == 3 else 256                   # plane-A words per step per row group
    # (a scalar bool & a bool tensor is int in the interpreter: fold conditions into limits)
    pm = (rn3 < tl.where(s < s_end, N_PAD, 0)) & (w3 < 16)
    wa = tl.load(ta + s * CA, mask=pm, other=0)
    wb = wa
    wh = wa
    if BITS == 3:
        wb = tl.load(ta + s * CA + 256, mask=pm, other=0)
        wh = tl.load(th + s * 256, mask=pm, other=0)
    elif BITS == 5:
        wh = tl.load(th + (s // 4) * 256, mask=pm, other=0) >> (8 * (s % 4))
    return wa, wb, wh


@triton.jit
def _scale_base(s_ptr, g16, r16, NGP, CODED: tl.constexpr):
    """Where the scales of rows ``16·g16 + r16`` start (group 0): fp16, the row's own scale;
    coded, its slab's three words (``triton_layout``: codes of rows 0–7, 8–15, min | step)."""
    if CODED:
        return s_ptr + g16 * (NGP * 3)
    else:
        return s_ptr + g16 * (NGP * 16) + r16


@triton.jit
def _group_scale(sp, gi, r16, mask, CODED: tl.constexpr, ASM: tl.constexpr):
    """fp32 scale of group ``gi`` of the rows of ``sp`` (``r16``: their row in the slab), 0 where
    ``mask`` is off. Coded: the format's ``fp16(fp32(min) + code · fp32(step))``, the code made a
    float as the weights are (OR-ed into 2^23, one FADD)."""
    if CODED:
        words = sp + gi * 3
        cw = tl.load(words + (r16 >> 3), mask=mask, other=0)
        gw = tl.load(words + 2, mask=mask, other=0)
        magic = tl.full(cw.shape, 0x4B000000, tl.int32)                  # fp32 bits of 2^23
        code = _and_or(cw >> (4 * (r16 & 7)), 15, magic, ASM).to(tl.float32, bitcast=True) - 8388608.0
        smin = (gw & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        step = (gw >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        return (smin + code * step).to(tl.float16).to(tl.float32)
    else:
        return tl.load(sp + gi * 16, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _ell_rows(start_ptr, rn, N_PAD):
    """ELL-16 outliers of rows ``rn``: first slot of each row's 16-row group, the group's slot
    count per row (``R_g``), and its maximum over the rows."""
    g16 = rn // 16
    gm = rn < N_PAD
    e0 = tl.load(start_ptr + g16, mask=gm, other=0)
    cnt = (tl.load(start_ptr + g16 + 1, mask=gm, other=0) - e0) // 16
    return e0, cnt, tl.max(cnt, axis=0)


@triton.jit
def _gemv_step(acc, wa, wb, wh, k0, xrow, mmask, K, sp, rs3, rn3, w3, N_PAD,
               BITS: tl.constexpr, GROUP: tl.constexpr, SPG: tl.constexpr, ONE_ROW: tl.constexpr,
               ASM: tl.constexpr, CODED: tl.constexpr):
    """One K step (columns ``k0 + [0, STEP)``) added to ``acc`` [BM, 16, BN]; 3-bit layers run
    their 4-bit tail through it at BITS = 4. ``ONE_ROW``: sum z·x per scale group, scale once."""
    SLABS: tl.constexpr = 32 if BITS == 3 else (8 if BITS == 5 else 32 // BITS)   # 16-column slabs
    PB: tl.constexpr = 2 if BITS == 3 else (4 if BITS == 5 else BITS)             # plane-A slot bits
    SPH: tl.constexpr = 16 // PB                               # slabs per 16-bit half word
    NH: tl.constexpr = SLABS // SPH                            # halves per step
    FL: tl.constexpr = SPG if SPG < SPH else SPH               # slabs per scale application
    OFF: tl.constexpr = 1 << (BITS - 1)
    # Runtime loop over the 16-bit halves of the plane-A words (3 bits: 2 word tiles × 2
    # halves), static over the SPH slots of a half: a quarter / half of the unrolled code
    # of a whole step, so ptxas cannot hoist a whole step's activation loads (measured:
    # fully unrolled 3-bit steps spill on sm_90 at any register cap).
    for h in range(NH):
        if BITS == 3:
            lo = tl.where(h < 2, wa, wb) >> (16 * (h % 2))
            hi = wh >> (16 * (h // 2) + 8 * (h % 2))     # 1-bit slot 16c + 8·hh + i at bit i
        elif BITS == 5:
            lo = wa >> (16 * h)
            hi = wh >> (4 * h)                            # 1-bit slot 4h + i of the step at bit i
        else:
            lo = wa >> (16 * h)
            hi = lo
        if ONE_ROW:
            part = tl.zeros(acc.shape, dtype=tl.float32)
        for i in tl.static_range(SPH):
            P = PB * i
            f = _fbits(lo, hi, P, BITS, ASM)
            z = f.to(tl.float32, bitcast=True) - ((1 << (23 - P)) + OFF)      # z = u − o, exact
            j = h * SPH + i
            kk = k0 + 16 * j + w3
            xs = tl.load(xrow + kk, mask=mmask & (kk < K), other=0.0).to(tl.float32)    # [BM, 16, 1]
            if ONE_ROW:
                # one activation row: accumulate z·x per group, scale once per group
                # (per weight: LOP3 + FADD + FFMA, no FMUL)
                part += z * xs
                if (i + 1) % FL == 0:
                    gi = (k0 + 16 * (j + 1 - FL)) // GROUP
                    sc = _group_scale(sp, gi, rs3, rn3 < N_PAD, CODED, ASM)                        # [1, 1, BN]
                    acc += part * sc
                    part = tl.zeros(acc.shape, dtype=tl.float32)
            else:
                # several rows: scale z once (FMUL amortised over the BM FFMAs) and keep a
                # single accumulator (half the registers of part + acc)
                if i % FL == 0:
                    gi = (k0 + 16 * j) // GROUP
                    sc = _group_scale(sp, gi, rs3, rn3 < N_PAD, CODED, ASM)
                acc += (z * sc) * xs
    return acc


@triton.jit
def _word_tile_ptrs(plane_ptr, g16, r16, w3, NCH):
    """Pointers of the [1, 16, BN] word tile of chunk 0 of a plane of ``NCH`` chunks
    (address ((g·NCH + c)·16 + w)·16 + r)."""
    return plane_ptr + (g16 * (NCH * 256) + r16)[None, None, :] + w3 * 16


@triton.jit
def _ell_gemv(acc, e0, cnt, col_ptr, val_ptr, xrow, mmask, r16, w3, r_beg, r_end, R_STRIDE: tl.constexpr):
    """ELL-16 outliers added to ``acc`` [BM, 16, BN], 16 slots of each row per trip over the
    slot ranges ``r_beg, r_beg + R_STRIDE, …`` below ``r_end`` (:func:`_ell_rows`: e0, cnt)."""
    e03 = (e0 + r16)[None, None, :]
    cnt3 = cnt[None, None, :]
    for r0 in range(r_beg, r_end, R_STRIDE):
        rr = r0 + w3                                                        # [1, 16, 1]
        em = rr < cnt3                                                      # [1, 16, BN]
        idx = e03 + rr * 16
        col = tl.load(col_ptr + idx, mask=em, other=0)
        val = tl.load(val_ptr + idx, mask=em, other=0.0)
        xg = tl.load(xrow + col, mask=mmask & em, other=0.0).to(tl.float32)  # [BM, 16, BN]
        acc += val * xg
    return acc


@triton.jit
def _csr_gemv(acc, start_ptr, row_ptr, col_ptr, val_ptr, xrow, mmask, n0, rn3, w3, N_PAD, BN: tl.constexpr,
              pid_k, SPLIT: tl.constexpr):
    """CSR outliers of rows ``n0 + [0, BN)`` added to ``acc`` [BM, 16, BN], 16 entries per trip,
    the trips dealt to the K splits; each entry routed to its row by a one-hot compare."""
    e0 = tl.load(start_ptr + n0)
    e1 = tl.load(start_ptr + tl.minimum(n0 + BN, N_PAD))
    for e in range(e0 + pid_k * 16, e1, SPLIT * 16):
        ee = e + w3                                                         # [1, 16, 1]
        em = ee < e1
        row = tl.load(row_ptr + ee, mask=em, other=-1)
        col = tl.load(col_ptr + ee, mask=em, other=0)
        val = tl.load(val_ptr + ee, mask=em, other=0.0)
        xg = tl.load(xrow + col, mask=mmask & em, other=0.0).to(tl.float32)  # [BM, 16, 1]
        acc += tl.where(row == rn3, xg * val, 0.0)
    return acc


# Integers Triton does not specialise (on == 1, on % 16): the batch M (M = 8 and 16 run one
# tile; only row masks read it) and the per-layer step and chunk counts, which only scale
# offsets that are multiples of 256 or bound loops. Specialised, each would compile another
# variant of a tile per value class; the offline compile report compiles them unspecialised.
UNSPECIALIZED = ("M", "NCH_A", "NCH_H", "NGP", "NSTEPS", "TSTEPS")


@triton.jit(do_not_specialize=UNSPECIALIZED)
def _gemv_kernel(x_ptr, y_ptr, b_ptr, pa_ptr, ph_ptr, pt_ptr, s_ptr,
                 start_ptr, row_ptr, col_ptr, val_ptr, ws_ptr, cnt_ptr,
                 M, N, K, stride_xm, stride_ym, N_PAD, NCH_A, NCH_H, NGP, NSTEPS, TSTEPS, M_WS,
                 BITS: tl.constexpr, GROUP: tl.constexpr, SPG: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr,
                 OUTL: tl.constexpr, HAS_BIAS: tl.constexpr, ASM: tl.constexpr, CODED: tl.constexpr):
    """y = x·Wᵀ (+ bias) for M = 1..7 on SIMT lanes: one program per BN output rows × K split ×
    M tile, one word tile per plane and K step (prefetched a step ahead), outliers into the same
    accumulator, split-K partials reduced by the tile's last program (docs/KERNELS.md)."""
    # Every tensor of the K loop is 3-D [BM rows of x, 16 slab lanes, BN output rows] (or a
    # broadcastable slice of it), so the word tiles' coalesced layout (16-byte vectors along
    # BN) is the layout of the whole loop: no layout conversion, no shared memory, no barrier.
    STEP: tl.constexpr = 512 if BITS == 3 else (128 if BITS == 5 else 512 // BITS)
    pid_m = tl.program_id(0)            # M fastest: the M tiles of a weight tile run side by side
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rn = pid_n * BN + tl.arange(0, BN)
    rm = pid_m * BM + tl.arange(0, BM)
    w16 = tl.arange(0, 16)
    g16 = rn // 16
    r16 = rn % 16
    rn3 = rn[None, None, :]                                        # [1, 1, BN]
    w3 = w16[None, :, None]                                        # [1, 16, 1]
    rm3 = rm[:, None, None]                                        # [BM, 1, 1]
    xrow = x_ptr + _row_offset(rm3, stride_xm)
    mmask = rm3 < M
    ta = _word_tile_ptrs(pa_ptr, g16, r16, w3, NCH_A)
    th = _word_tile_ptrs(ph_ptr, g16, r16, w3, NCH_H)
    sp = _scale_base(s_ptr, g16, r16, NGP, CODED)[None, None, :]   # scales of group 0
    rs3 = r16[None, None, :]

    SPS = tl.cdiv(NSTEPS, SPLIT)                                  # K steps per split
    s_beg = pid_k * SPS
    s_end = tl.minimum(s_beg + SPS, NSTEPS)
    wa_n, wb_n, wh_n = _word_tiles(ta, th, s_beg, s_end, rn3, w3, N_PAD, BITS)
    acc = tl.zeros([BM, 16, BN], dtype=tl.float32)
    for s in range(s_beg, s_end):
        wa = wa_n
        wb = wb_n
        wh = wh_n
        wa_n, wb_n, wh_n = _word_tiles(ta, th, s + 1, s_end, rn3, w3, N_PAD, BITS)   # prefetch the next step
        acc = _gemv_step(acc, wa, wb, wh, s * STEP, xrow, mmask, K, sp, rs3, rn3, w3, N_PAD, BITS, GROUP, SPG,
                         BM == 1, ASM, CODED)
    if BITS == 3:
        # the 4-bit tail (< 512 columns from NSTEPS·512, 128 per step), its steps dealt to
        # the splits from the last one, which got the fewest main steps
        tt = _word_tile_ptrs(pt_ptr, g16, r16, w3, TSTEPS)
        for t in range(SPLIT - 1 - pid_k, TSTEPS, SPLIT):
            w4, _, _ = _word_tiles(tt, tt, t, TSTEPS, rn3, w3, N_PAD, 4)
            acc = _gemv_step(acc, w4, w4, w4, NSTEPS * STEP + 128 * t, xrow, mmask, K, sp, rs3, rn3, w3, N_PAD,
                             4, GROUP, SPG, BM == 1, ASM, CODED)

    if OUTL == 1:      # ELL-16: start = off [G+1]
        e0, cnt, rmax = _ell_rows(start_ptr, rn, N_PAD)
        acc = _ell_gemv(acc, e0, cnt, col_ptr, val_ptr, xrow, mmask, r16, w3, pid_k * 16, rmax, SPLIT * 16)
    elif OUTL == 2:    # CSR: start = crow [N_PAD+1]
        acc = _csr_gemv(acc, start_ptr, row_ptr, col_ptr, val_ptr, xrow, mmask, pid_n * BN, rn3, w3, N_PAD, BN,
                        pid_k, SPLIT)

    out = tl.sum(acc, axis=1)
    _epilogue(out, y_ptr, b_ptr, ws_ptr, cnt_ptr, rm, rn, M, N, stride_ym, N_PAD, M_WS, pid_k,
              pid_n * tl.num_programs(0) + pid_m, SPLIT, HAS_BIAS)
