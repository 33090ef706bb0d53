"""Dequantize-once kernels: weights dequantized at load, every call one matmul of the unquantized shape.
``bf16`` is the fallback where no compressed kernel runs a layer (selecting it logs every
faster kernel's reason); ``dequant`` (fp32 weights, opt-in only) computes exactly the
reference's matmul, to check loading end to end at an unquantized layer's speed."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..format.rotation import unrotate
from .base import LatqKernel
from .weight import CodebookWeight, LatqWeight, dequantize


@dataclass
class DequantizedWeight:
    weight: torch.Tensor       # [out, in] dequantize(w), in the kernel's weight dtype


class _DequantizedKernel(LatqKernel):
    state_cls = DequantizedWeight
    forms = (LatqWeight, CodebookWeight)
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
    """Opt-in (``auto_select = False``): the reference's numbers at an unquantized layer's speed."""
    name = "dequant"
    weight_dtype = torch.float32
    auto_select = False

    @classmethod
    def apply(cls, state, x, bias=None):
        y = x.float() @ state.weight.T          # exactly latq_linear_ref's operations
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype)
