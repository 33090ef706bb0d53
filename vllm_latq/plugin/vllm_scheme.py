"""latq layers of a standard form served by vLLM's own compressed-tensors WNA16 code: the scheme
(or the MoE method) registers its parameters on the vLLM layer, latq fills them with the
validated, TP-cut runtime form, vLLM's kernel class processes and applies them; a rotated layer's
input transform goes in front. Why the route is decided after loading: docs/KERNELS.md."""
from __future__ import annotations

import torch

from .. import format as fmt
from ..kernels import vllm_moe, vllm_mp
from ..kernels.rotated import shared_signs, transform_for
from ..kernels.weight import LatqWeight

NAME = vllm_mp.VllmMPKernel.name
# vLLM experts class → the custom ops its weight preparation and apply call, where a build may lack them
PROBED_OPS = {"CPUExpertsInt4": ("convert_weight_packed_scale_zp", "fused_experts_cpu")}
REFUSED_BACKENDS = {"EMULATION": "vLLM's only backend is EMULATION (experts dequantized to bf16)"}


class FilledByLatq:
    """The ``weight_loader`` of a scheme parameter latq fills: vLLM's model loader never sees these
    names (the checkpoint holds latq's tensors), and a second load by name is refused."""

    def __init__(self, prefix: str):
        self.prefix = prefix

    def __call__(self, param, loaded_weight, *args, **kwargs):
        raise ValueError(f"latq: {self.prefix}: vLLM's compressed-tensors parameters are filled from latq's "
                         "checkpoint tensors at load; they cannot be loaded by name")


def _fill(prefix: str, name: str, param: torch.nn.Parameter, t: torch.Tensor) -> None:
    if tuple(param.shape) != tuple(t.shape):
        raise ValueError(f"latq: {prefix}: {name} {tuple(t.shape)} does not fit vLLM's {tuple(param.shape)}")
    param.data.copy_(t)        # fp16 scales → the parameter's (activation) dtype


# ---------------------------------------------------------------------------- linears

def scheme_for(w: LatqWeight, prefix: str):
    """vLLM's ``CompressedTensorsWNA16`` for ``w``'s form: symmetric, static groups of
    ``vllm_mp.vllm_group`` (channelwise for one scale per row)."""
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16 import (
        CompressedTensorsWNA16)
    group = vllm_mp.vllm_group(w)
    return CompressedTensorsWNA16("channel" if group == -1 else "group", w.bits, None if group == -1 else group,
                                  symmetric=True, layer_name=prefix)


def register(layer, w: LatqWeight, act_dtype: torch.dtype, full_in: int):
    """vLLM's scheme's parameters on ``layer`` (made on ``w``'s device: the layer's), filled with
    ``w``: compressed-tensors' ``weight_packed`` [N, K·b/32], ``weight_scale`` [N, G] in the
    activation dtype, ``weight_shape`` (the unpacked shape). Returns the scheme."""
    scheme = scheme_for(w, layer.prefix)
    full_out = getattr(layer, "output_size", None) or w.out_features
    with torch.device(w.qweight.device):
        scheme.create_weights(layer, output_size=full_out, input_size=full_in,
                              output_partition_sizes=[w.out_features], input_size_per_partition=w.in_features,
                              params_dtype=act_dtype, weight_loader=FilledByLatq(layer.prefix))
    _fill(layer.prefix, "weight_packed", layer.weight_packed, vllm_mp.packed_words(w))
    _fill(layer.prefix, "weight_scale", layer.weight_scale, vllm_mp.group_scales(w, vllm_mp.vllm_group(w)))
    _fill(layer.prefix, "weight_shape", layer.weight_shape, torch.tensor([w.out_features, w.in_features]))
    return scheme


def install(layer, w: LatqWeight, act_dtype: torch.dtype, full_in: int):
    """:func:`register`, then the scheme's kernel class processes the layer (repack, scale and
    bias permutations); the scheme is kept as ``layer.latq_scheme``, which ``apply`` calls."""
    scheme = register(layer, w, act_dtype, full_in)
    scheme.process_weights_after_loading(layer)
    layer.latq_scheme = scheme
    return scheme


