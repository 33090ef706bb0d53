"""Large-M path: dequantise the prepared layout once into a bf16/fp16 scratch equal to
``weight.dequantize(w).to(dtype)`` bit for bit, then one cuBLAS GEMM (one rounding of z·s away
from the fp32 reference; fp32 activations never take it). When: above ``MMA_MAX_M`` rows."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import graphs
from .device import _group_scale, _scale_base
from .layout import cdiv, k_steps

# ============================================================================ device code

@triton.jit
def _round(v, DT: tl.constexpr):
    """fp32 → DT, round to nearest even. bf16 in integer arithmetic, as ``cvt.rn.bf16.f32`` does,
    because the interpreter truncates such casts."""
    if DT == tl.bfloat16:
        b = v.to(tl.int32, bitcast=True)
        r = (b + (0x7FFF + ((b >> 16) & 1))) >> 16               # no overflow for finite v
        return r.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return v.to(DT)


@triton.jit(do_not_specialize=("NCH_A", "NCH_H", "NGP"))        # chunk counts: see device.UNSPECIALIZED
def _dequant_kernel(w_ptr, pa_ptr, ph_ptr, s_ptr, ROW0, ROW1, K, K0, stride_wn, N_PAD, NCH_A, NCH_H, NGP,
                    BITS: tl.constexpr, GROUP: tl.constexpr, BN: tl.constexpr, DS: tl.constexpr,
                    CODED: tl.constexpr):
    # One program: BN rows × one K step (128 / 256 / 512 / 128 columns at 4 / 2 / 3 / 5 bits)
    # from column K0 (a 3-bit layer's 4-bit tail is a second launch at BITS = 4). The step's
    # word tiles ([1, 16 words, BN rows] per plane) are loaded once; slab j of every word is
    # the 16 columns k0 + 16j + [0, 16), so DS slabs at a time are expanded by broadcasting
    # per-slab shifts ([DS, 16, BN] → reshape: column order k0 + 16j + w).
    # Rows ROW0 .. ROW1 − 1 of the layer go to rows 0 .. of w (a row chunk of the scratch).
    SLABS: tl.constexpr = 32 if BITS == 3 else (8 if BITS == 5 else 32 // BITS)
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
    elif BITS == 5:                                                   # the 512-column 1-bit chunk of step s
        wh = tl.load(ph_ptr + (g16 * (NCH_H * 256) + r16)[None, None, :] + w3 * 16 + (s // 4) * 256,
                     mask=pm, other=0) >> (8 * (s % 4))
    sp = _scale_base(s_ptr, g16, r16, NGP, CODED)[None, None, :]
    rs3 = r16[None, None, :]
    k0 = K0 + s * STEP
    kd = tl.arange(0, DS * 16)
    wrow = w_ptr + (rn - ROW0).to(tl.int64)[:, None] * stride_wn
    nmask = (rn < ROW1)[:, None]
    for q in range(SLABS // DS):                                      # runtime loop: registers
        j = q * DS + tl.arange(0, DS)[:, None, None]                  # [DS, 1, 1] slab index
        if BITS == 4:
            u = (wa >> (4 * j)) & 15
        elif BITS == 2:
            u = (wa >> (2 * j)) & 3
        elif BITS == 5:                                               # 4-bit slot j + 1-bit bit j
            u = ((wa >> (4 * j)) & 15) | (((wh >> j) & 1) << 4)
        else:                                                         # 2-bit tile j // 16 + 1-bit bit j
            lo = tl.where(j < 16, wa, wb)
            u = ((lo >> (2 * (j % 16))) & 3) | (((wh >> j) & 1) << 2)
        z = (u - OFF).to(tl.float32)                                  # exact integer
        sc = _group_scale(sp, (k0 + 16 * j) // GROUP, rs3, pm, CODED, False)      # [DS, 16, BN]
        # fp32 z·s, one rounding; stored as W is laid out, [BN rows, DS·16 columns] with the
        # columns fastest: 16-byte vector stores along K (the word tiles run along rows, so
        # the tile is transposed on chip, through shared memory)
        v = tl.trans(tl.reshape(z * sc, [DS * 16, BN]))
        kk = k0 + q * (DS * 16) + kd
        tl.store(wrow + kk[None, :], _round(v, w_ptr.dtype.element_ty), mask=(kk < K)[None, :] & nmask)


@triton.jit
def _outlier_kernel(w_ptr, start_ptr, row_ptr, col_ptr, val_ptr, ROW0, ROW1, stride_wn,
                    OUTL: tl.constexpr, BE: tl.constexpr):
    # One program per 16-row group from row ROW0 (% 16 == 0): W[row − ROW0, col] = val (the
    # inlier there is 0). ELL: start = off [G+1], entry off[g] + 16·rank + r is row 16g + r
    # (off[g] % 16 == 0), no row array; CSR: start = crow [N_pad+1].
    g = ROW0 // 16 + tl.program_id(0)
    if OUTL == 1:
        e0 = tl.load(start_ptr + g)
        e1 = tl.load(start_ptr + g + 1)
    else:
        e0 = tl.load(start_ptr + 16 * g)
        e1 = tl.load(start_ptr + 16 * g + 16)
    for e in range(e0, e1, BE):
        ee = e + tl.arange(0, BE)
        em = ee < e1
        if OUTL == 1:
            row = 16 * g + ee % 16
            col = tl.load(col_ptr + ee, mask=em, other=0)
            val = tl.load(val_ptr + ee, mask=em, other=0.0)
        else:
            row = tl.load(row_ptr + ee, mask=em, other=0)
            col = tl.load(col_ptr + ee, mask=em, other=0)
            val = tl.load(val_ptr + ee, mask=em, other=0.0)
        keep = em & (val != 0) & (row < ROW1)                         # ELL padding: value 0
        ptr = w_ptr + (row - ROW0).to(tl.int64) * stride_wn + col.to(tl.int64)
        tl.store(ptr, _round(val.to(tl.float32), w_ptr.dtype.element_ty), mask=keep)


# ============================================================================ host side

# Rows the tensor-core kernel serves at most: one 64-row tile, measured faster than this path up
# to there on every 8B shape; 128 rows are two tiles' work (docs/BENCHMARKS.md, "The third GPU check").
MMA_MAX_M = 64
# Suggested workspace cap: holds a fused 8B-class MLP projection (28672 × 4096 bf16 = 224 MiB)
# in one piece; a vocabulary head (128k × 4096 bf16 ≈ 1 GiB) runs in 4 row chunks.
DEFAULT_MAX_BYTES = 256 << 20
DEQUANT_CONFIG = dict(BN=64, DS=4, num_warps=4)      # [64 columns × 64 rows] per store: 32 fp32/thread
OUTLIER_CONFIG = dict(BE=128, num_warps=4)


def stream_key(device: torch.device) -> int:
    """Identity of the current stream on ``device`` (the device type's ``current_stream``)."""
    get = getattr(torch.cuda if device.type == "cuda" else getattr(torch, device.type, None), "current_stream", None)
    if get is None:
        return 0
    s = get(device) if device.type == "cuda" else get()
    return _key_of(s)


def _key_of(stream) -> int:
    sid = getattr(stream, "stream_id", None)
    return id(stream) if sid is None else sid


MAIN_LANE = -1


def _device(device) -> torch.device:
    """``device`` with its index: ``cuda`` and ``cuda:<current>`` name one buffer, not two."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def lane(device: torch.device) -> int:
    """The scratch lane of the current stream: its own for a stream vLLM runs concurrently with the
    forward, else the main lane."""
    sk = stream_key(device)
    return sk if any(_key_of(s) == sk for s in graphs.concurrent_streams()) else MAIN_LANE


class Workspace:
    """Scratch shared by the layers of a device: one buffer per (device, dtype, lane), grown on
    demand, sized for every lane at load (``reserve``) so vLLM's profile counts it; growing during
    a capture raises. ``max_bytes`` caps a dequantisation (larger layers go in row chunks). Lanes:
    docs/KERNELS.md, "Scratch lanes"."""

    def __init__(self, max_bytes: int | None = None):
        self.max_bytes = max_bytes
        self._bufs: dict[tuple[torch.device, torch.dtype, int], torch.Tensor] = {}
        self._reserved: dict[tuple[torch.device, torch.dtype], int] = {}

    def rows(self, n: int, k: int, dtype: torch.dtype) -> int:
        """Rows per chunk for an n × k layer: n, or the most that fit the cap (a multiple of 16)."""
        row_bytes = k * dtype.itemsize
        if self.max_bytes is None or n * row_bytes <= self.max_bytes:
            return n
        return max(16, self.max_bytes // row_bytes // 16 * 16)

    def reserve(self, n: int, k: int, dtype: torch.dtype, device: torch.device) -> None:
        self.reserve_flat(self.rows(n, k, dtype) * k, dtype, device)

    def reserve_flat(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        """Size the main lane's buffer for (device, dtype), and each concurrent stream's, to at
        least ``numel`` elements now."""
        device = _device(device)
        self._reserved[device, dtype] = max(self._reserved.get((device, dtype), 0), numel)
        for ln in [MAIN_LANE] + [_key_of(s) for s in graphs.concurrent_streams()]:
            self._buffer(ln, numel, dtype, device)

    def flat(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The first ``numel`` elements of the current stream's lane's buffer for (device, dtype)."""
        device = _device(device)
        return self._buffer(lane(device), numel, dtype, device)[:numel]

    def _buffer(self, ln: int, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (device, dtype, ln)
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < numel:
            if graphs.capturing(device):
                raise RuntimeError(f"latq workspace ({dtype}) must grow to {numel} elements during CUDA graph "
                                   "capture: reserve() every layer at load")
            if buf is not None and device.type == "cuda":
                torch.cuda.synchronize(device)      # another stream of the lane may still use it
            self._bufs.pop(key, None)                  # free the old buffer before growing
            size = max(numel, self._reserved.get((device, dtype), 0))
            buf = self._bufs[key] = torch.empty(size, dtype=dtype, device=device)
        return buf

    def matrix(self, n: int, k: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A contiguous ``[n, k]`` view of the current stream's lane's buffer for (device, dtype)."""
        return self.flat(n * k, dtype, device).view(n, k)

    def current(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """The current stream's lane's whole buffer for (device, dtype), None before its first use."""
        device = _device(device)
        return self._bufs.get((device, dtype, lane(device)))

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._bufs.values())


def large_m_reason(act_dtype: torch.dtype) -> str | None:
    """Why the dequantise-once path cannot serve activations of ``act_dtype`` (None: it can)."""
    if act_dtype not in (torch.float16, torch.bfloat16):
        return f"{act_dtype} activations use the SIMT kernel (exact fp32, no TF32)"
    return None


def check_out(st, out: torch.Tensor, row0: int) -> int:
    """The rows a dequantisation of layer ``st`` into ``out`` from ``row0`` writes; a clear error if it cannot."""
    rows = out.shape[0]
    if (out.dim() != 2 or out.shape[1] != st.k or out.stride(1) != 1 or row0 % 16 or row0 + rows > st.n
            or out.dtype not in (torch.float16, torch.bfloat16)):
        raise ValueError(f"out must be an [R, {st.k}] fp16/bf16 matrix with unit column stride for rows "
                         f"row0 .. row0 + R ≤ {st.n}, row0 % 16 == 0 (got {tuple(out.shape)}, row0={row0})")
    return rows


def dequantize_into(st, out: torch.Tensor, row0: int = 0) -> torch.Tensor:
    """Rows ``row0 .. row0 + R`` (row0 % 16 == 0) of a prepared layer → ``out`` [R, K] fp16/bf16:
    ``weight.dequantize(w)[row0:row0 + R].to(dtype)``, bit for bit."""
    rows = check_out(st, out, row0)
    if rows == 0:
        return out
    ks = k_steps(st.bits, st.k_pad)
    cfg = DEQUANT_CONFIG
    launches = [(ks["nsteps"], st.plane_a, st.plane_h, 0, st.bits, ks["nch_a"]),     # main steps
                (ks["tsteps"], st.plane_t, None, ks["k_main"], 4, ks["tsteps"])]     # 3 bits: the 4-bit tail
    for steps, pa, ph, k0, bits, nch_a in launches:
        if steps:
            _dequant_kernel[(cdiv(rows, cfg["BN"]), steps)](
                out, pa, ph if ph is not None else pa, st.scales, row0, row0 + rows, st.k, k0, out.stride(0),
                st.n_pad, nch_a, ks["nch_h"], st.scales.shape[1],
                BITS=bits, GROUP=st.group, BN=cfg["BN"], DS=cfg["DS"], CODED=st.coded_scales,
                num_warps=cfg["num_warps"])
    if st.outl and st.nnz:
        o = [t if t is not None else st.outl_start for t in st.outlier_arrays]
        _outlier_kernel[(cdiv(rows, 16),)](out, *o, row0, row0 + rows, out.stride(0), OUTL=st.outl,
                                                  BE=OUTLIER_CONFIG["BE"], num_warps=OUTLIER_CONFIG["num_warps"])
    return out


def apply_large_m(st, x2: torch.Tensor, bias: torch.Tensor | None = None,
                  workspace: Workspace | None = None, dequantize=None) -> torch.Tensor:
    """``y = x2 @ Wᵀ (+ bias)``, W dequantised once into ``workspace`` (row chunks where capped) by
    ``dequantize`` (default :func:`dequantize_into`: ``_dequant_kernel`` writes z·s rounded once,
    ``_outlier_kernel`` stores each outlier over its zero integer, a store, not an add), then
    ``F.linear``. x2: [M, K] fp16/bf16."""
    why = large_m_reason(x2.dtype)
    if why:
        raise ValueError(why)
    ws = workspace or Workspace()
    dequantize = dequantize or dequantize_into
    rows = ws.rows(st.n, st.k, x2.dtype)
    if rows >= st.n:
        return torch.nn.functional.linear(x2, dequantize(st, ws.matrix(st.n, st.k, x2.dtype, x2.device)), bias)
    y = torch.empty(x2.shape[0], st.n, dtype=x2.dtype, device=x2.device)
    for n0 in range(0, st.n, rows):
        r = min(rows, st.n - n0)
        W = dequantize(st, ws.matrix(r, st.k, x2.dtype, x2.device), n0)
        y[:, n0:n0 + r] = torch.nn.functional.linear(x2, W, None if bias is None else bias[n0:n0 + r])
    return y


def use_large_m(x2: torch.Tensor) -> bool:
    """Whether ``TritonKernel.apply`` should take this path for x2 [M, K]: fp16/bf16 and more
    than ``MMA_MAX_M`` rows."""
    return x2.shape[0] > MMA_MAX_M and large_m_reason(x2.dtype) is None
