"""The kernel interface every latq kernel implements (``can_implement → (ok, reason)``,
``prepare``, ``apply``, served bytes), and the flatten contract that lets a vLLM layer keep a
kernel's prepared state as buffers and static ints."""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .served_bytes import RUNTIME_WIDTHS, GridStats
from .weight import LatqWeight


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
    """Base class of the latq kernels (classmethods only: a kernel has no instance state).

    A vLLM layer keeps ``flatten(state)`` = (tensors as buffers, static ints), and one custom op per
    kernel calls ``apply(unflatten(...), x, bias)`` (``kernels/ops.py``), opaque to tracing. The
    defaults handle a dataclass ``state_cls`` of non-sparse tensors and ints. ``served_bytes`` measures a
    prepared state, ``layout_bytes`` predicts it from the integers' statistics (docs/ARCHITECTURE.md)."""
    name = "base"
    state_cls: type = LatqWeight  # what prepare() returns (used by the default unflatten)
    auto_select = True            # False: only when forced by name (``LATQ_KERNEL``)
    # True: no prepare/apply of its own — vLLM's layer code serves the layers it is chosen for
    # (the plugin installs it: ``plugin/vllm_scheme.py``)
    delegated = False
    widths: tuple[int, ...] = RUNTIME_WIDTHS   # inlier widths the kernel takes
    # the runtime forms (kernels/weight.py) it takes: the selector asks only kernels of the layer's form
    forms: tuple[type, ...] = (LatqWeight,)
    # the family it belongs to (selector.FAMILY_OF_DEVICE; None: its name): a family's kernel for each form
    family: str | None = None

    @classmethod
    def unavailable_here(cls) -> str | None:
        """Why the kernel can serve no layer on this machine (no device of its kind), or None: forcing it is refused."""
        return None

    @classmethod
    def can_implement(cls, w: LatqWeight, device: torch.device, act_dtype: torch.dtype) -> tuple[bool, str | None]:
        """(True, None), or (False, why not) for this layer, device and activation dtype."""
        raise NotImplementedError

    @classmethod
    def prepare(cls, w: LatqWeight) -> Any:
        """Repack once at load; the result is what ``apply`` receives."""
        raise NotImplementedError

    @classmethod
    def apply(cls, state: Any, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    @classmethod
    def place(cls, state: Any) -> None:
        """Move the prepared state where the served model keeps it, in load order (default: it stays)."""

    @classmethod
    def reserve(cls, state: Any, act_dtype: torch.dtype) -> None:
        """Allocate at load what ``apply`` would otherwise allocate on a first large call (a
        buffer grown during CUDA-graph capture would be freed under the captured graph)."""

    @classmethod
    def served_bytes(cls, state: Any) -> dict[str, int]:
        """Bytes of the prepared state one decode step streams, by part (default: every state
        tensor, as ``other``)."""
        tensors, _ = cls.flatten(state)
        return {"other": sum(t.numel() * t.element_size() for t in tensors if t is not None)}

    @classmethod
    def layout_bytes(cls, n: int, k: int, bits: int, group: int, stats: GridStats,
                     scale_bits: int | None = None) -> dict[str, int]:
        """``served_bytes`` of the state ``prepare`` would build for an ``n``×``k`` layer of these
        integers (``stats``) and scales (``scale_bits``: coded; None: fp16); ValueError if it cannot."""
        raise NotImplementedError

    @classmethod
    def codebook_bytes(cls, n: int, k: int, bits: int, group: int, scale_bits: int | None = None) -> dict[str, int]:
        """``served_bytes`` of the state ``prepare`` would build for an ``n``×``k`` codebook layer
        (:class:`~.weight.CodebookWeight`, ``bits`` its code's): kernels of that form only."""
        raise NotImplementedError

    @classmethod
    def shared_tensors(cls, state: Any) -> dict[str, torch.Tensor]:
        """Parts of ``served_bytes`` that every layer of a model reads from one tensor (a decode
        step streams them once), by part: none by default."""
        return {}

    @classmethod
    def label(cls, state: Any) -> str:
        """The kernel's name in the load report (a family that delegates names its pick)."""
        return cls.name

    @classmethod
    def native_op(cls):
        """An op with the custom-op schema implemented natively (no Python per call), to use
        instead of ``torch.ops.latq.<name>_linear``; None: use that one."""
        return None

    @classmethod
    def plain_op(cls, state: Any, rotated: bool = False):
        """A native op ``(x, tensors[0], tensors[1], ints, out_features, *rest)`` (``ops.plain_call``):
        the native op's math without bias, fewer arguments to parse per call; None: none
        (``rotated``: the op for a rotated layer, the signs after ``out_features``)."""
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
