"""The output head (``--quantize-lm-head``): quantized like a block linear after the last block,
its Hessian from the final norm's outputs; a tied head is written untied as ``lm_head.*``
(by default only where that keeps the checkpoint smaller: head_size.py)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

from .. import hf_model
from . import ranks
from .calibrate import head_hessian
from .ranks import SINGLE, World
from .source import SourceWeights

log = logging.getLogger("vllm_latq.quantize")


@dataclass(frozen=True)
class HeadPlan:
    name: str       # the head module's name (lm_head)
    weight: str     # the source tensor holding its weight: the embedding's when tied
    norm: str       # the final norm module's name (hf_model.final_norm)


def head_plan(net: torch.nn.Module, prefix: str, tied: bool, weights: SourceWeights) -> HeadPlan:
    """Where the head of ``net`` (decoder blocks under ``prefix``; ``tied`` to the input
    embedding), its weight in ``weights`` and the final norm are; refuses heads it cannot quantize."""
    head = net.get_output_embeddings()
    names = {m: n for n, m in net.named_modules()}
    if not isinstance(head, torch.nn.Linear) or head not in names:
        raise hf_model.UnsupportedModelError(f"{type(net).__name__}: the output head is not an nn.Linear; "
                                             "cannot quantize it")
    if head.bias is not None:
        raise hf_model.UnsupportedModelError(f"{type(net).__name__}: quantizing an lm_head with a bias is not supported")
    head_name = names[head]
    weight = f"{head_name}.weight"
    if tied:
        weight = f"{names[net.get_input_embeddings()]}.weight"
    if weight not in weights.where:
        raise ValueError(f"the head's weight {weight} is not in the source safetensors")
    return HeadPlan(head_name, weight, hf_model.final_norm(net, prefix))


@torch.no_grad()
def quantize_head(net: torch.nn.Module, weights: SourceWeights, plan: HeadPlan, inps: torch.Tensor | None,
                  quantize: Callable, device, progress: bool, world: World = SINGLE) -> tuple[dict, list[dict]]:
    """Quantize the head of ``net`` with ``quantize(name, W, hessian)`` on the last block's outputs
    ``inps`` (None: uncalibrated) → its checkpoint tensors and stats records; with several ranks
    the Hessian is summed and rank 0 alone solves and writes."""
    norm = net.get_submodule(plan.norm)
    dtype = inps.dtype if inps is not None else torch.float32  # the calibration forwards' dtype
    for n, p in list(norm.named_parameters()):
        hf_model.set_tensor(norm, n, weights.get(f"{plan.norm}.{n}").to(device=device, dtype=dtype))
    W = weights.get(plan.weight).to(device=device, dtype=torch.float32)
    t0 = time.time()
    hs = None
    if inps is not None:
        with ranks.together(f"{plan.name}: Hessian", world):
            hs = head_hessian(norm, inps, W.shape[1], device, plan.name, progress)
        ranks.sum_hessian(hs, world, plan.name)
    t, records = {}, []
    with ranks.together(plan.name, world):
        if world.writes:
            _, t, record = quantize(plan.name, W, hs)
            records.append(record)
    log.info("%s (weight from %s, Hessian from %s outputs): %.1fs", plan.name, plan.weight, plan.norm,
             time.time() - t0)
    hf_model.to_meta(norm)
    return t, records
