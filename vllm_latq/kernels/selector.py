"""Kernel selection: each kernel class says whether it can run a layer, and why not.

A kernel turns the runtime form (:class:`~vllm_latq.kernels.reference.LatqWeight`) into its
own layout once at load (``prepare``) and computes ``y = x @ Wᵀ (+ bias)`` per call
(``apply``), matching :func:`~vllm_latq.kernels.reference.latq_linear_ref`.
The selector tries ``KERNELS`` in order (fastest first); ``LATQ_KERNEL=<name>`` forces one,
and an impossible forced choice raises with every kernel's reason.

Custom-op contract (vLLM's compiled mode, CUDA graphs): the vLLM layer does not keep the
state object; it keeps ``flatten(state)`` = (tensors, ints) — the tensors as module buffers,
the ints as static Python ints — and ``kernels/ops.py`` runs one ``torch.library`` custom op
per kernel (``torch.ops.latq.<name>_linear``) that calls ``apply(unflatten(tensors, ints),
x, bias)``. The defaults below handle a state that is a dataclass of ``state_cls`` whose
fields are tensors (annotation mentions ``Tensor``; ``None`` allowed) or ints; a kernel with
another state overrides ``flatten``/``unflatten``. Inside ``apply`` anything goes (batch-size
branches, ``.item()``, sparse tensors built from dense crow/col/val): the op is opaque to
tracing. State tensors must be dense (no sparse layouts) and on the layer's device.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import torch

from .reference import LatqWeight, dequantize, latq_linear_ref

ENV_FORCE = "LATQ_KERNEL"


def _is_tensor_field(f: dataclasses.Field) -> bool:
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    return "Tensor" in str(t)


def flatten_dataclass(state: Any) -> tuple[list[torch.Tensor | None], list[int]]:
    """A dataclass state → (tensor fields, int fields), each in field order."""
    if not dataclasses.is_dataclass(state):
        raise TypeError(f"kernel state {type(state).__name__} is not a dataclass: override flatten/unflatten")
    tensors, ints = [], []
    for f in dataclasses.fields(state):
        v = getattr(state, f.name)
        if _is_tensor_field(f):
            if v is not None and not isinstance(v, torch.Tensor):
                raise TypeError(f"{type(state).__name__}.{f.name} must be a tensor or None, got {type(v).__name__}")
            tensors.append(v)
        elif isinstance(v, (bool, int)):
            ints.append(int(v))
        else:
            raise TypeError(f"{type(state).__name__}.{f.name}: state fields must be tensors or ints, "
                            f"got {type(v).__name__}")
    return tensors, ints


_POSITIONAL: dict[type, bool] = {}


def unflatten_dataclass(cls: type, tensors, ints) -> Any:
    """Inverse of :func:`flatten_dataclass`. Runs once per custom-op call: when every tensor
    field precedes every int field (checked once per class) it is one positional call."""
    pos = _POSITIONAL.get(cls)
    if pos is None:
        flags = [_is_tensor_field(f) for f in dataclasses.fields(cls)]
        pos = _POSITIONAL[cls] = flags == sorted(flags, reverse=True)
    if pos:
        return cls(*tensors, *ints)
    kw, ti, ii = {}, iter(tensors), iter(ints)
    for f in dataclasses.fields(cls):
        kw[f.name] = next(ti) if _is_tensor_field(f) else next(ii)
    return cls(**kw)


class LatqKernel:
    name = "base"
    state_cls: type = LatqWeight  # what prepare() returns (used by the default unflatten)

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

    @classmethod
    def native_op(cls):
        """An op with the custom-op schema implemented natively (no Python per call), to use
        instead of ``torch.ops.latq.<name>_linear``; None: use that one."""
        return None

    @classmethod
    def flatten(cls, state: Any) -> tuple[list[torch.Tensor | None], list[int]]:
        """State → (tensors, static ints) for the custom op; inverse of ``unflatten``."""
        if not isinstance(state, cls.state_cls):
            raise TypeError(f"kernel {cls.name}: prepare() returned {type(state).__name__}, "
                            f"state_cls is {cls.state_cls.__name__}")
        return flatten_dataclass(state)

    @classmethod
    def unflatten(cls, tensors: list[torch.Tensor | None], ints: list[int]) -> Any:
        return unflatten_dataclass(cls.state_cls, tensors, ints)


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


@dataclasses.dataclass
class DenseState:
    weight: torch.Tensor       # bf16 [out, in], dequantize(w) rounded once


class DenseFallbackKernel(LatqKernel):
    """The fallback when no compressed kernel can run a layer (e.g. an 8-bit ``--lm-head-bits``
    head on a GPU, where the Triton kernels cover 2–4 bits): dequantize once at load to bf16
    and run ``F.linear`` — an unquantized layer's memory and speed, instead of the reference's
    dequantization on every call (seconds per step on a large head). Selecting it logs a
    warning with every faster kernel's reason. Equals the reference up to the bf16 rounding
    of the weights (and of the activations)."""
    name = "dense"
    state_cls = DenseState

    @classmethod
    def can_implement(cls, w, device, act_dtype):
        return True, None

    @classmethod
    def prepare(cls, w):
        return DenseState(dequantize(w).to(torch.bfloat16).contiguous())

    @classmethod
    def apply(cls, state, x, bias=None):
        y = torch.nn.functional.linear(x.to(torch.bfloat16), state.weight,
                                       None if bias is None else bias.to(torch.bfloat16))
        return y.to(x.dtype)


@dataclasses.dataclass
class DequantState:
    weight: torch.Tensor       # fp32 [out, in], dequantize(w)


class DequantKernel(LatqKernel):
    """Opt-in only (``LATQ_KERNEL=dequant``): the reference's numbers at dense speed.
    Dequantizes once at load and keeps fp32 weights (4 bytes/weight, twice bf16), so it is
    never selected automatically; it exists to check loading end to end on real models
    (the reference re-dequantizes every call: seconds per decode step). Computes exactly
    :func:`latq_linear_ref`: the same fp32 matmul on the same dequantized matrix."""
    name = "dequant"
    state_cls = DequantState

    @classmethod
    def can_implement(cls, w, device, act_dtype):
        if os.environ.get(ENV_FORCE) != cls.name:
            return False, f"opt-in only ({ENV_FORCE}={cls.name}): keeps fp32 weights"
        return True, None

    @classmethod
    def prepare(cls, w):
        return DequantState(dequantize(w).contiguous())

    @classmethod
    def apply(cls, state, x, bias=None):
        y = x.float() @ state.weight.T
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype)


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
    return found + [DenseFallbackKernel, ReferenceKernel, DequantKernel]


_WARNED: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _WARNED:
        _WARNED.add(msg)
        logging.getLogger("vllm.latq").warning(msg)   # under vLLM's log config


def select(w: LatqWeight, device: torch.device, act_dtype: torch.dtype) -> type[LatqKernel]:
    forced = os.environ.get(ENV_FORCE)
    reasons = []
    for k in kernels():
        if forced and k.name != forced:
            continue
        ok, why = k.can_implement(w, device, act_dtype)
        if ok:
            if k is DenseFallbackKernel and not forced:
                _warn_once(f"latq: no compressed kernel runs {w.out_features}x{w.in_features} {w.bits}-bit layers "
                           f"on {device} ({'; '.join(reasons)}): they run dequantized to bf16 (kernel 'dense')")
            return k
        reasons.append(f"{k.name}: {why}")
    names = [k.name for k in kernels()]
    if forced and forced not in names:
        raise ValueError(f"{ENV_FORCE}={forced!r} is not a latq kernel; available: {names}")
    raise ValueError(f"no latq kernel can run this layer ({w.out_features}x{w.in_features}, "
                     f"{w.bits}-bit, device {device}, {act_dtype}): " + "; ".join(reasons))
