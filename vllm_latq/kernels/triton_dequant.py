"""Large-M path (issue 19): dequantise once into a bf16/fp16 scratch, then one cuBLAS GEMM.

For M above ~16 the tensor-core kernel (``_mma_kernel``) runs one 16-row M tile per
program row and re-dequantises every weight per M tile; its K loop issues ~5 (2/4 bits)
to ~8.5 (3 bits) SASS lane-instructions per weight per tile, against 2 that fit beside
the HMMAs at the tensor-core peak, and a layer larger than L2 is also re-read from HBM per
tile. This path reads the SAME prepared layout (:class:`TritonState`; weights are never
stored twice) and:

1. ``_dequant_kernel``: one program per (BN rows, K step) loads the step's word tiles once
   and writes ``W[n, k] = z · s`` (fp32 product of the exact integer and the widened fp16
   group scale, rounded once to the activation dtype) into a dense ``[N, K]`` scratch;
2. ``_outlier_kernel`` (only with outliers): one program per 16-row group stores
   ``W[row, col] = val`` rounded to the activation dtype. The format keeps the inlier
   integer 0 at every outlier, so ``z·s + val = val`` exactly: a store, not an add.
   ELL padding slots (value 0) are skipped; a real outlier of value 0 leaves ``0·s = 0``;
3. ``torch.nn.functional.linear(x, W, bias)``: cuBLAS on a GPU.

Exactness: the scratch equals ``reference.dequantize(w).to(dtype)`` bit for bit, so ``y``
is the exact GEMM of the activations with the **dtype-rounded weights**. It differs from
the fp32 reference (:func:`~vllm_latq.kernels.reference.latq_linear_ref`, which the GEMV
and MMA kernels match up to summation order) by that one rounding of z·s (≤ ½ ulp of
bf16/fp16 per weight) — the price the MMA kernel's docstring anticipated. fp32 activations
never take this path (they use the exact SIMT kernel; see :func:`large_m_reason`).

The scratch is a :class:`Workspace`: one buffer per (device, dtype), sized to the
largest layer seen and grown on demand, shared by every layer (layers run in stream order);
with a byte cap, larger layers (a vocabulary head: 2·N·K can be ~1 GB) run in row chunks.

Crossover — :func:`large_m_threshold` (a bytes/FLOPs/issue model; per layer)
------------------------------------------------------------------------------
With ``Wq`` the packed bytes (``N·K·b/8`` + fp16 scales ``2·N·⌈K/g⌉`` + ``4·nnz`` compact
outlier entries), ``X = e·M·K`` and ``Y = e·M·N`` the activations in and out (``e`` = 2
bytes), ``W16 = e·N·K`` the scratch, ``T = ⌈M/16⌉`` M tiles, and the device's HBM
bandwidth ``BW``, L2 size ``L2``, dense tensor-core peak ``TC`` and SASS issue rate ``ISSUE``
(SMs × 4 schedulers × 32 lanes × clock)::

    t_mma(M) = max( (R·Wq + X + Y) / BW,                 R = T if Wq > L2 else 1
                    T · (N·K·ipw_b + 17·nnz) / ISSUE,    re-dequantisation per M tile
                    2 · 16T · N·K / TC )                  MMAs on 16-row padded tiles
    t_deq(M) = (Wq + W16) / BW                            dequantise once (write W16)
             + max( (W16 + X + Y) / BW, 2·M·N·K / TC )    cuBLAS re-reads W16

``ipw_b`` (lane-instructions per weight per 16-row tile of the MMA kernel's K loop, from
ptxas/nvdisasm of its tile configs: ``triton_compile``, median over configs, sm_80 and
sm_90 agree within 3 %) is 5.0 / 8.5 / 5.2 at 2 / 3 / 4 bits; an outlier costs 1 + 16
lane-ops per 16-row tile (its gather and FMA per row, as ``triton_layout.outlier_model``
counts). The dequantise-once path's outlier stores are in ``Wq``'s bytes. The threshold is the
smallest M ≥ 17 from which on ``t_deq < t_mma`` for every larger M (M ≤ 16 is one MMA
tile: the MMA kernel's own case); t_mma is a staircase in T, so thresholds are 16T + 1.

Defaults (``DEVICES``): A100 (2.0 TB/s, 40 MB L2, 312 TFLOP/s bf16, 108 SMs at 1.41 GHz)
for sm_8x and H100 SXM (3.35 TB/s, 50 MB L2, 990 TFLOP/s, 132 SMs at 1.98 GHz) for sm_9x+;
on CUDA the SM count and L2 size come from ``torch.cuda.get_device_properties`` (per-SM
rates scaled by the SM count; HBM bandwidth, which the properties do not give, stays the
default's). The model is optimistic for the MMA kernel (it assumes
the full tensor-core peak for 16-row ``mma.sync`` tiles, which on Hopper reach well under
wgmma's peak), so the switch comes no earlier than it should. Model thresholds (bf16,
g = 128, no outliers), the same on the A100 and the H100 defaults and for 4096 × 4096,
4096 × 14336 and 14336 × 4096 alike: **129** at 2 and 4 bits, **81** at 3 bits.

Why they do not move: below the crossover the MMA kernel is issue-bound
(``T·N·K·ipw/ISSUE``) and the dequantise-once path memory-bound (``(Wq + 2·W16)/BW``),
both ∝ N·K, and ``ISSUE/BW`` is ≈ 9.7 (A100) / 10.0 (H100) instructions per byte on both
parts; above L2 the per-tile HBM re-read ``T·Wq/BW`` (4 bits: ≈ 0.25 ps/weight/tile on the
A100) is about the size of the issue term (≈ 0.27 ps), so it does not move the crossover
either. Smaller layers switch later (activation bytes weigh more: 256 × 256 at 4 bits →
241). For the 4096 × 14336 4-bit layer on the A100 the model gives, at M = 64 / 128 / 256:
MMA 63 / 125 / 251 µs, dequantise-once 134 / 135 / 170 µs, bf16 cuBLAS 59 / 59 / 96 µs —
the issue's "parity with bf16 at M ≈ 64"; dequantise-once stays ≈ 1.8× bf16 at M = 256 (it
moves 2·W16 more bytes than bf16 does) and reaches bf16's compute-bound time at large M.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .triton_layout import step_of

# ============================================================================ device code

@triton.jit
def _round(v, DT: tl.constexpr):
    """fp32 → DT, round to nearest, ties to even. bf16 in integer arithmetic: Triton's
    interpreter truncates fp32 → bf16 casts, and this is what ``cvt.rn.bf16.f32`` computes
    for finite values, so the interpreter checks the code the GPU runs. fp16: a plain cast
    (RNE on both)."""
    if DT == tl.bfloat16:
        b = v.to(tl.int32, bitcast=True)
        r = (b + (0x7FFF + ((b >> 16) & 1))) >> 16               # no overflow for finite v
        return r.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return v.to(DT)


@triton.jit
def _dequant_kernel(w_ptr, pa_ptr, ph_ptr, s_ptr, ROW0, ROW1, K, stride_wn, N_PAD, NCH_A, NCH_H, NGP,
                    BITS: tl.constexpr, GROUP: tl.constexpr, BN: tl.constexpr, DS: tl.constexpr):
    # One program: BN rows × one K step (128 / 256 / 512 columns at 4 / 2 / 3 bits). The
    # step's word tiles ([1, 16 words, BN rows] per plane) are loaded once; slab j of every
    # word is the 16 columns k0 + 16j + [0, 16), so DS slabs at a time are expanded by
    # broadcasting per-slab shifts ([DS, 16, BN] → reshape: column order k0 + 16j + w).
    # Rows ROW0 .. ROW1 − 1 of the layer go to rows 0 .. of w (a row chunk of the scratch).
    SLABS: tl.constexpr = 32 if BITS == 3 else 32 // BITS
    STEP: tl.constexpr = 16 * SLABS
    OFF: tl.constexpr = 1 << (BITS - 1)
    CA: tl.constexpr = 512 if BITS == 3 else 256               # plane-A words per step per row group
    pid_n = tl.program_id(0)
    s = tl.program_id(1)
    rn = ROW0 + pid_n * BN + tl.arange(0, BN)
    g16 = rn // 16
    r16 = rn % 16
    w3 = tl.arange(0, 16)[None, :, None]
    pm = (rn < N_PAD)[None, None, :] & (w3 < 16)
    wa = tl.load(pa_ptr + (g16 * (NCH_A * 256) + r16)[None, None, :] + w3 * 16 + s * CA, mask=pm, other=0)
    wb = wa
    wh = wa
    if BITS == 3:
        wb = tl.load(pa_ptr + (g16 * (NCH_A * 256) + r16)[None, None, :] + w3 * 16 + s * CA + 256,
                     mask=pm, other=0)
        wh = tl.load(ph_ptr + (g16 * (NCH_H * 256) + r16)[None, None, :] + w3 * 16 + s * 256, mask=pm, other=0)
    sp = s_ptr + (g16 * (NGP * 16) + r16)[None, None, :]
    k0 = s * STEP
    kd = tl.arange(0, DS * 16)
    wrow = w_ptr + (rn - ROW0).to(tl.int64)[None, :] * stride_wn
    nmask = (rn < ROW1)[None, :]
    for q in range(SLABS // DS):                                      # runtime loop: registers
        j = q * DS + tl.arange(0, DS)[:, None, None]                  # [DS, 1, 1] slab index
        if BITS == 4:
            u = (wa >> (4 * j)) & 15
        elif BITS == 2:
            u = (wa >> (2 * j)) & 3
        else:                                                         # 2-bit tile j // 16 + 1-bit bit j
            lo = tl.where(j < 16, wa, wb)
            u = ((lo >> (2 * (j % 16))) & 3) | (((wh >> j) & 1) << 2)
        z = (u - OFF).to(tl.float32)                                  # exact integer
        sc = tl.load(sp + ((k0 + 16 * j) // GROUP) * 16, mask=pm, other=0.0).to(tl.float32)   # [DS, 1, BN]
        v = tl.reshape(z * sc, [DS * 16, BN])                         # fp32 z·s, one rounding
        kk = k0 + q * (DS * 16) + kd
        tl.store(wrow + kk[:, None], _round(v, w_ptr.dtype.element_ty), mask=(kk < K)[:, None] & nmask)


@triton.jit
def _outlier_kernel(w_ptr, o0_ptr, o1_ptr, o2_ptr, o3_ptr, ROW0, ROW1, stride_wn,
                    OUTL: tl.constexpr, BE: tl.constexpr):
    # One program per 16-row group from row ROW0 (% 16 == 0): W[row − ROW0, col] = val (the
    # inlier there is 0). ELL: o0 = off [G+1], entry off[g] + 16·rank + r is row 16g + r
    # (off[g] % 16 == 0), o1 = col, o2 = val; CSR: o0 = crow [N_pad+1], o1 = row, o2 = col,
    # o3 = val.
    g = ROW0 // 16 + tl.program_id(0)
    if OUTL == 1:
        e0 = tl.load(o0_ptr + g)
        e1 = tl.load(o0_ptr + g + 1)
    else:
        e0 = tl.load(o0_ptr + 16 * g)
        e1 = tl.load(o0_ptr + 16 * g + 16)
    for e in range(e0, e1, BE):
        ee = e + tl.arange(0, BE)
        em = ee < e1
        if OUTL == 1:
            row = 16 * g + ee % 16
            col = tl.load(o1_ptr + ee, mask=em, other=0)
            val = tl.load(o2_ptr + ee, mask=em, other=0.0)
        else:
            row = tl.load(o1_ptr + ee, mask=em, other=0)
            col = tl.load(o2_ptr + ee, mask=em, other=0)
            val = tl.load(o3_ptr + ee, mask=em, other=0.0)
        keep = em & (val != 0) & (row < ROW1)                         # ELL padding: value 0
        ptr = w_ptr + (row - ROW0).to(tl.int64) * stride_wn + col.to(tl.int64)
        tl.store(ptr, _round(val.to(tl.float32), w_ptr.dtype.element_ty), mask=keep)


# ============================================================================ host side

# Suggested workspace cap: holds a fused 8B-class MLP projection (28672 × 4096 bf16 = 224 MiB)
# in one piece; a vocabulary head (128k × 4096 bf16 ≈ 1 GiB) runs in 4 row chunks.
DEFAULT_MAX_BYTES = 256 << 20
DEQUANT_CONFIG = dict(BN=64, DS=4, num_warps=4)      # [64 columns × 64 rows] per store: 32 fp32/thread
OUTLIER_CONFIG = dict(BE=128, num_warps=4)


class Workspace:
    """Scratch shared by every layer: one flat buffer per (device, dtype), sized to the
    largest request seen and grown on demand (layers run in stream order, so one buffer per
    stream suffices). Used for the large-M path's dequantised weights and the split-K fp32
    partials. ``max_bytes`` caps a dequantisation buffer: a larger layer is dequantised and
    multiplied in row chunks that fit (at least 16 rows). Growing frees the old buffer, so
    under CUDA graphs every layer is reserved at load time (``TritonKernel.reserve``):
    growing while a graph is being captured raises instead of leaving a freed buffer in a
    graph."""

    def __init__(self, max_bytes: int | None = None):
        self.max_bytes = max_bytes
        self._bufs: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def rows(self, n: int, k: int, dtype: torch.dtype) -> int:
        """Rows per chunk for an n × k layer: n, or the most that fit the cap (a multiple of 16)."""
        row_bytes = k * torch.empty(0, dtype=dtype).element_size()
        if self.max_bytes is None or n * row_bytes <= self.max_bytes:
            return n
        return max(16, self.max_bytes // row_bytes // 16 * 16)

    def reserve(self, n: int, k: int, dtype: torch.dtype, device: torch.device) -> None:
        self.matrix(self.rows(n, k, dtype), k, dtype, device)

    def flat(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The first ``numel`` elements of the buffer for (device, dtype)."""
        key = (torch.device(device), dtype)
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < numel:
            if key[0].type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"latq workspace ({dtype}) must grow to {numel} elements during CUDA graph "
                                   "capture: reserve() every layer before capturing")
            self._bufs.pop(key, None)                  # free the old buffer before growing
            buf = self._bufs[key] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel]

    def matrix(self, n: int, k: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A contiguous ``[n, k]`` view of the buffer for (device, dtype)."""
        return self.flat(n * k, dtype, device).view(n, k)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._bufs.values())


def large_m_reason(act_dtype: torch.dtype) -> str | None:
    """Why the dequantise-once path cannot serve activations of ``act_dtype`` (None: it can)."""
    if act_dtype not in (torch.float16, torch.bfloat16):
        return f"{act_dtype} activations use the SIMT kernel (exact fp32, no TF32)"
    return None


def dequantize_into(st, out: torch.Tensor, row0: int = 0) -> torch.Tensor:
    """Rows ``row0 .. row0 + R`` of a prepared layer → ``out`` [R, K] (fp16/bf16, unit column
    stride; row0 % 16 == 0): z·s rounded once, outliers stored over their (zero) inliers.
    Equals ``reference.dequantize(w)[row0:row0 + R].to(dtype)``."""
    rows = out.shape[0]
    if (out.dim() != 2 or out.shape[1] != st.k or out.stride(1) != 1 or row0 % 16 or row0 + rows > st.n
            or out.dtype not in (torch.float16, torch.bfloat16)):
        raise ValueError(f"out must be an [R, {st.k}] fp16/bf16 matrix with unit column stride for rows "
                         f"row0 .. row0 + R ≤ {st.n}, row0 % 16 == 0 (got {tuple(out.shape)}, row0={row0})")
    if rows == 0:
        return out
    step = step_of(st.bits)
    nch_a = st.k_pad // (256 if st.bits == 3 else step)
    nch_h = st.k_pad // 512 if st.bits == 3 else 0
    cfg = DEQUANT_CONFIG
    grid = (triton.cdiv(rows, cfg["BN"]), st.k_pad // step)
    _dequant_kernel[grid](out, st.plane_a, st.plane_h if st.plane_h is not None else st.plane_a, st.scales,
                          row0, row0 + rows, st.k, out.stride(0), st.n_pad, nch_a, nch_h, st.scales.shape[1],
                          BITS=st.bits, GROUP=st.group, BN=cfg["BN"], DS=cfg["DS"], num_warps=cfg["num_warps"])
    if st.outl and st.nnz:
        o = [t if t is not None else st.o0 for t in (st.o0, st.o1, st.o2, st.o3)]
        _outlier_kernel[(triton.cdiv(rows, 16),)](out, *o, row0, row0 + rows, out.stride(0), OUTL=st.outl,
                                                  BE=OUTLIER_CONFIG["BE"], num_warps=OUTLIER_CONFIG["num_warps"])
    return out


def apply_large_m(st, x2: torch.Tensor, bias: torch.Tensor | None = None,
                  workspace: Workspace | None = None) -> torch.Tensor:
    """``y = x2 @ Wᵀ (+ bias)`` with W dequantised once into ``workspace`` (a temporary
    buffer when None) and ``F.linear`` (cuBLAS): one GEMM, or one per row chunk when the
    workspace is capped. x2: [M, K] fp16/bf16."""
    why = large_m_reason(x2.dtype)
    if why:
        raise ValueError(why)
    ws = workspace or Workspace()
    rows = ws.rows(st.n, st.k, x2.dtype)
    if rows >= st.n:
        return torch.nn.functional.linear(x2, dequantize_into(st, ws.matrix(st.n, st.k, x2.dtype, x2.device)), bias)
    y = torch.empty(x2.shape[0], st.n, dtype=x2.dtype, device=x2.device)
    for n0 in range(0, st.n, rows):
        r = min(rows, st.n - n0)
        W = dequantize_into(st, ws.matrix(r, st.k, x2.dtype, x2.device), n0)
        y[:, n0:n0 + r] = torch.nn.functional.linear(x2, W, None if bias is None else bias[n0:n0 + r])
    return y


def use_large_m(st, x2: torch.Tensor) -> bool:
    """Whether ``TritonKernel.apply`` should take this path for x2 [M, K]: fp16/bf16 and M at
    or above the layer's model threshold on x2's device."""
    return (x2.shape[0] > 16 and large_m_reason(x2.dtype) is None
            and x2.shape[0] >= threshold_for(st, x2.dtype, x2.device))


# ============================================================================ crossover model

@dataclass(frozen=True)
class DeviceModel:
    name: str
    hbm_bw: float          # bytes/s
    l2_bytes: int
    tc_flops: float        # dense fp16/bf16 tensor-core FLOP/s
    issue: float           # SASS lane-instructions/s (SMs × 4 schedulers × 32 lanes × clock)
    sms: int


DEVICES = {
    "a100": DeviceModel("A100", 2.0e12, 40 * 2**20, 312e12, 108 * 128 * 1.41e9, 108),
    "h100": DeviceModel("H100", 3.35e12, 50 * 2**20, 990e12, 132 * 128 * 1.98e9, 132),
}
# MMA kernel K loop: SASS lane-instructions per weight per 16-row M tile (triton_compile's
# "i/w" of the tensor-core kernel, median over its tile configs, sm_80; sm_90 within 3 %)
MMA_IPW = {2: 5.0, 3: 8.5, 4: 5.2}
# MMA kernel outliers: lane-ops per entry per 16-row tile (one gather + FMA per activation
# row, + 1: triton_layout.outlier_model's ELL count at M = 16)
MMA_OUTLIER_OPS = 17
NEVER = 2**31 - 1          # threshold when the MMA kernel wins for every M searched
M_SEARCH = 1 << 16


def device_model(device_props=None) -> DeviceModel:
    """``device_props``: None (A100 defaults), a :class:`DeviceModel`, a key of ``DEVICES``,
    or ``torch.cuda.get_device_properties(...)`` — the A100 (sm_8x) or H100 (sm_9x+) model
    with that part's SM count (per-SM rates scaled) and L2 size."""
    if device_props is None:
        return DEVICES["a100"]
    if isinstance(device_props, DeviceModel):
        return device_props
    if isinstance(device_props, str):
        return DEVICES[device_props.lower()]
    base = DEVICES["h100" if device_props.major >= 9 else "a100"]
    f = device_props.multi_processor_count / base.sms
    l2 = getattr(device_props, "L2_cache_size", 0) or base.l2_bytes
    return DeviceModel(device_props.name, base.hbm_bw, l2, base.tc_flops * f, base.issue * f,
                       device_props.multi_processor_count)


def packed_bytes(n: int, k: int, bits: int, nnz: int, group: int = 128) -> int:
    """Bytes the kernels stream for one layer: b-bit inliers, fp16 scales, 4-byte outliers."""
    return n * k * bits // 8 + 2 * n * math.ceil(k / group) + 4 * nnz


def model_times(m: int, n: int, k: int, bits: int, nnz: int, dtype: torch.dtype = torch.bfloat16,
                device_props=None, group: int = 128) -> tuple[float, float]:
    """(t_mma, t_deq) in seconds for one layer at M rows (module docstring)."""
    d = device_model(device_props)
    e = torch.empty(0, dtype=dtype).element_size()
    wq = packed_bytes(n, k, bits, nnz, group)
    w16, act = e * n * k, e * m * (k + n)
    t = math.ceil(m / 16)
    reads = (t if wq > d.l2_bytes else 1) * wq + act
    issue = t * (n * k * MMA_IPW[bits] + MMA_OUTLIER_OPS * nnz) / d.issue
    t_mma = max(reads / d.hbm_bw, issue, 2 * 16 * t * n * k / d.tc_flops)
    t_deq = (wq + w16) / d.hbm_bw + max((w16 + act) / d.hbm_bw, 2 * m * n * k / d.tc_flops)
    return t_mma, t_deq


def large_m_threshold(n: int, k: int, bits: int, nnz: int, dtype: torch.dtype = torch.bfloat16,
                      device_props=None, group: int = 128) -> int:
    """Smallest M ≥ 17 from which on dequantise-once + GEMM is predicted faster than the MMA
    kernel for every larger M (``NEVER`` if it loses at M = 65536). Pure: the model of the
    module docstring. t_mma is constant over a 16-row tile and t_deq grows with M, so a tile
    is won iff its last row M = 16T is: the answer is 16T + 1 after the last lost tile."""
    tiles = M_SEARCH // 16
    for t in range(tiles, 1, -1):
        t_mma, t_deq = model_times(16 * t, n, k, bits, nnz, dtype, device_props, group)
        if t_deq >= t_mma:
            return NEVER if t == tiles else 16 * t + 1
    return 17


@functools.lru_cache(maxsize=4096)
def _threshold_cached(n, k, bits, nnz, dtype, device_index, group):
    props = torch.cuda.get_device_properties(device_index) if device_index is not None else None
    return large_m_threshold(n, k, bits, nnz, dtype, props, group)


def threshold_for(st, dtype: torch.dtype, device: torch.device) -> int:
    """:func:`large_m_threshold` for a prepared layer on ``device`` (cached per shape)."""
    device = torch.device(device)
    idx = (device.index if device.index is not None else torch.cuda.current_device()) if device.type == "cuda" else None
    return _threshold_cached(st.n, st.k, st.bits, st.nnz, dtype, idx, st.group)   # one group: st.group = K_pad