class ServedScheme:
    """The load report's view of a layer vLLM's scheme serves (``LoadReport.add``'s kernel; state:
    the layer): the kernel class, and the bytes of the tensors its apply reads."""
    name = NAME

    @staticmethod
    def label(layer) -> str:
        t = getattr(layer, "latq_transform", None)
        return f"{NAME}:{type(layer.latq_scheme.kernel).__name__}" + (f"+hadamard({t.label})" if t is not None else "")

    @staticmethod
    def served_bytes(layer) -> dict[str, int]:
        k = layer.latq_scheme.kernel
        parts = {"inliers": k.w_q_name, "scales": k.w_s_name, "other": k.w_zp_name}
        tensors = {part: getattr(layer, name, None) if name else None for part, name in parts.items()}
        transform = getattr(layer, "latq_transform", None)
        if transform is not None:
            tensors["rotation"] = transform_tensor(transform)
        return {part: t.numel() * t.element_size() for part, t in tensors.items() if isinstance(t, torch.Tensor)}

    @staticmethod
    def shared_tensors(layer) -> dict[str, torch.Tensor]:
        transform = getattr(layer, "latq_transform", None)
        return {} if transform is None else {"rotation": transform_tensor(transform)}


# ---------------------------------------------------------------------------- rotated layers

