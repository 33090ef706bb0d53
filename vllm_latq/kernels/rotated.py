"""A rotated layer (``LatqWeight.rotation``) through any kernel: ``x → x·R``, then the kernel on
the stored weights, which quantize ``W·R``; the wrapper's state and flattened form are the kernel's
plus the signs, so one op serves it (docs/KERNELS.md, "Rotated layers")."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from .. import native
from ..format.rotation import rotate
from .base import LatqKernel


def transform_for(device: torch.device, dtype: torch.dtype) -> Callable:
    """``f(x, signs) = x·R`` for ``dtype`` activations on ``device``: Triton's kernel on a GPU, the
    C++ op on a CPU where it is built, torch's butterflies elsewhere (chosen once, it traces)."""
    if device.type == "cuda":
        from .triton.hadamard import hadamard
        return hadamard
    if device.type == "cpu" and native.usable() and dtype in (torch.bfloat16, torch.float16, torch.float32):
        return torch.ops.latq_cpu.hadamard
    return rotate


_SHARED_SIGNS: dict[tuple[str, tuple[float, ...]], torch.Tensor] = {}


def shared_signs(signs: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One fp32 copy of ``signs`` per device for the whole model: R depends only on the seed and
    the block, so every layer of a block size reads the same vector."""
    key = (str(torch.device(device)), tuple(signs.tolist()))
    if key not in _SHARED_SIGNS:
        _SHARED_SIGNS[key] = signs.to(device, torch.float32).contiguous()
    return _SHARED_SIGNS[key]


def rotate_activations(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """``x·R`` in x's dtype (computed in fp32), R of the b = ``len(signs)`` blocks."""
    return transform_for(x.device, x.dtype)(x, signs)


@dataclass
class RotatedState:
    inner: Any                 # the wrapped kernel's prepared state
    signs: torch.Tensor        # fp32 [b]: the rotation's signs


class RotatedKernel(LatqKernel):
    """``inner`` on rotated inputs (classes made by :func:`rotated_kernel`)."""
    inner: type[LatqKernel]
    state_cls = RotatedState

    @classmethod
    def can_implement(cls, w, device, act_dtype):
        return cls.inner.can_implement(replace(w, rotation=None), device, act_dtype)

    @classmethod
    def prepare(cls, w):
        if w.rotation is None:
            raise ValueError(f"kernel {cls.name}: the layer has no rotation")
        return RotatedState(cls.inner.prepare(replace(w, rotation=None)), shared_signs(w.rotation, w.scales.device))

    @classmethod
    def apply(cls, state, x, bias=None):
        fused = getattr(cls.inner, "apply_rotated", None)   # the inner op rotates x itself: one call, not two
        if fused is not None:
            return fused(state.inner, x, state.signs, bias)
        return cls.inner.apply(state.inner, rotate_activations(x, state.signs), bias)

    @classmethod
    def place(cls, state):
        cls.inner.place(state.inner)

    @classmethod
    def reserve(cls, state, act_dtype):
        cls.inner.reserve(state.inner, act_dtype)

    @classmethod
    def served_bytes(cls, state):
        return {**cls.inner.served_bytes(state.inner), "rotation": state.signs.numel() * state.signs.element_size()}

    @classmethod
    def shared_tensors(cls, state):
        return {**cls.inner.shared_tensors(state.inner), "rotation": state.signs}

    @classmethod
    def layout_bytes(cls, n, k, bits, group, stats, scale_bits=None):
        return cls.inner.layout_bytes(n, k, bits, group, stats, scale_bits)

    @classmethod
    def codebook_bytes(cls, n, k, bits, group, scale_bits=None):
        return cls.inner.codebook_bytes(n, k, bits, group, scale_bits)

    @classmethod
    def label(cls, state):
        return f"{cls.inner.label(state.inner)}+hadamard"

    @classmethod
    def native_op(cls):
        """The inner kernel's native op where it rotates a trailing signs tensor itself (the
        CPU op; ``ops.op_for`` registers the inner kernel's Python op, which it hands large M)."""
        return cls.inner.native_op() if getattr(cls.inner, "native_rotation", False) else None

    @classmethod
    def plain_op(cls, state):
        """The inner kernel's lean op for rotated inputs where its native op rotates."""
        return cls.inner.plain_op(state.inner, rotated=True) if getattr(cls.inner, "native_rotation", False) else None

    @classmethod
    def flatten(cls, state):
        tensors, ints = cls.inner.flatten(state.inner)
        return [*tensors, state.signs], ints

    @classmethod
    def unflatten(cls, tensors, ints):
        return RotatedState(cls.inner.unflatten(tensors[:-1], ints), tensors[-1])


_WRAPPED: dict[type, type] = {}


def rotated_kernel(kernel: type[LatqKernel]) -> type[LatqKernel]:
    """``kernel`` on rotated inputs (one class per kernel, named ``<name>+hadamard``)."""
    if kernel not in _WRAPPED:
        _WRAPPED[kernel] = type(f"Rotated{kernel.__name__}", (RotatedKernel,),
                                {"inner": kernel, "name": f"{kernel.name}+hadamard", "widths": kernel.widths,
                                 "auto_select": kernel.auto_select, "forms": kernel.forms, "family": kernel.family})
    return _WRAPPED[kernel]


def for_weight(kernel: type[LatqKernel], w) -> type[LatqKernel]:
    """The kernel that serves ``w``: ``kernel`` itself, or wrapped when ``w`` is rotated and the
    kernel neither folds the rotation into its own state nor is vLLM's (``delegated``: the plugin
    puts the transform in front of vLLM's scheme, ``plugin/vllm_scheme.install_transform``)."""
    if w.rotation is None or getattr(kernel, "folds_rotation", False) or kernel.delegated:
        return kernel   # a delegated kernel's layer code gets the transform from the plugin
    return rotated_kernel(kernel)


def with_rotation(w, rotation, in_features: int, col0: int, layer: str):
    """``w`` (this rank's columns ``[col0, col0 + w.in_features)`` of an ``in_features``-column
    layer) with the signs of a rotated checkpoint's ``rotation`` (``format.Rotation``; None: ``w``
    itself). A row-parallel cut must fall on the rotation's blocks, for a rank to rotate its own
    columns: at tensor-parallel size t, where the block divides in_features / t."""
    if rotation is None:
        return w
    b = rotation.block_size(in_features)
    if col0 % b or w.in_features % b:
        raise ValueError(f"latq: layer {layer}: this rank's input columns [{col0}, {col0 + w.in_features}) cut the "
                         f"rotation's {b}-column blocks ({in_features} columns): a rotated checkpoint serves at "
                         f"tensor-parallel sizes t where {b} divides {in_features} / t")
    return replace(w, rotation=rotation.signs(in_features))
