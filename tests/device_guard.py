"""A guard that proves, without a GPU, that code makes its tensors on its inputs' device.

On a CPU machine a tensor made without ``device=`` lands on the CPU like the inputs, so a
missing ``device=`` goes unnoticed until the code first meets a CUDA tensor and crashes. :func:`factories_follow_inputs` fails at the first call of a tensor
factory (``torch.arange``, ``zeros``, ``full``, ``tensor`` …) that names no device; ``*_like``,
``Tensor.new_*`` and ops on existing tensors follow their inputs by construction and pass.
``torch.tensor`` / ``as_tensor`` of a tensor keep its device and pass too.
"""
from __future__ import annotations

import contextlib
import traceback

import torch
from torch.overrides import TorchFunctionMode

FACTORIES = {torch.arange, torch.zeros, torch.ones, torch.empty, torch.full, torch.tensor, torch.as_tensor,
             torch.randperm, torch.linspace, torch.eye, torch.randint, torch.rand, torch.randn, torch.empty_strided,
             torch.scalar_tensor, torch.from_numpy}


class DeviceUnspecified(AssertionError):
    """A tensor factory was called without a device inside :func:`factories_follow_inputs`."""


class _Guard(TorchFunctionMode):
    def __init__(self, allow: tuple[str, ...]):
        super().__init__()
        self.allow = allow

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None and not self._follows_data(func, args):
            where = traceback.extract_stack(limit=2)[0]   # the caller of the factory
            site = f"{where.filename}:{where.lineno}"
            if not any(a in site or a in f"{where.filename}:{where.name}" for a in self.allow):
                name = getattr(func, "__name__", str(func))
                raise DeviceUnspecified(f"torch.{name} without device= at {site}: {where.line}")
        return func(*args, **kwargs)

    @staticmethod
    def _follows_data(func, args) -> bool:
        # torch.tensor(t) / as_tensor(t) of a tensor keep its device; from_numpy is CPU by definition
        # and is the caller's to move (flagged, unless allowed)
        return func in (torch.tensor, torch.as_tensor) and bool(args) and isinstance(args[0], torch.Tensor)


@contextlib.contextmanager
def factories_follow_inputs(allow: tuple[str, ...] = ()):
    """Within the block, a tensor factory called without ``device=`` raises
    :class:`DeviceUnspecified` naming the file and line; ``allow``: substrings of the sites
    (``file:line`` or ``file:function``, e.g. ``"format/layer.py:encode_layer"``) that are
    CPU-only by design (e.g. the Huffman codec's numpy side)."""
    with _Guard(allow):
        yield
