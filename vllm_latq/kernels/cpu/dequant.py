"""The CPU kernel's prepared state read back as weights (scales, outlier tiles as entries) and
its large-M path: row chunks dequantized into a reused bf16 buffer, each multiplied by a GEMM,
or (opt-in) a dequantized copy kept per layer."""
from __future__ import annotations

import torch

from ... import cpu_features, env
from ... import format as fmt
from .layouts import decode_scale_words, tile_entries, unpack_int4pack
from ..derived_cache import DerivedCache

CHUNK_ENV = "LATQ_CPU_CHUNK_BYTES"
PREFILL_CACHE_ENV = "LATQ_CPU_PREFILL_CACHE"


def chunk_bytes() -> int:
    # the bf16 weight chunk the large-M path dequantizes at a time
    return env.integer(CHUNK_ENV, 1 << 22, minimum=1, maximum=1 << 40)


def prefill_cache() -> bool:
    # opt-in: a dequantized bf16 copy of each layer for large M (fastest prefill, +2 bytes/weight resident)
    return env.flag(PREFILL_CACHE_ENV)


CHUNK_BYTES = chunk_bytes()
PREFILL_CACHE = prefill_cache()


def is_coded(state) -> bool:
    return state.scales.dtype == torch.int32


def scales_alone(state) -> torch.Tensor:
    """bf16 ``[Kp/g, N]``: the state's scales without zeros, coded ones decoded (to the bf16 of
    their fp16 values, as the GEMV decodes them) for the paths that are not the GEMV."""
    if is_coded(state):
        return decode_scale_words(state.scales.detach()).to(torch.bfloat16)
    return state.scales.detach() if state.scales.dim() == 2 else state.scales.detach()[..., 0]


def tile_entries_of(state, r0: int, r1: int, padding: bool = False):
    """:func:`~vllm_latq.kernels.cpu.layouts.tile_entries` of the state's tiles, values in fp32
    (int16 ones times their row's scale: the fp32 value z·s the runtime form holds)."""
    rows, cols, vals = tile_entries(state.tile_off, state.tile_rows, state.tile_col, state.tile_val,
                                    state.out_features, state.in_features, r0, r1, padding)
    vals = vals.float() if state.row_scale is None else vals.float() * state.row_scale[r0 + rows]
    return rows, cols, vals


_SCRATCH: dict[str, torch.Tensor] = {}


def _scratch(name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    t = _SCRATCH.get(name)
    if t is None or t.numel() < numel or t.dtype != dtype:
        t = torch.empty(numel, dtype=dtype)
        _SCRATCH[name] = t
    return t[:numel]


def _dequant_chunks(state):
    """Yield (r0, r1, W_chunkᵀ) over row chunks: bf16 ``[K, r1 - r0]`` = bf16(z·s) with the outliers
    scattered in (cheaper than a CSR SpMM), in a buffer valid until the next chunk."""
    N, K, planes = state.out_features, state.in_features, state.planes
    Kp = K * planes
    B = state.layout_block
    layout = (B, bool(state.layout_halves))
    R = max(B, CHUNK_BYTES // (2 * Kp) // B * B)
    g = state.group_size
    sc = scales_alone(state)                                        # [Kp/g, N] bf16; first K/g: s
    buf_all = _scratch("w", (K + 1) * min(R, N), torch.bfloat16)   # + a spare row: tiles' padding
    for r0 in range(0, N, R):
        r1 = min(N, r0 + R)
        buf = buf_all[: K * (r1 - r0)].view(K, r1 - r0)
        if planes == 1:
            unpack_int4pack(state.packed, N, K, layout, r0, r1, out=buf)      # bf16(u - 8) = z
        else:   # z = (c-8) + 16(a-8) + 8, exact in int16 and in bf16 (|z| ≤ 128)
            z = unpack_int4pack(state.packed, N, Kp, layout, r0, r1)         # int8 [2K, R']
            buf.copy_(z[K:].to(torch.int16).mul_(16).add_(z[:K]).add_(8))
        s_c = sc[: K // g, r0:r1].contiguous()   # unit inner stride: the broadcast mul vectorizes
        buf.view(K // g, g, r1 - r0).mul_(s_c[:, None, :])                 # one rounding: bf16(z·s)
        if state.crow is not None:   # outliers into the chunk (their inlier is 0): bf16(o)
            a, b = int(state.crow[r0]), int(state.crow[r1])
            if b > a:
                rows = fmt.csr_rows(state.crow[r0:r1 + 1], b - a)
                buf.index_put_((state.col[a:b].long(), rows), state.val[a:b].to(torch.bfloat16))
        elif state.tile_col is not None:
            rows, cols, vals = tile_entries_of(state, r0, r1, padding=True)
            buf_all[: (K + 1) * (r1 - r0)].view(K + 1, r1 - r0).index_put_((cols, rows), vals.to(torch.bfloat16))
        yield r0, r1, buf


def large_m_linear(state, x2: torch.Tensor) -> torch.Tensor:
    """``[M, N]``: a cached dequantized weight (``PREFILL_CACHE``) or row chunks dequantized per call,
    each a GEMM in bf16, or in fp32 where the CPU emulates bf16 (the same, exact, products)."""
    xb = x2.to(torch.bfloat16)
    if PREFILL_CACHE:
        return torch.nn.functional.linear(xb, _cached_weight(state))
    gemm = cpu_features.fastest_float(torch.bfloat16)
    xT = xb.t().to(gemm).contiguous()                                          # [K, M]
    yT = torch.empty(state.out_features, x2.shape[0], dtype=gemm)
    for r0, r1, buf in _dequant_chunks(state):
        w = buf if gemm == torch.bfloat16 else _scratch("w32", buf.numel(), gemm).view(buf.shape).copy_(buf)
        torch.mm(w.t(), xT, out=yT[r0:r1])
    return yT.t()


_PREFILL = DerivedCache()


def _cached_weight(state) -> torch.Tensor:
    """bf16 ``[N, K]`` dequantized weight (outliers in), built on first use and kept while the
    layer's packed weights live (opt-in: +2 bytes/weight resident)."""
    def build():
        wt = torch.empty(state.out_features, state.in_features, dtype=torch.bfloat16)
        for r0, r1, buf in _dequant_chunks(state):
            wt[r0:r1].copy_(buf.t())
        return wt

    return _PREFILL.get((state.packed,), build)


def clear() -> None:
    _PREFILL.clear()
