"""Which latq layers vLLM's own mixed-precision kernels serve, and in which tensors: a layer of a
*standard form* (2–8-bit inliers, no outliers, static group scales) is a compressed-tensors
``pack-quantized`` WNA16 layer, served by vLLM's ``CompressedTensorsWNA16`` scheme
(``plugin/vllm_scheme.py``). Why and which widths: docs/KERNELS.md."""
from __future__ import annotations

import math

import torch

from .base import LatqKernel
from .served_bytes import GridStats
from .weight import LatqWeight

WIDTHS = tuple(range(2, 9))     # compressed-tensors' WNA16 widths; a latq row is their dense packing at each
# vLLM kernel class → the custom op its apply calls, where a build may lack it
PROBED_OPS = {"CPUWNA16LinearKernel": "cpu_gemm_wna16"}
_16BIT = (torch.float16, torch.bfloat16)
# vLLM kernel or experts class → (the activation dtypes it computes as latq's reference does — weights
# dequantized in the activation type, products summed in fp32 —, why not the others), where its
# selection does not ask
COMPUTES = {
    "MarlinLinearKernel": (_16BIT, 'marlin_gemm refuses them: "unsupported `a` scalar_type"'),
    "MacheteLinearKernel": (_16BIT, "Machete has no kernel for them, though its group-size query lets 32-bit "
                                    "activations through"),
    "MarlinExperts": (_16BIT, "fused_marlin_moe asserts 16-bit hidden states"),
    "BatchedMarlinExperts": (_16BIT, "fused_marlin_moe asserts 16-bit hidden states"),
    "TritonWNA16Experts": (_16BIT, "its tl.dot multiplies 32-bit activations at TF32 precision, Triton's default "
                                   "on NVIDIA GPUs"),
    "ExllamaLinearKernel": ((), "gptq_gemm sums its products in fp16 (half2 FMAs, half atomics)"),
}


def op_available(name: str) -> bool:
    """Whether ``torch.ops._C.<name>`` exists in the installed vLLM build."""
    try:
        import vllm._custom_ops  # noqa: F401  (loads vLLM's _C library)
    except ImportError:
        return False
    return hasattr(torch.ops._C, name)


def weight_type(bits: int):
    """vLLM's scalar type of latq's offset-binary integers (``uint4b8``, ``uint8b128``, …)."""
    from vllm.scalar_type import ScalarType
    return ScalarType.uint(bits, 2 ** (bits - 1))


def vllm_group(w: LatqWeight) -> int:
    """The group size vLLM is told: -1 (channelwise) for one scale per row; else the largest
    group dividing both latq's group and this rank's K (each part keeps its group's scale: a
    row-parallel cut off a group boundary stays exact)."""
    if w.scales.shape[1] == 1:
        return -1
    return math.gcd(w.group_size, w.in_features)


def form_refusal(w: LatqWeight) -> str | None:
    """Why ``w`` is not a compressed-tensors WNA16 form, or None (whether a vLLM kernel takes its
    width is :func:`choose`'s question)."""
    if w.bits not in WIDTHS:
        return f"{w.bits}-bit inliers (compressed-tensors' WNA16 forms are {WIDTHS[0]}-{WIDTHS[-1]} bits)"
    if w.nnz:
        return "CSR outliers (no vLLM kernel adds them)"
    if w.in_features * w.bits % 32:      # vLLM's MoE method and Humming's schema shape ⌊K·b/32⌋ words
        return f"K = {w.in_features} does not fill whole int32 words at {w.bits} bits"
    return None


def layer_config(w: LatqWeight, act_dtype: torch.dtype, full_in: int | None = None):
    """This rank's layer as vLLM's ``MPLinearLayerConfig`` ([in, out] shapes, symmetric), as
    ``CompressedTensorsWNA16.create_weights`` describes it (``full_in``: the layer's whole K)."""
    from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import MPLinearLayerConfig
    part = (w.in_features, w.out_features)
    return MPLinearLayerConfig(full_weight_shape=(full_in or w.in_features, w.out_features),
                               partition_weight_shape=part, weight_type=weight_type(w.bits), act_type=act_dtype,
                               group_size=vllm_group(w), zero_points=False)


