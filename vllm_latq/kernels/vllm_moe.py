"""Which latq mixture-of-experts layers vLLM's own MoE kernels serve, and in which tensors.

A MoE layer whose experts all have a standard form (``vllm_mp.form_refusal``: 2-8 bits, no
outliers, whole int32 words a row) at one width for w13 and w2 is exactly a
compressed-tensors WNA16 MoE layer (symmetric int, pack-quantized): each expert's
``packed_words`` is the N-first ``weight_packed [N, K·b/32]``, stacked ``[E, N, K·b/32]`` (w13:
gate rows, then up rows), and its scales are ``weight_scale [E, N, G]`` at one group dividing
every expert's group, the hidden size and this rank's intermediate size (``gcd``, each part
keeping its group's scale). The plugin (``plugin/vllm_scheme.py``) hands them to vLLM's
``CompressedTensorsWNA16MoEMethod``, registered on the vLLM layer, whose backends (Marlin MoE on
CUDA, vLLM's Triton WNA16 experts where Marlin refuses the shape, ``CPUExpertsInt4`` on CPU)
repack and run them (4 and 8 bits: no backend of vLLM 0.32 but Humming's takes another width). On
CPU this is opt-in (``LATQ_KERNEL=vllm``, :func:`policy_refusal`).
"""
from __future__ import annotations

import math

import torch

from . import selector, vllm_mp
from .weight import LatqWeight

NAME = vllm_mp.VllmMPKernel.name
STEMS = ("w13", "w2")


def form_refusal(weights: dict[tuple[int, str], LatqWeight]) -> str | None:
    """Why the experts ``{(local expert, stem): weight}`` are not one compressed-tensors WNA16
    MoE layer, or None."""
    for w in weights.values():
        if w.rotation is not None:
            return "experts: rotated inputs (vLLM's MoE method has no input transform)"
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


def marlin_scale_hazard(group: int, inter: int, hidden: int) -> str | None:
    """Why vLLM's Marlin MoE would misread w13's scales at ``group``, or None. Its weight
    preparation permutes w13's scales for a K of this rank's intermediate size, not w13's own K
    (the hidden size): where the intermediate size is the group and the hidden size holds several
    groups, it lays them out as one scale per column, which its kernel (grouped: more than one
    scale row) reads as grouped — wrong products on a GPU."""
    if group != -1 and inter <= group < hidden:
        return (f"vLLM's Marlin MoE permutes w13's {hidden // group} scale groups as one (this rank's "
                f"intermediate size {inter} is the group {group})")
    return None


def candidate_groups(weights: dict[tuple[int, str], LatqWeight], inter: int, hidden: int) -> list[int]:
    """:func:`moe_groups`, each followed by its half where Marlin MoE would misread it
    (:func:`marlin_scale_hazard`) and the half is a group Marlin takes (each half keeps its
    group's scale: exact, at twice the scale bytes)."""
    out = []
    for g in moe_groups(weights):
        out.append(g)
        if marlin_scale_hazard(g, inter, hidden) and g // 2 in (32, 64):
            out.append(g // 2)
    return out


def policy_refusal(device: torch.device) -> str | None:
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
