"""The reference kernel: :func:`~vllm_latq.kernels.reference.latq_linear_ref` behind the
kernel interface — dequantize + matmul in fp32 on every call. The definition of correctness,
runs anywhere; selected only when forced (``LATQ_KERNEL=reference``), because the
dequantize-once kernels (:mod:`~vllm_latq.kernels.dequantized`) cover every layer faster."""
from __future__ import annotations

from dataclasses import replace

from .base import LatqKernel
from .reference import LatqWeight, latq_linear_ref, runtime_bytes, weight_bytes


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