def packed_words(w: LatqWeight) -> torch.Tensor:
    """int32 ``[N, ceil(K·b/32)]``: latq's ``qweight`` less its tile padding — compressed-tensors'
    ``weight_packed``, the words ``CompressedTensorsWNA16.create_weights`` registers."""
    return w.qweight[:, :math.ceil(w.in_features * w.bits / 32)]


def group_scales(w: LatqWeight, group: int) -> torch.Tensor:
    """``w``'s scales ``[N, K/group]`` at ``group`` (-1: ``w``'s one scale per row), a divisor of
    its group size: each part keeps its group's scale."""
    if group == -1:
        return w.scales
    return w.scales.repeat_interleave(min(w.group_size, w.in_features) // group, 1)[:, :w.in_features // group]


def computes_refusal(kernel_name: str, act_dtype: torch.dtype) -> str | None:
    """Why vLLM's ``kernel_name`` (a linear kernel or experts class) would be handed activations
    it does not compute as latq's reference does (``COMPUTES``), or None."""
    dtypes, why = COMPUTES.get(kernel_name, (None, ""))
    if dtypes is None or act_dtype in dtypes:
        return None
    only = ", ".join(str(d) for d in dtypes) or "no dtype"
    return f"vLLM picks {kernel_name}, which computes no {act_dtype} activations (only {only}: {why})"


def choose(w: LatqWeight, device: torch.device, act_dtype: torch.dtype, full_in: int | None = None):
    """(vLLM kernel class, None) or (None, why not) for this layer on vLLM's platform."""
    why = form_refusal(w)
    if why:
        return None, why
    try:
        from vllm.model_executor.kernels.linear import choose_mp_linear_kernel
    except ImportError as e:
        return None, f"vLLM's kernel selection does not import ({e})"
    config = layer_config(w, act_dtype, full_in)
    try:
        kernel = choose_mp_linear_kernel(config)
    except ValueError as e:
        return None, (f"vLLM has no kernel for {config.weight_type} group {config.group_size}: "
                      + " ".join(str(e).split("Reasons:")[-1].split()))
    why = computes_refusal(kernel.__name__, act_dtype)
    if why:
        return None, why
    op = PROBED_OPS.get(kernel.__name__)
    if op and not op_available(op):
        return None, f"vLLM chose {kernel.__name__} but its op torch.ops._C.{op} is not in this build"
    return kernel, None


class VllmMPKernel(LatqKernel):
    """vLLM's ``choose_mp_linear_kernel`` for standard forms, as the selector sees it; ``delegated``:
    the plugin installs vLLM's scheme, whose kernel class repacks and runs the layer. On CPU only
    when forced (``LATQ_KERNEL=vllm``) and the op is built: its bf16 AMX path can die of SIGILL."""
    name = "vllm"
    widths = (4, 8)         # a transcoded (HPTQ) layer's widths for it: those Marlin and Machete take
    cpu_opt_in = True       # on CPU only when forced (above)
    delegated = True        # served by vLLM's own layer code, installed by the plugin

    @classmethod
    def can_implement(cls, w: LatqWeight, device: torch.device, act_dtype: torch.dtype):
        kernel, why = choose(w, device, act_dtype)
        return kernel is not None, why

    @classmethod
    def layout_bytes(cls, n: int, k: int, bits: int, group: int, stats: GridStats,
                     scale_bits: int | None = None) -> dict[str, int]:
        """compressed-tensors' form's bytes (scales in a 16-bit activation dtype, coded ones decoded),
        at the widths vLLM's CUDA kernels take (``widths``)."""
        if bits not in cls.widths or stats.off_grid(bits) or k * bits % 32:
            raise ValueError(f"vLLM's CUDA kernels take no {bits}-bit layer with outliers or partial words")
        groups = 1 if group >= k else k // math.gcd(group, k)
        return {"inliers": n * k * bits // 8, "scales": n * groups * 2}
