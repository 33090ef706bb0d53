"""Dequantize-once kernels: the weights are dequantized at load (``weight.dequantize``)
and every call is a dense matmul — an unquantized layer's memory and speed, instead of the
reference's dequantization on every call (seconds per step on a large head).

* :class:`DequantizedBf16Kernel` (``bf16``): the fallback when no compressed kernel can run a
  layer (e.g. an 8-bit ``--lm-head-bits`` head on a GPU, where the Triton kernels cover 2–5
  bits). Selecting it logs a warning with every faster kernel's reason. Equals the reference
  up to the bf16 rounding of the weights (and of the activations).
* :class:`DequantizedFp32Kernel` (``dequant``): opt-in only — keeps fp32 weights (4
  bytes/weight, twice bf16), so it is never selected automatically; it exists to check
  loading end to end on real models at dense speed. Computes exactly
  :func:`~vllm_latq.kernels.reference.latq_linear_ref`: the same fp32 matmul on the same
  dequantized matrix.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..format.rotation import unrotate
from .base import LatqKernel
from .weight import dequantize


@dataclass
class DequantizedWeight:
    weight: torch.Tensor       # [out, in] dequantize(w), in the kernel's weight dtype


class _DequantizedKernel(LatqKernel):
    state_cls = DequantizedWeight
    weight_dtype: torch.dtype

    @classmethod
    def can_implement(cls, w, device, act_dtype):
        return True, None

    @classmethod
    def prepare(cls, w):
        W = dequantize(w)
        if w.rotation is not None:   # folds_rotation: the weight it serves, Q·Rᵀ, once
            W = unrotate(W, w.rotation)
        return DequantizedWeight(W.to(cls.weight_dtype).contiguous())


class DequantizedBf16Kernel(_DequantizedKernel):
    """The fallback: bf16 weights, ``F.linear`` in bf16, output in x.dtype; a rotated layer's
    rotation folded into the weights (``Q·Rᵀ``), so its inputs need no transform."""
    name = "bf16"
    weight_dtype = torch.bfloat16
    folds_rotation = True

    @classmethod
    def apply(cls, state, x, bias=None):
        y = torch.nn.functional.linear(x.to(torch.bfloat16), state.weight,
                                       None if bias is None else bias.to(torch.bfloat16))
        return y.to(x.dtype)


class DequantizedFp32Kernel(_DequantizedKernel):
    """Opt-in (``auto_select = False``): the reference's numbers at dense speed."""
    name = "dequant"
    weight_dtype = torch.float32
    auto_select = False

    @classmethod
    def apply(cls, state, x, bias=None):
        y = x.float() @ state.weight.T          # exactly latq_linear_ref's operations
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype)
