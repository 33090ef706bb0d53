"""vLLM's CUDA-graph start-up order (an eager warm-up at each size, then the capture) with watchers
for what must not happen inside a capture: a new kernel variant, an autotune, a host sync, a
scratch allocation. In Triton's interpreter the capture is patched on; on a GPU it is real."""
from __future__ import annotations

import contextlib
from unittest import mock

import torch

from ..kernels import graphs
from ..kernels.triton import dequant

SYNCS = ("item", "tolist", "cpu")


def _spec(v):
    """What of an argument Triton's compile key sees: dtype and alignment, an int's 1 / divisibility by 16."""
    if isinstance(v, torch.Tensor):
        return ("tensor", str(v.dtype), v.data_ptr() % 16 == 0)
    if isinstance(v, bool) or not isinstance(v, int):
        return repr(v)
    return ("int", v == 1, v % 16 == 0)


def unspecialized(fn) -> frozenset[int]:
    """Positions of ``fn``'s arguments Triton does not specialise (``do_not_specialize``)."""
    names = getattr(fn, "do_not_specialize", None) or getattr(fn, "kwargs", {}).get("do_not_specialize") or ()
    arg_names = list(getattr(fn, "arg_names", ()))
    return frozenset(n if isinstance(n, int) else arg_names.index(n) for n in names
                     if isinstance(n, int) or n in arg_names)


def compile_key(name, args, kwargs, skip: frozenset[int] = frozenset()) -> tuple:
    """A launch's compile key: runtime arguments as Triton specialises them, keywords by value."""
    return name, tuple(("int",) if i in skip and isinstance(a, int) else _spec(a) for i, a in enumerate(args)), \
        tuple(sorted((k, repr(v)) for k, v in kwargs.items()))


class CaptureWatch:
    """Records compile keys always and violations while ``capturing`` is on."""

    def __init__(self):
        self.capturing = False
        self.keys: set = set()
        self.violations: list[str] = []
        self._in_kernel = 0

    def _launched(self, name, args, kwargs, skip=frozenset()):
        key = compile_key(name, args, kwargs, skip)
        if self.capturing and key not in self.keys:
            self.violations.append(f"new compile key in capture: {name} {dict(kwargs)}")
        self.keys.add(key)

    def _wrap_run(self, cls):
        watch, orig = self, cls.run

        def run(fn, *args, **kwargs):
            watch._launched(getattr(fn, "__name__", repr(fn)), args,
                            {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}, unspecialized(fn))
            watch._in_kernel += 1
            try:
                return orig(fn, *args, **kwargs)
            finally:
                watch._in_kernel -= 1
        return mock.patch.object(cls, "run", run)

    def _wrap_sync(self, name):
        watch, orig = self, getattr(torch.Tensor, name)

        def sync(t, *a, **k):
            if watch.capturing and not watch._in_kernel:
                watch.violations.append(f"host sync in capture: Tensor.{name}()")
            return orig(t, *a, **k)
        return mock.patch.object(torch.Tensor, name, sync)

    def _wrap_autotune(self):
        from triton.runtime.autotuner import Autotuner
        watch, orig = self, Autotuner.run

        def run(tuner, *a, **k):
            if watch.capturing:
                watch.violations.append("autotuner ran in capture")
            return orig(tuner, *a, **k)
        return mock.patch.object(Autotuner, "run", run)

    def _wrap_alloc(self):
        watch, orig = self, dequant.Workspace.flat

        def flat(ws, numel, dtype, device):
            before = dict(ws._bufs)
            out = orig(ws, numel, dtype, device)
            if watch.capturing and (set(ws._bufs) != set(before) or any(ws._bufs[k] is not b for k, b in
                                                                         before.items())):
                watch.violations.append(f"latq scratch allocated in capture ({dtype}, {numel})")
            return out
        return mock.patch.object(dequant.Workspace, "flat", flat)

    @contextlib.contextmanager
    def installed(self, interpreted: bool):
        """Watch launches, host syncs, autotunes and scratch allocations; ``interpreted``: CPU as CUDA."""
        import triton.runtime.jit as jit
        with contextlib.ExitStack() as stack:
            if interpreted:
                from triton.runtime.interpreter import InterpretedFunction
                stack.enter_context(self._wrap_run(InterpretedFunction))
                stack.enter_context(mock.patch.object(graphs, "graph_device", lambda device: True))
                stack.enter_context(mock.patch.object(torch.cuda, "is_current_stream_capturing",
                                                      lambda: self.capturing))
            else:
                stack.enter_context(self._wrap_run(jit.JITFunction))
            for name in SYNCS:
                stack.enter_context(self._wrap_sync(name))
            stack.enter_context(self._wrap_autotune())
            stack.enter_context(self._wrap_alloc())
            yield self

    @contextlib.contextmanager
    def capture(self):
        self.capturing = True
        try:
            yield
        finally:
            self.capturing = False


def warmup_then_capture(watch: CaptureWatch, sizes, run, graph=None) -> None:
    """vLLM's order: per capture size, largest first, one eager call then its capture.
    ``run(size, phase)``: the forward at that size; ``graph``: on a GPU, the CUDA-graph capture context."""
    for size in sorted(sizes, reverse=True):
        run(size, "warmup")
        with watch.capture(), (graph() if graph else contextlib.nullcontext()):
            run(size, "capture")
