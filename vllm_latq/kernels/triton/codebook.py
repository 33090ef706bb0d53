"""Triton kernels for codebook layers (method e8, :class:`~vllm_latq.kernels.weight.CodebookWeight`),
the host side: the prepared layout, the launch and :class:`TritonCodebookKernel` (family "triton"): the
SIMT GEMV below 8 rows of x (and for fp32); from 8, the weight decoded once and cuBLAS. Device code:
:mod:`~vllm_latq.kernels.triton.codebook_device`; design: docs/KERNELS.md, "E8 codebooks".

Layout: plane A holds each block's E8P code(s), int16 (2 and 3 bits) or int32 (4 bits: the second
stage's code in bits 16–31); plane B (3 bits) the ball's uint8 index; both ``[in/8, N_pad]``, so the
codes of a block for BN consecutive rows are one coalesced load. Scales as the integer kernels lay
them out (fp16 or coded, :mod:`~vllm_latq.kernels.triton.layout`). One int64 table for the model, each
entry two int32 words of fields 6 bits apart (low word: coordinates 0–3, high word: 4–7): E8P's 256
patterns (3-bit fields 4 | (|a_j| − ½), the eighth xor 7 where the pattern's parity is odd), then the
ball's 256 points (fields 2·p_j + 8). A code's sign byte (seven signs, the shift at bit 7) is not looked
up but computed into the words its pattern entry is xor-ed with (``codebook_device._sign_words``: fields
7·sign_j, the eighth sign their parity, the shift at bit 31 of the low word), so that the two hold
u_j = (σ_j·2|a_j| + 7)/2 and coordinate j is u_j − 7/2 ± ¼.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...format import codebook as cb
from ...format import scale_codes
from ..base import LatqKernel
from ..weight import CodebookWeight
from . import configs as cfg
from . import layout as tlay
from .codebook_device import BALL_AT, TABLE_ENTRIES, _e8_dequant_kernel, _e8_gemv_kernel, _e8_mma_kernel  # noqa: F401
from .dequant import apply_large_m, check_out, large_m_reason
from .kernel import (INDEX_LIMIT, INTERPRET, SPLITK_SCRATCH, TritonKernel, device_reason, machine_reason,
                     splitk_floats)

BITS = tuple(sorted(cb.CODEBOOKS))
# BKB blocks (8·BKB columns) a K step; the GEMV's by its row tile: each row of x adds a register
# accumulator per (block, output row) pair, so more rows take fewer blocks a step (chosen by the
# compile report's registers and instructions per weight: tools/compile_record.json)
GEMV_TILES = {1: dict(BN=64, BKB=16, num_warps=4), 2: dict(BN=64, BKB=8, num_warps=4),
              4: dict(BN=64, BKB=8, num_warps=4), 8: dict(BN=64, BKB=8, num_warps=4)}
MMA_TILE = dict(BN=64, BKB=8, num_warps=4)
# the GEMV's table lookups through shared memory (codebook_device._table) rather than L1, and its codes
# loaded a K step ahead: not yet timed on a GPU, so off; bench/e8_kernels.py times them (config LDS, AHEAD)
GEMV_LDS_TABLE = False
GEMV_AHEAD = False
DEQUANT_TILE = dict(BN=64, BKB=8, num_warps=4)   # [64 rows × 64 columns] a store
# from this many rows of fp16/bf16 x: the weight decoded once into the shared scratch, then cuBLAS
# (the tensor-core kernel, a tl.dot per 16-column scale group, ran 5-30x slower on an H200: KERNELS.md)
LARGE_MIN_M = 8


# ============================================================================ layout

def table_words() -> torch.Tensor:
    """int64 ``[512]``: E8P's pattern entries, then the ball's points (module docstring)."""
    j = torch.arange(cb.DIM)
    at = 6 * (j % 4) + 32 * (j // 4)                                # field j's bit: word j // 4, 6 bits apart
    a = cb.e8p_patterns()
    k = torch.round(a - 0.5).long()                                 # |a_j| − ½: 0 … 3
    parity = torch.round(a.sum(-1)).long() % 2
    fields = (4 | k) ^ torch.where(j == cb.DIM - 1, 7 * parity[:, None], 0)
    e8p = (fields << at).sum(-1)
    u = torch.round(2 * cb.e8_ball256()).long() + 8                 # 4 … 12
    ball = (u << at).sum(-1)
    return torch.cat([e8p, ball])


_TABLES: dict[str, torch.Tensor] = {}


def shared_table(device: torch.device) -> torch.Tensor:
    """One copy of :func:`table_words` per device for every codebook layer of the model."""
    key = str(torch.device(device))
    if key not in _TABLES:
        _TABLES[key] = table_words().to(device)
    return _TABLES[key]


def e8p_codes(codes: torch.Tensor, bits: int) -> list[torch.Tensor]:
    """uint8 codes ``[..., index_bytes]`` → each E8P stage's 16-bit code (int64), and the ball's index."""
    c, at, out = codes.long(), 0, []
    for stage in cb.CODEBOOKS[bits].stages:
        out.append(c[..., at] | (c[..., at + 1] << 8) if stage.book == cb.E8P else c[..., at])
        at += cb.CODE_BYTES[stage.book]
    return out


def code_planes(codes: torch.Tensor, bits: int, n_pad: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A layer's codes ``[out, in/8, index_bytes]`` → (plane A, plane B or None), ``[in/8, n_pad]``
    each, rows past ``out`` zero."""
    stages = e8p_codes(codes, bits)
    if bits == 4:
        a = stages[0] | (stages[1] << 16)
        a, dt = torch.where(a >= 2**31, a - 2**32, a), torch.int32
    else:
        a, dt = torch.where(stages[0] >= 2**15, stages[0] - 2**16, stages[0]), torch.int16
    pa = torch.zeros(codes.shape[1], n_pad, dtype=dt, device=codes.device)
    pa[:, :codes.shape[0]] = a.t().to(dt)
    if bits != 3:
        return pa.contiguous(), None
    pb = torch.zeros(codes.shape[1], n_pad, dtype=torch.uint8, device=codes.device)
    pb[:, :codes.shape[0]] = stages[1].t().to(torch.uint8)
    return pa.contiguous(), pb.contiguous()


