"""The torch reference that defines a latq linear's math, and the reference kernel behind the
kernel interface. Every kernel (Triton GPU, CPU) computes exactly :func:`latq_linear_ref` up to
floating-point summation order, and is tested against it. The reference kernel dequantizes and
multiplies in fp32 on every call; it runs anywhere and is selected only when forced
(``LATQ_KERNEL=reference``): the dequantize-once kernels cover every layer faster."""
from __future__ import annotations

from dataclasses import replace

import torch

from ..format.rotation import rotate
from .base import LatqKernel
from .served_bytes import runtime_bytes
from .weight import LatqWeight, dequantize, weight_bytes


def latq_linear_ref(x: torch.Tensor, w: LatqWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``y = x @ Wᵀ (+ bias)`` computed in fp32, returned in ``x.dtype``. x: ``[..., in]``. A rotated
    layer's inputs are rotated first, ``x·R`` rounded to x's dtype as every kernel feeds them."""
    if w.rotation is not None:
        x = rotate(x, w.rotation)
    y = x.float() @ dequantize(w).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


class ReferenceKernel(LatqKernel):
    """Dequantize + matmul in fp32 per call; its state is the runtime form itself (fp16 scales)."""
    name = "reference"

    @classmethod
    def can_implement(cls, w, device, act_dtype):
        return True, None

    @classmethod
    def prepare(cls, w):
        return replace(w, coded=None)   # it reads the fp16 scales (coded ones are their decode)

    @classmethod
    def flatten(cls, state):
        # the runtime form's tensors and ints: its ``coded`` (no tensor) is None here
        return [state.qweight, state.scales, state.crow, state.col, state.val], [state.bits, state.group_size,
                                                                                state.in_features]

    @classmethod
    def unflatten(cls, tensors, ints):
        return LatqWeight(*tensors, *ints)

    @classmethod
    def apply(cls, state, x, bias=None):
        return latq_linear_ref(x, state, bias)

    @classmethod
    def served_bytes(cls, state):
        return weight_bytes(state)

    @classmethod
    def layout_bytes(cls, n, k, bits, group, stats, scale_bits=None):
        return runtime_bytes(n, k, bits, group, stats)     # reads the fp16 decode of coded scales
