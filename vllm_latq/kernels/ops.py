"""Torch custom ops around the latq kernels: ``torch.ops.latq.<kernel>_linear(x, tensors, ints,
bias, out_features)`` per kernel on its flattened state, and ``torch.ops.latq.moe_experts``.
Each is one opaque node with a fake for torch.compile (dimension 0 dynamic), registered lazily
once per process when a layer first selects its kernel."""
from __future__ import annotations

import re
from typing import Optional

import torch

from . import moe
from .base import LatqKernel

NAMESPACE = "latq"
SCHEMA = "(Tensor x, Tensor?[] tensors, int[] ints, Tensor? bias, int out_features) -> Tensor"
_LIB: "torch.library.Library | None" = None
_OPS: dict[str, tuple[type[LatqKernel], "torch._ops.OpOverload"]] = {}


def op_name(kernel: type[LatqKernel]) -> str:
    return re.sub(r"\W", "_", kernel.name) + "_linear"


def op_for(kernel: type[LatqKernel]) -> "torch._ops.OpOverload":
    """The op a layer calls for ``kernel``: its native op if it has one, else the Python custom
    op (registered on first use). A native op has the same schema, implemented in C++ (the CPU
    kernel's ``latq_cpu::linear``): it skips Python per call and may call back into the Python
    op for the cases it leaves to it (the CPU kernel's large M)."""
    op = python_op_for(kernel)
    if getattr(kernel, "inner", None) is not None:   # a wrapper's native op may hand calls to the inner op
        python_op_for(kernel.inner)
    return kernel.native_op() or op


def plain_call(kernel: type[LatqKernel], state, tensors: list) -> "tuple[torch._ops.OpOverload, tuple[int, ...]] | None":
    """The lean op a layer calls without bias (``kernel.plain_op``; None: none) and the indices of
    the flattened tensors it takes after ``out_features``: those past the first two not None."""
    op = kernel.plain_op(state)
    if op is None:
        return None
    return op, tuple(i for i, t in enumerate(tensors[2:], 2) if t is not None)


def python_op_for(kernel: type[LatqKernel]) -> "torch._ops.OpOverload":
    """``torch.ops.latq.<name>_linear``: ``kernel.apply`` behind the custom-op schema."""
    name = op_name(kernel)
    if name in _OPS:
        registered, op = _OPS[name]
        if registered is not kernel:
            raise ValueError(f"two latq kernels map to op {NAMESPACE}::{name}: {registered} and {kernel}")
        return op

    apply, unflatten = kernel.apply, kernel.unflatten

    def impl(x: torch.Tensor, tensors: list[Optional[torch.Tensor]], ints: list[int],
             bias: Optional[torch.Tensor], out_features: int) -> torch.Tensor:
        return apply(unflatten(tensors, ints), x, bias)

    def fake(x, tensors, ints, bias, out_features):
        return x.new_empty((*x.shape[:-1], out_features))

    op = _register(name, SCHEMA, impl, fake)
    _OPS[name] = (kernel, op)
    return op


def _register(name: str, schema: str, impl, fake) -> "torch._ops.OpOverload":
    """Define op ``name`` with ``schema``, ``impl`` and ``fake`` through ``torch.library.Library``, as
    vLLM does: ``custom_op`` would wrap every call in Python dispatch layers. Inference only."""
    global _LIB
    impl.__name__ = name
    if _LIB is None:
        _LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
    _LIB.define(name + schema)
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_LIB)
    return getattr(getattr(torch.ops, NAMESPACE), name).default


MOE_NAME = "moe_experts"
MOE_SCHEMA = ("(Tensor x, Tensor topk_weights, Tensor topk_ids, Tensor?[] tensors, int[] ints, str activation, "
              "bool weights_on_input) -> Tensor")
_MOE_OP: "torch._ops.OpOverload | None" = None


def moe_op() -> "torch._ops.OpOverload":
    """``torch.ops.latq.moe_experts``: a layer's routed experts (:func:`~vllm_latq.kernels.moe.experts_forward`
    over the states :func:`~vllm_latq.kernels.moe.flatten` made), output ``[T, hidden]`` in
    ``x.dtype``; registered on first use. Opaque to torch.compile like the linear ops: the
    host path reads token counts on the host inside it (the stacked path does not: CUDA graphs)."""
    global _MOE_OP
    if _MOE_OP is None:
        def impl(x, topk_weights, topk_ids, tensors, ints, activation, weights_on_input):
            experts, stacked = moe.unflatten(tensors, ints)
            return moe.experts_forward(x, topk_weights, topk_ids, experts, activation,
                                       weights_on_input=weights_on_input, stacked=stacked)

        def fake(x, topk_weights, topk_ids, tensors, ints, activation, weights_on_input):
            return torch.empty_like(x)

        _MOE_OP = _register(MOE_NAME, MOE_SCHEMA, impl, fake)
    return _MOE_OP

