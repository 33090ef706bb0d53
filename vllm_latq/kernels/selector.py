"""Kernel selection: each kernel class says whether it can run a layer, and why not.

A kernel turns the runtime form (:class:`~vllm_latq.kernels.reference.LatqWeight`) into its
own layout once at load (``prepare``) and computes ``y = x @ Wᵀ (+ bias)`` per call
(``apply``), matching :func:`~vllm_latq.kernels.reference.latq_linear_ref`.
The selector tries ``KERNELS`` in order (fastest first); ``LATQ_KERNEL=<name>`` forces one,
and an impossible forced choice raises with every kernel's reason.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from .reference import LatqWeight, latq_linear_ref

ENV_FORCE = "LATQ_KERNEL"


class LatqKernel:
    name = "base"

    @classmethod
    def can_implement(cls, w: LatqWeight, device: torch.device, act_dtype: torch.dtype) -> tuple[bool, str | None]:
        raise NotImplementedError

    @classmethod
    def prepare(cls, w: LatqWeight) -> Any:
        """Repack once at load; the result is what ``apply`` receives."""
        raise NotImplementedError

    @classmethod
    def apply(cls, state: Any, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError


class ReferenceKernel(LatqKernel):
    """Dequantize + matmul in fp32: the definition of correctness, runs anywhere."""
    name = "reference"

    @classmethod
    def can_implement(cls, w, device, act_dtype):
        return True, None

    @classmethod
    def prepare(cls, w):
        return w

    @classmethod
    def apply(cls, state, x, bias=None):
        return latq_linear_ref(x, state, bias)


def kernels() -> list[type[LatqKernel]]:
    """All kernels, fastest first. Optional ones register here when importable."""
    found: list[type[LatqKernel]] = []
    try:
        from .triton_kernels import TritonKernel
        found.append(TritonKernel)
    except ImportError:
        pass
    try:
        from .cpu import CPUKernel
        found.append(CPUKernel)
    except ImportError:
        pass
    return found + [ReferenceKernel]


def select(w: LatqWeight, device: torch.device, act_dtype: torch.dtype) -> type[LatqKernel]:
    forced = os.environ.get(ENV_FORCE)
    reasons = []
    for k in kernels():
        if forced and k.name != forced:
            continue
        ok, why = k.can_implement(w, device, act_dtype)
        if ok:
            return k
        reasons.append(f"{k.name}: {why}")
    names = [k.name for k in kernels()]
    if forced and forced not in names:
        raise ValueError(f"{ENV_FORCE}={forced!r} is not a latq kernel; available: {names}")
    raise ValueError(f"no latq kernel can run this layer ({w.out_features}x{w.in_features}, "
                     f"{w.bits}-bit, device {device}, {act_dtype}): " + "; ".join(reasons))