def kernel_group(group: int, ngroups: int, k: int) -> int:
    """The scale group as the kernels see it: ``group``, or with one group a row a power of two ≥ K
    (every block's group index 0, one compiled variant for many K)."""
    return group if ngroups > 1 else max(16, cfg._next_pow2(k))


# ============================================================================ state

@dataclass
class E8State:
    """Prepared codebook layer, tensor and int fields only (a vLLM layer keeps buffers + static ints)."""
    codes: torch.Tensor                # plane A: int16 / int32 [in/8, N_pad]
    ball: torch.Tensor | None          # plane B: uint8 [in/8, N_pad] (3 bits)
    scales: torch.Tensor               # fp16 [N_pad/16, ngroups, 16], or coded: int32 [N_pad/16, ngroups, 3]
    table: torch.Tensor                # int64 [512] (table_words), shared by the model's codebook layers
    tickets: torch.Tensor              # int32 [N_pad/16] split-K tickets, always back to 0
    bits: int
    group: int                         # kernel_group's
    n: int
    k: int
    n_pad: int

    @property
    def coded_scales(self) -> bool:
        return self.scales.dtype == torch.int32


def gemv_split(st: E8State, M: int, bm: int, device: torch.device, tile: dict | None = None) -> int:
    """K splits of a GEMV launch (``tile``: default the table's): two programs an SM, ≥ 4 K steps a split."""
    if tlay.cdiv(M, bm) > 1 or not splitk_floats(st.n_pad):
        return 1
    tile = tile or GEMV_TILES[bm]
    sms = cfg.device_info(device)[1]
    n_tiles = tlay.cdiv(st.n_pad, tile["BN"])
    steps = tlay.cdiv(st.k // cb.DIM, tile["BKB"])
    split = 1
    while (2 * split <= min(cfg.MAX_SPLIT, cfg.SPLITK_ROWS // bm) and n_tiles * split < 2 * sms
           and steps >= 8 * split):
        split *= 2
    return split


def mma_bm(M: int) -> int:
    return 16 if M <= 16 else (32 if M <= 32 else 64)


def dot_blocks(group: int, bkb: int) -> int:
    """Blocks per ``tl.dot``: the largest power of two dividing the group's blocks, at most a K step's."""
    gkb = 2
    while gkb < bkb and (group // cb.DIM) % (2 * gkb) == 0:
        gkb *= 2
    return gkb


def launch(st: E8State, x2: torch.Tensor, bias: torch.Tensor | None, kernel: str,
           config: dict | None = None) -> torch.Tensor:
    """y [M, N] = x2 [M, K] @ Wᵀ (+ bias) with kernel "gemv" or "mma"; ``config`` overrides the
    tile (BN, BKB, num_warps), SPLIT and (gemv) LDS, AHEAD."""
    M, K = x2.shape
    dev = x2.device
    y = torch.empty(M, st.n, dtype=x2.dtype, device=dev)
    if M == 0:
        return y
    bm = min(8, cfg._next_pow2(M)) if kernel == "gemv" else mma_bm(M)
    c = dict(GEMV_TILES[bm] if kernel == "gemv" else MMA_TILE)
    c.update(config or {})
    if "SPLIT" not in c:
        c["SPLIT"] = gemv_split(st, M, bm, dev, c) if kernel == "gemv" else 1
    if c["SPLIT"] > 1 and (tlay.cdiv(M, bm) > 1 or c["SPLIT"] * bm > cfg.SPLITK_ROWS or not splitk_floats(st.n_pad)):
        raise ValueError(f"SPLIT {c['SPLIT']}: split-K needs one M tile of ≤ {cfg.SPLITK_ROWS} rows in all "
                         f"splits and a layer of ≤ {cfg.SPLITK_MAX_N} rows")
    ws = SPLITK_SCRATCH.flat(splitk_floats(st.n_pad) if c["SPLIT"] > 1 else 1, torch.float32, dev)
    has_bias = bias is not None
    args = [x2, y, bias if has_bias else y, st.codes, st.ball if st.ball is not None else st.codes, st.scales,
            st.table, ws, st.tickets, M, st.n, K, K // cb.DIM, x2.stride(0), y.stride(0), st.n_pad,
            st.scales.shape[1], bm]
    meta = dict(BITS=st.bits, GROUP=st.group, BM=bm, BN=c["BN"], BKB=c["BKB"], SPLIT=c["SPLIT"],
                HAS_BIAS=has_bias, ASM=not INTERPRET, CODED=st.coded_scales)
    if kernel == "mma":
        meta.update(GKB=dot_blocks(st.group, c["BKB"]), F32DOT=INTERPRET or x2.dtype == torch.float32)
    else:
        meta.update(LDS=c.get("LDS", GEMV_LDS_TABLE), AHEAD=c.get("AHEAD", GEMV_AHEAD))
    grid = (tlay.cdiv(M, bm), tlay.cdiv(st.n_pad, c["BN"]), c["SPLIT"])
    fn = _e8_gemv_kernel if kernel == "gemv" else _e8_mma_kernel
    fn[grid](*args, **meta, num_warps=c["num_warps"])
    return y


def route(m: int, dtype: torch.dtype) -> str:
    """The kernel ``apply`` runs for ``m`` rows of x in ``dtype``: the GEMV, or (large M, fp16/bf16) the
    weight decoded once + cuBLAS."""
    return "gemv" if m < LARGE_MIN_M or large_m_reason(dtype) else "dequant"


def dequantize_into(st: E8State, out: torch.Tensor, row0: int = 0) -> torch.Tensor:
    """Rows ``row0 .. row0 + R`` of a prepared codebook layer → ``out`` [R, K] fp16/bf16:
    ``dequantize(w)[row0:row0 + R].to(dtype)``, bit for bit."""
    rows = check_out(st, out, row0)
    if rows:
        c = DEQUANT_TILE
        grid = (tlay.cdiv(rows, c["BN"]), tlay.cdiv(st.k // cb.DIM, c["BKB"]))
        _e8_dequant_kernel[grid](out, st.codes, st.ball if st.ball is not None else st.codes, st.scales, st.table,
                                 row0, row0 + rows, st.k, st.k // cb.DIM, out.stride(0), st.n_pad,
                                 st.scales.shape[1], BITS=st.bits, GROUP=st.group, BN=c["BN"], BKB=c["BKB"],
                                 ASM=not INTERPRET, CODED=st.coded_scales, num_warps=c["num_warps"])
    return out


# ============================================================================ the kernel

class TritonCodebookKernel(LatqKernel):
    """Triton GPU kernels for codebook layers: SIMT GEMV (M ≤ 7, and fp32 activations), from 8 rows the
    weight decoded once into the shared scratch and one cuBLAS GEMM (``kernel="mma"``: tensor cores);
    each block's point decoded in registers from its codes and the shared table."""
    name = "triton-e8"
    family = "triton"
    forms = (CodebookWeight,)
    state_cls = E8State

    @classmethod
    def unavailable_here(cls) -> str | None:
        return machine_reason()

    @classmethod
    def can_implement(cls, w: CodebookWeight, device: torch.device, act_dtype: torch.dtype):
        if not isinstance(w, CodebookWeight):
            return False, f"serves CodebookWeight layers, not {type(w).__name__}"
        why = device_reason(device, act_dtype)
        if why is not None:
            return False, why
        if w.bits not in BITS:
            return False, f"{w.bits}-bit codes (kernels exist for {', '.join(map(str, BITS))})"
        if w.scales.shape[1] > 1 and w.group_size % 16:
            return False, f"group size {w.group_size} is not a multiple of 16"
        if w.coded is not None and w.coded.bits not in scale_codes.CODE_BITS:
            return False, f"{w.coded.bits}-bit scale codes (kernels read {scale_codes.CODE_BITS})"
        n_pad = tlay.cdiv(w.out_features, tlay.ROWS) * tlay.ROWS
        if n_pad * (w.in_features // cb.DIM) >= INDEX_LIMIT:
            return False, f"{w.out_features}×{w.in_features}: the kernels index < 2³¹ blocks"
        return True, None

    @classmethod
    def prepare(cls, w: CodebookWeight) -> E8State:
        n, k = w.out_features, w.in_features
        n_pad = tlay.cdiv(n, tlay.ROWS) * tlay.ROWS
        ng = w.scales.shape[1]
        if w.coded is None:
            scales = tlay.fp16_scales(w.scales, n_pad, ng)
        else:
            scales = tlay.coded_scales(w.coded.to(w.codes.device), n_pad, ng)
        pa, pb = code_planes(w.codes, w.bits, n_pad)
        tickets = torch.zeros(n_pad // tlay.ROWS, dtype=torch.int32, device=w.codes.device)
        return E8State(pa, pb, scales, shared_table(w.codes.device), tickets, w.bits,
                       kernel_group(w.group_size, ng, k), n, k, n_pad)

    @classmethod
    def reserve(cls, state: E8State, act_dtype: torch.dtype) -> None:
        SPLITK_SCRATCH.reserve_flat(max(1, splitk_floats(state.n_pad)), torch.float32, state.scales.device)
        if large_m_reason(act_dtype) is None:
            TritonKernel.workspace.reserve(state.n, state.k, act_dtype, state.scales.device)

    @classmethod
    def apply(cls, state: E8State, x: torch.Tensor, bias: torch.Tensor | None = None,
              kernel: str | None = None, config: dict | None = None) -> torch.Tensor:
        if x.shape[-1] != state.k:
            raise ValueError(f"x has {x.shape[-1]} features, layer expects {state.k}")
        x2 = x.reshape(-1, state.k)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        if kernel is None:
            kernel = route(x2.shape[0], x2.dtype)
        if kernel == "dequant":
            y = apply_large_m(state, x2, bias, TritonKernel.workspace, dequantize_into)
        else:
            y = launch(state, x2, bias, kernel, config)
        return y.reshape(*x.shape[:-1], state.n)

    @classmethod
    def served_bytes(cls, state: E8State) -> dict[str, int]:
        """The code planes, the scales and the shared table (split-K tickets left out: counters)."""
        def nb(*ts):
            return sum(t.numel() * t.element_size() for t in ts if t is not None)
        return {"codes": nb(state.codes, state.ball), "scales": nb(state.scales), "codebook": nb(state.table)}

    @classmethod
    def shared_tensors(cls, state: E8State) -> dict[str, torch.Tensor]:
        return {"codebook": state.table}

    @classmethod
    def codebook_bytes(cls, n, k, bits, group, scale_bits=None):
        """:meth:`served_bytes` of ``prepare``'s state but the shared table (a model streams it once)."""
        ng = math.ceil(k / group) if group else 1
        # the same refusals as can_implement, in its words: the report prints them as the reason
        if bits not in BITS:
            raise ValueError(f"{bits}-bit codes (kernels exist for {', '.join(map(str, BITS))})")
        if k % cb.DIM:
            raise ValueError(f"{k} columns are not whole blocks of {cb.DIM}")
        if ng > 1 and group % 16:
            raise ValueError(f"group size {group} is not a multiple of 16")
        if scale_bits not in (None, *scale_codes.CODE_BITS):
            raise ValueError(f"{scale_bits}-bit scale codes (kernels: {scale_codes.CODE_BITS})")
        n_pad = tlay.cdiv(n, tlay.ROWS) * tlay.ROWS
        return {"codes": n_pad * (k // cb.DIM) * cb.CODEBOOKS[bits].index_bytes,
                "scales": tlay.scale_bytes(n_pad, ng, scale_bits is not None)}
