"""Which latq mixture-of-experts layers vLLM's own MoE kernels serve (every expert of a standard
form, one width per projection), and their stacked ``weight_packed`` / ``weight_scale``
tensors for vLLM's ``CompressedTensorsWNA16MoEMethod`` (docs/KERNELS.md)."""
from __future__ import annotations

import math

import torch

from . import selector, vllm_mp
from .weight import CodebookWeight, LatqWeight

NAME = vllm_mp.VllmMPKernel.name
STEMS = ("w13", "w2")


def form_refusal(weights: dict[tuple[int, str], LatqWeight]) -> str | None:
    """Why the experts ``{(local expert, stem): weight}`` are not one compressed-tensors WNA16
    MoE layer, or None."""
    for w in weights.values():
        if isinstance(w, CodebookWeight):
            return "experts: the codebook form (no vLLM kernel decodes E8 codes)"
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
    """The group sizes vLLM may be told, in order: the gcd of every projection's group and input size,
    then -1 (channelwise) where every projection has one scale per row."""
    groups = [vllm_mp.vllm_group(w) for w in weights.values()]
    g = math.gcd(*(w.in_features if g == -1 else g for g, w in zip(groups, weights.values())))
    return [g, -1] if all(g == -1 for g in groups) else [g]


def marlin_scale_hazard(group: int, inter: int, hidden: int) -> str | None:
    """Why vLLM's Marlin MoE would misread w13's scales at ``group``, or None: it permutes them for
    a K of the intermediate size, so where that is one group it reads several as one."""
    if group != -1 and inter <= group < hidden:
        return (f"vLLM's Marlin MoE permutes w13's {hidden // group} scale groups as one (this rank's "
                f"intermediate size {inter} is the group {group})")
    return None


def candidate_groups(weights: dict[tuple[int, str], LatqWeight], inter: int, hidden: int) -> list[int]:
    """:func:`moe_groups`, each followed by its half where Marlin MoE would misread it and the half is
    a Marlin group (exact, at twice the scale bytes)."""
    out = []
    for g in moe_groups(weights):
        out.append(g)
        if marlin_scale_hazard(g, inter, hidden) and g // 2 in (32, 64):
            out.append(g // 2)
    return out


def policy_refusal(device: torch.device) -> str | None:
    """Why latq's experts stay on this device whatever the form: on CPU vLLM's int4 experts quantize
    activations to int8 (W4A8), so they are opt-in (``LATQ_KERNEL=vllm``)."""
    forced = selector.forced_kernel()
    if forced and forced != NAME:
        return f"{selector.ENV_FORCE}={forced} forces latq's kernels"
    if not forced and torch.device(device).type == "cpu":
        return f"opt-in only on CPU ({selector.ENV_FORCE}={NAME})"
    return None


def expert_tensors(weights: dict[tuple[int, str], LatqWeight], experts: int, group: int,
                   act_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The WNA16 MoE parameters ``CompressedTensorsWNA16MoEMethod`` expects: ``w13_weight_packed``
    [E, 2I, H·b/32], ``w13_weight_scale`` [E, 2I, H/group] in ``act_dtype``, and w2's alike."""
    out = {}
    for stem in STEMS:
        ws = [weights[e, stem] for e in range(experts)]
        out[f"{stem}_weight_packed"] = torch.stack([vllm_mp.packed_words(w) for w in ws]).contiguous()
        out[f"{stem}_weight_scale"] = torch.stack([vllm_mp.group_scales(w, group) for w in ws]).to(act_dtype)
    return out
