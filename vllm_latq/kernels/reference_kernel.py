"""The reference kernel: :func:`~vllm_latq.kernels.reference.latq_linear_ref` behind the
kernel interface — dequantize + matmul in fp32 on every call. The definition of correctness,
runs anywhere; selected only when forced (``LATQ_KERNEL=reference``), because the
dequantize-once kernels (:mod:`~vllm_latq.kernels.dequantized`) cover every layer faster."""
from __future__ import annotations

from .base import LatqKernel
from .reference import latq_linear_ref, runtime_bytes, weight_bytes


class ReferenceKernel(LatqKernel):
    """Dequantize + matmul in fp32 per call; its state is the runtime form itself."""
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

    @classmethod
    def served_bytes(cls, state):
        return weight_bytes(state)

    @classmethod
    def layout_bytes(cls, n, k, bits, group, stats, scale_bits=None):
        return runtime_bytes(n, k, bits, group, stats)     # reads the fp16 decode of coded scales