class LatqTransform(torch.nn.Module):
    """latq's ``x → x·R`` (``kernels.rotated.transform_for``) where vLLM's transform does not serve."""
    label = "latq"

    def __init__(self, signs: torch.Tensor, act_dtype: torch.dtype):
        super().__init__()
        self.register_buffer("signs", shared_signs(signs, signs.device), persistent=False)
        self.transform = transform_for(signs.device, act_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.transform(x, self.signs)


def vllm_transform_refusal(tp_size: int) -> str | None:
    """Why vLLM's ``HadamardTransform`` cannot rotate this layer's input, or None."""
    from vllm.platforms import current_platform
    if tp_size > 1:   # transform/module.py and SharedWeightParameter raise NotImplementedError
        return "vLLM's HadamardTransform refuses tensor parallelism"
    if current_platform.is_cpu():   # its dense GEMM is then layer.cpu_linear, which nothing sets on it
        return "vLLM's HadamardTransform has no dense GEMM on a CPU platform"
    return None


_SCHEMES: dict = {}   # (block size, dtype, device) → compressed-tensors' TransformScheme of R


def vllm_transform(layer, signs: torch.Tensor, act_dtype: torch.dtype, in_features: int, out_features: int):
    """vLLM's own ``HadamardTransform`` of R (docs/KERNELS.md, "Rotated layers")."""
    from compressed_tensors.transform import TransformScheme
    from vllm.model_executor.layers.quantization.compressed_tensors.transform.module import HadamardTransform
    from vllm.model_executor.layers.quantization.compressed_tensors.transform.utils import TransformTuple
    from vllm.utils.torch_utils import set_default_torch_dtype
    # one scheme per block size (and dtype, device): vLLM's SharedWeightParameter keys its tensor by
    # (scheme, size), so every layer of a block size reads one b×b matrix, as all have the same R
    key = (signs.numel(), act_dtype, str(signs.device))
    if key not in _SCHEMES:
        _SCHEMES[key] = TransformScheme(**fmt.rotation.transform_scheme(signs.numel(), ["Linear"]))
    scheme = _SCHEMES[key]
    with torch.device(signs.device), set_default_torch_dtype(act_dtype):
        t = HadamardTransform({0: TransformTuple("latq_rotation", scheme, scheme.apply[0])}, layer,
                              FilledByLatq(layer.prefix), in_features, [out_features])
    part = t.weight.partitions[0]
    part.data.copy_(fmt.rotation.random_hadamard(signs.cpu()))
    # a fresh tensor: a freed one's address in vLLM's "already scaled" set must not skip its scaling
    HadamardTransform.scaled_data_ptrs.discard(part.data.data_ptr())
    t.process_weights_after_loading()
    t.label = "vllm"
    return t


def transform_tensor(t) -> torch.Tensor:
    """What a transform reads per call: latq's signs, or vLLM's b×b matrix."""
    return t.signs if isinstance(t, LatqTransform) else t.weight.partitions[0].data


def install_transform(layer, w: LatqWeight, act_dtype: torch.dtype, tp_size: int) -> str | None:
    """``layer.latq_transform``: vLLM's ``HadamardTransform`` where it serves, else latq's op → why not vLLM's."""
    why = vllm_transform_refusal(tp_size)
    if why is None:
        t = vllm_transform(layer, w.rotation, act_dtype, w.in_features, w.out_features)
    else:
        t = LatqTransform(w.rotation, act_dtype)
    layer.register_module("latq_transform", t)
    return why


# ---------------------------------------------------------------------------- mixtures of experts

def quant_args(bits: int, group: int):
    """compressed-tensors' description of latq's form: symmetric int, static groups."""
    from compressed_tensors.quantization import QuantizationArgs
    if group == -1:
        return QuantizationArgs(num_bits=bits, type="int", symmetric=True, strategy="channel")
    return QuantizationArgs(num_bits=bits, type="int", symmetric=True, strategy="group", group_size=group)


def choose_experts(weights: dict[tuple[int, str], LatqWeight], moe_config, device: torch.device, prefix: str):
    """(vLLM's ``CompressedTensorsWNA16MoEMethod`` for this layer, None) or (None, why not): the
    layer as ``QuantizationArgs`` at one group dividing every part (``vllm_moe.moe_groups``; half
    of it where Marlin MoE would misread w13's scales); backends a build lacks, that compute no
    such activations, or that emulate are refused."""
    why = vllm_moe.form_refusal(weights) or vllm_moe.policy_refusal(device)
    if why:
        return None, why
    try:
        from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.\
            compressed_tensors_moe_wna16 import CompressedTensorsWNA16MoEMethod
    except ImportError as e:
        return None, f"vLLM's WNA16 MoE method does not import ({e})"
    bits = next(iter(weights.values())).bits
    inter, hidden = moe_config.intermediate_size_per_partition, moe_config.hidden_dim
    for group in vllm_moe.candidate_groups(weights, inter, hidden):
        try:
            method = CompressedTensorsWNA16MoEMethod(quant_args(bits, group), None, moe_config, layer_name=prefix)
        except (ValueError, NotImplementedError, AssertionError) as e:   # vLLM's refusals (an assert for channelwise)
            why = why or f"vLLM has no WNA16 MoE backend for {bits}-bit group {group}: {str(e) or type(e).__name__}"
            continue
        hazard = method.is_marlin and vllm_moe.marlin_scale_hazard(group, inter, hidden)
        if not hazard:
            break
        why = hazard
    else:
        return None, why
    backend, experts = method.wna16_backend.value, method.experts_cls.__name__
    if backend in REFUSED_BACKENDS:
        return None, REFUSED_BACKENDS[backend]
    why = vllm_mp.computes_refusal(experts, moe_config.in_dtype)
    if why:
        return None, why
    missing = [op for op in PROBED_OPS.get(experts, ()) if not vllm_mp.op_available(op)]
    if missing:
        return None, f"vLLM chose {experts} but its op torch.ops._C.{missing[0]} is not in this build"
    return method, None


def register_experts(method, layer, weights: dict[tuple[int, str], LatqWeight], act_dtype: torch.dtype) -> None:
    """``method`` registers its parameters on ``layer`` (``create_weights``, on the experts'
    device: the layer's) and latq fills them (``vllm_moe.expert_tensors``)."""
    experts, m = layer.local_num_experts, method.moe
    name = getattr(layer, "layer_name", "experts")
    with torch.device(next(iter(weights.values())).qweight.device):
        method.create_weights(layer, experts, m.hidden_dim, m.intermediate_size_per_partition, act_dtype,
                              weight_loader=FilledByLatq(name))
    for param, t in vllm_moe.expert_tensors(weights, experts, method.group_size, act_dtype).items():
        _fill(name, param, getattr(layer, param), t)
    for stem in vllm_moe.STEMS:
        w = weights[0, stem]
        getattr(layer, f"{stem}_weight_shape").data.copy_(torch.tensor([w.out_features, w.in_features]))


def install_experts(method, layer, weights: dict[tuple[int, str], LatqWeight], act_dtype: torch.dtype) -> dict:
    """:func:`register_experts`, then the method repacks them for its backend; returns the bytes
    per expert and stem the backend's tensors hold."""
    register_experts(method, layer, weights, act_dtype)
    method.process_weights_after_loading(layer)
    experts = layer.local_num_experts
    return {stem: sum(t.numel() * t.element_size() for n, t in layer.named_parameters()
                      if n.startswith(stem + "_") and not n.endswith("_weight_shape")) // experts
            for stem in vllm_moe.STEMS}


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

    @staticmethod
    def shared_tensors(state: tuple[str, int]) -> dict[str, torch.Tensor]:
        return {}
