"""CPU stand-ins for the CUDA ops vLLM's Marlin, Machete and Marlin-MoE classes call, for the
CUDA-boundary harness: each checks the op's contract as vLLM's CUDA source states it and computes
what the GPU computes, *inverting* the repacked layouts rather than trusting them, so a tensor
handed over in another layout gives a wrong product (Machete's opaque layout: columns reversed)."""
from __future__ import annotations

import torch

TILE = 16               # Marlin's tile edge (rows of K per repacked row)
MIN_THREAD_N = 64       # Marlin's narrowest thread tile along N


class OpContractError(RuntimeError):
    """What the CUDA op's own checks (``TORCH_CHECK``) refuse."""


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise OpContractError(what)


def _scalar_type(type_id: int):
    from vllm.scalar_type import ScalarType, scalar_types
    t = ScalarType.from_id(type_id)
    _check(t in (scalar_types.uint4b8, scalar_types.uint8b128),
           f"the stand-in computes uint4b8 and uint8b128 weights (got {t}): latq hands over no other")
    return t


def _act_dtype(a: torch.Tensor) -> torch.dtype:
    _check(a.dtype in (torch.float16, torch.bfloat16), f"unsupported `a` scalar_type {a.dtype} (16-bit only)")
    return a.dtype


def unpack_rows(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 ``[R, C]`` with 32/bits values a word along dim 0, value i at bits i·b → ``[R·32/b, C]``."""
    pack, mask = 32 // bits, (1 << bits) - 1
    parts = [(words >> (bits * i)) & mask for i in range(pack)]
    return torch.stack(parts, 1).reshape(words.shape[0] * pack, words.shape[1])


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`unpack_rows`."""
    pack = 32 // bits
    v = values.to(torch.int64).reshape(-1, pack, values.shape[1])
    out = sum(v[:, i] << (bits * i) for i in range(pack))
    return torch.where(out >= 2 ** 31, out - 2 ** 32, out).to(torch.int32)


def _unpack_cols(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 ``[R, C]``, value i of word c at column c·pack + i → ``[R, C·32/b]``."""
    return unpack_rows(words.t().contiguous(), bits).t()


# ---------------------------------------------------------------------------- Marlin

def _perm_inverse(perm) -> torch.Tensor:
    return torch.argsort(torch.as_tensor(perm, dtype=torch.long))


def marlin_unrepack(w: torch.Tensor, size_k: int, size_n: int, bits: int) -> torch.Tensor:
    """The ``[size_k, size_n]`` stored integers of a Marlin-repacked weight: its words unpacked,
    vLLM's weight permutation inverted, its 16×16 tiles put back (16-bit activations)."""
    from vllm.model_executor.layers.quantization.utils.marlin_utils_test import get_weight_perm
    perm = get_weight_perm(bits)
    vals = _unpack_cols(w, bits)                                     # [K/16, N·16]
    vals = vals.reshape(-1, perm.numel())[:, _perm_inverse(perm)].reshape(size_k // TILE, size_n * TILE)
    return vals.reshape(size_k // TILE, size_n // TILE, TILE, TILE).permute(0, 2, 1, 3).reshape(size_k, size_n)


def marlin_unpermute_scales(s: torch.Tensor) -> torch.Tensor:
    """Scales ``[G, N]`` in vLLM's order (``marlin_permute_scales`` inverted): the kernel reads one
    permutation for several groups, the "single" one for one scale per column."""
    from vllm.model_executor.layers.quantization.utils.marlin_utils import get_scale_perms
    grouped, single = get_scale_perms()
    perm = grouped if s.shape[0] > 1 else single
    return s.reshape(-1, len(perm))[:, _perm_inverse(perm)].reshape(s.shape)


def marlin_unpermute_bias(b: torch.Tensor) -> torch.Tensor:
    """A bias in vLLM's order (``marlin_permute_bias`` inverted)."""
    from vllm.model_executor.layers.quantization.utils.marlin_utils import get_scale_perms
    single = get_scale_perms()[1]
    return b.reshape(-1, len(single))[:, _perm_inverse(single)].reshape(b.shape)


def gptq_marlin_repack(b_q_weight, size_k, size_n, num_bits, is_a_8bit=False):
    """GPTQ words ``[K/pack, N]`` → Marlin's layout, as vLLM's kernel tests define it
    (``marlin_weights`` with ``get_weight_perm``)."""
    from vllm.model_executor.layers.quantization.utils.marlin_utils_test import get_weight_perm, marlin_weights
    pack = 32 // num_bits
    _check(not is_a_8bit, "the stand-in repacks for 16-bit activations only")
    _check(size_k % TILE == 0 and size_n % MIN_THREAD_N == 0,
           f"size_k = {size_k} not divisible by {TILE} or size_n = {size_n} by {MIN_THREAD_N}")
    _check(b_q_weight.dtype == torch.int32 and tuple(b_q_weight.shape) == (size_k // pack, size_n),
           f"b_q_weight {tuple(b_q_weight.shape)} {b_q_weight.dtype}, want int32 ({size_k // pack}, {size_n})")
    _check(b_q_weight.is_contiguous(), "b_q_weight is not contiguous")
    q = unpack_rows(b_q_weight, num_bits)
    return marlin_weights(q, size_k, size_n, num_bits, get_weight_perm(num_bits)).to(b_q_weight.device)


def _dequantized(q: torch.Tensor, scales: torch.Tensor, wtype, dtype: torch.dtype) -> torch.Tensor:
    """``(q − bias)·s`` per group in ``dtype`` (the kernels dequantize in the activation type)."""
    groups = scales.shape[0]
    _check(q.shape[0] % groups == 0, f"size_k = {q.shape[0]} is not divisible by {groups} scale groups")
    return (q - wtype.bias).to(dtype) * scales.repeat_interleave(q.shape[0] // groups, 0)


def _as_act(t: torch.Tensor, dtype: torch.dtype, what: str) -> torch.Tensor:
    """``t``'s bits read as ``dtype``: Marlin reads scales and bias as the activation type."""
    _check(t.element_size() == torch.finfo(dtype).bits // 8, f"{what} of {t.dtype} read as {dtype}")
    _check(t.is_contiguous(), f"{what} is not contiguous")
    return t.view(dtype)


def marlin_gemm(a, c, b_q_weight, b_bias, b_scales, a_scales, global_scale, b_zeros, workspace, b_q_type_id,
                size_m, size_n, size_k, use_atomic_add=False, use_fp32_reduce=False, is_zp_float=False):
    """``a @ W (+ bias)`` from Marlin's layouts, inverted (module doc)."""
    dtype = _act_dtype(a)
    wtype = _scalar_type(b_q_type_id)
    pack = 32 // wtype.size_bits
    _check(a_scales is None and global_scale is None, "a_scales and global_scale are for 8-bit/FP4 paths")
    _check(b_zeros is None or b_zeros.numel() == 0, "zero points: uint4/uint8 types only")
    _check(tuple(a.shape) == (size_m, size_k) and a.stride(1) == 1, f"a {tuple(a.shape)} for ({size_m}, {size_k})")
    _check(size_k % TILE == 0 and b_q_weight.shape[0] == size_k // TILE, "b_q_weight rows != size_k / 16")
    _check(b_q_weight.shape[1] // TILE * pack == size_n and size_n % MIN_THREAD_N == 0,
           f"size_n = {size_n} does not match b_q_weight {tuple(b_q_weight.shape)} or {MIN_THREAD_N}")
    _check(b_scales.dim() == 2 and b_scales.shape[1] == size_n, f"b_scales {tuple(b_scales.shape)}")
    _check(c is None or (tuple(c.shape) == (size_m, size_n) and c.dtype == dtype), "c shape or dtype")
    q = marlin_unrepack(b_q_weight, size_k, size_n, wtype.size_bits)
    s = marlin_unpermute_scales(_as_act(b_scales, dtype, "b_scales"))
    y = a.float() @ _dequantized(q, s, wtype, dtype).float()
    if b_bias is not None:
        _check(tuple(b_bias.shape) == (size_n,), f"b_bias {tuple(b_bias.shape)} != size_n")
        y = y + marlin_unpermute_bias(_as_act(b_bias, dtype, "b_bias")).float()
    out = y.to(dtype)
    if c is not None:
        return c.copy_(out)
    return out


# ---------------------------------------------------------------------------- Machete

def machete_prepack_B(b_q_weight, a_type, b_type_id, group_scales_type):
    """GPTQ words ``[K/pack, N]``, column-major (as ``MacheteLinearKernel`` hands them) → the
    stand-in's opaque layout of the same shape."""
    wtype = _scalar_type(b_type_id)
    _check(a_type in (torch.float16, torch.bfloat16), f"Machete has no kernel for {a_type} activations")
    _check(group_scales_type in (None, a_type), f"group scales {group_scales_type} with {a_type} activations")
    _check(b_q_weight.dtype == torch.int32 and b_q_weight.stride(0) == 1, "B must be int32 and column-major")
    q = unpack_rows(b_q_weight, wtype.size_bits)
    return pack_rows(q.flip(1), wtype.size_bits).contiguous()


def machete_mm(a, b_q, b_type_id, out_type=None, b_group_scales=None, b_group_zeros=None, b_group_size=None,
               b_channel_scales=None, a_token_scales=None, schedule=None):
    """``a @ W`` from the stand-in's prepacked layout and plain ``[G, N]`` group scales."""
    dtype = _act_dtype(a)
    wtype = _scalar_type(b_type_id)
    _check(out_type in (None, dtype), f"out_type {out_type} with {dtype} activations")
    _check(b_group_zeros is None and b_channel_scales is None and a_token_scales is None,
           "zeros, channel and token scales: paths latq does not take")
    _check(b_group_scales is not None and b_group_scales.dtype == dtype,
           f"group scales {None if b_group_scales is None else b_group_scales.dtype} with {dtype} activations")
    q = unpack_rows(b_q, wtype.size_bits).flip(1)
    _check(a.shape[1] == q.shape[0] and b_group_scales.shape[1] == q.shape[1], "a, b_q and scales disagree")
    groups = 1 if b_group_size in (None, -1) else q.shape[0] // b_group_size
    _check(b_group_scales.shape[0] == groups, f"{b_group_scales.shape[0]} scale rows for group {b_group_size}")
    return (a.float() @ _dequantized(q, b_group_scales, wtype, dtype).float()).to(dtype)


# ---------------------------------------------------------------------------- Marlin MoE

def moe_align_block_size(topk_ids, num_experts, block_size, sorted_token_ids, experts_ids, num_tokens_post_pad,
                         expert_map=None, scatter_idx=None):
    """Each expert's (token, slot) rows, ``topk_ids`` flattened, in runs padded to ``block_size``
    with the sentinel ``topk_ids.numel()``; one expert id per block; the padded total."""
    _check(expert_map is None and scatter_idx is None, "expert maps (expert parallelism): not taken by latq")
    flat = topk_ids.flatten().long()
    sorted_token_ids.fill_(flat.numel())
    experts_ids.fill_(-1)
    pos = 0
    for e in range(num_experts):
        rows = (flat == e).nonzero().flatten()
        sorted_token_ids[pos:pos + rows.numel()] = rows.to(sorted_token_ids.dtype)
        blocks = -(-rows.numel() // block_size)
        experts_ids[pos // block_size:pos // block_size + blocks] = e
        pos += blocks * block_size
    num_tokens_post_pad.fill_(pos)


def moe_wna16_marlin_gemm(input, output, b_qweight, b_bias, b_scales, a_scales, global_scale, b_qzeros, workspace,
                          sorted_token_ids, expert_ids, num_tokens_past_padded, topk_weights, moe_block_size, top_k,
                          mul_topk_weights, b_q_type_id, size_m, size_n, size_k, use_atomic_add, use_fp32_reduce,
                          is_zp_float, thread_k=-1, thread_n=-1, blocks_per_sm=-1):
    """Per block of ``sorted_token_ids``: its expert's Marlin GEMM (layouts inverted as
    :func:`marlin_gemm`) on rows ``id // top_k`` of ``input``, into rows ``id`` of the output,
    times ``topk_weights`` where asked."""
    dtype = _act_dtype(input)
    wtype = _scalar_type(b_q_type_id)
    _check(a_scales is None and global_scale is None and (b_qzeros is None or b_qzeros.numel() == 0),
           "a_scales, global scales and zero points: paths latq does not take")
    _check(tuple(input.shape) == (size_m, size_k), f"input {tuple(input.shape)} for ({size_m}, {size_k})")
    _check(b_scales.dim() == 3 and b_scales.shape[2] == size_n and b_qweight.shape[1] == size_k // TILE,
           f"b_qweight {tuple(b_qweight.shape)} / b_scales {tuple(b_scales.shape)} for k {size_k}, n {size_n}")
    out = output if output is not None else input.new_empty(size_m * top_k, size_n)
    _check(tuple(out.shape) == (size_m * top_k, size_n), f"output {tuple(out.shape)}")
    weights = {}
    for blk in range(int(num_tokens_past_padded.flatten()[0]) // moe_block_size):
        e = int(expert_ids[blk])
        ids = sorted_token_ids[blk * moe_block_size:(blk + 1) * moe_block_size].long()
        ids = ids[ids < size_m * top_k]
        if e < 0 or ids.numel() == 0:
            continue
        if e not in weights:
            q = marlin_unrepack(b_qweight[e], size_k, size_n, wtype.size_bits)
            s = marlin_unpermute_scales(_as_act(b_scales[e], dtype, "b_scales"))
            weights[e] = _dequantized(q, s, wtype, dtype).float()
        y = input[ids // top_k].float() @ weights[e]
        if b_bias is not None:
            y = y + marlin_unpermute_bias(_as_act(b_bias[e], dtype, "b_bias")).float()
        if mul_topk_weights:
            y = y * topk_weights.flatten()[ids].float()[:, None]
        out[ids] = y.to(dtype)
    return out


def moe_sum(input, output, topk_ids=None, expert_map=None):
    """``output[t] = Σ_k input[t, k]`` (in fp32, as the kernel accumulates), in place."""
    _check(expert_map is None, "expert maps (expert parallelism): not taken by latq")
    _check(input.dim() == 3 and tuple(output.shape) == (input.shape[0], input.shape[2]),
           f"input {tuple(input.shape)} / output {tuple(output.shape)}")
    output.copy_(input.float().sum(1).to(output.dtype))


# ---------------------------------------------------------------------------- the GEMMs as custom ops

# The GEMMs a compiled forward reaches are torch custom ops with fake (meta) implementations, as the
# real ones are (vLLM's ``_custom_ops`` registers their fakes): Dynamo traces over them, not into
# them. The weight preparation runs once at load, eager, and Marlin MoE's ops run inside vLLM's own
# MoE custom op: plain functions suffice there.
LIBRARY = "latq_cuda_stand_in"
_LIB = torch.library.Library(LIBRARY, "DEF")
_LIB.define("marlin_gemm(Tensor a, Tensor(c!)? c, Tensor b_q_weight, Tensor? b_bias, Tensor b_scales, "
            "Tensor? a_scales, Tensor? global_scale, Tensor? b_zeros, Tensor? workspace, int b_q_type_id, "
            "SymInt size_m, SymInt size_n, SymInt size_k, bool use_atomic_add=False, bool use_fp32_reduce=False, "
            "bool is_zp_float=False) -> Tensor")
_LIB.define("machete_mm(Tensor a, Tensor b_q, int b_type_id, ScalarType? out_type=None, Tensor? b_group_scales=None, "
            "Tensor? b_group_zeros=None, int? b_group_size=None, Tensor? b_channel_scales=None, "
            "Tensor? a_token_scales=None, str? schedule=None) -> Tensor")


def _marlin_gemm_op(a, c, b_q_weight, *args, **kwargs):
    out = marlin_gemm(a, None, b_q_weight, *args, **kwargs)
    if c is not None:
        c.copy_(out)
    return out        # a new tensor: a custom op's output does not alias its inputs


_LIB.impl("marlin_gemm", _marlin_gemm_op, "CompositeExplicitAutograd")
_LIB.impl("machete_mm", machete_mm, "CompositeExplicitAutograd")


@torch.library.register_fake(f"{LIBRARY}::marlin_gemm")
def _marlin_gemm_fake(a, c, b_q_weight, b_bias, b_scales, a_scales, global_scale, b_zeros, workspace, b_q_type_id,
                      size_m, size_n, size_k, use_atomic_add=False, use_fp32_reduce=False, is_zp_float=False):
    return a.new_empty((size_m, size_n))


@torch.library.register_fake(f"{LIBRARY}::machete_mm")
def _machete_mm_fake(a, b_q, b_type_id, out_type=None, b_group_scales=None, b_group_zeros=None, b_group_size=None,
                     b_channel_scales=None, a_token_scales=None, schedule=None):
    return a.new_empty((a.shape[0], b_q.shape[1]))      # the stand-in's prepacked B is [K·b/32, N]


# namespace → op name → stand-in
STAND_INS = {
    "_C": {"gptq_marlin_repack": gptq_marlin_repack, "marlin_gemm": getattr(torch.ops, LIBRARY).marlin_gemm,
           "machete_prepack_B": machete_prepack_B, "machete_mm": getattr(torch.ops, LIBRARY).machete_mm},
    "_moe_C": {"moe_align_block_size": moe_align_block_size, "moe_wna16_marlin_gemm": moe_wna16_marlin_gemm,
               "moe_sum": moe_sum},
}
