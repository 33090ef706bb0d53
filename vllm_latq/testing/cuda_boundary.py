"""The CUDA boundary, run on CPU: vLLM's platform stubbed as a CUDA GPU of a given capability and
its CUDA ops replaced by the stand-ins of :mod:`.cuda_ops`; everything up to the CUDA call runs
unchanged. :func:`cuda_boundary` is the one entry."""
from __future__ import annotations

import contextlib
from unittest import mock

import torch

SMS = 108      # streaming multiprocessors the stub reports (an A100's; only workspace sizes read it)
# vLLM modules whose import-time checks ask the real platform (CPU-only ops, capability probes):
# imported before the stub, as vLLM imports them at start-up on a GPU
PRELOAD = ("vllm.model_executor.layers.linear", "vllm.model_executor.layers.fused_moe",
           "vllm.model_executor.layers.fused_moe.experts.marlin_moe",
           "vllm.model_executor.layers.fused_moe.oracle.int_wna16",
           "vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16",
           "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe."
           "compressed_tensors_moe_wna16",
           "vllm.model_executor.kernels.linear", "vllm.model_executor.layers.quantization.utils.marlin_utils_test",
           "vllm.model_executor.layers.quantization.online.fp8")


class _NoDriver:
    """A Triton backend's driver that is never the active one."""

    @staticmethod
    def is_active() -> bool:
        return False


def vllm_sees_triton() -> None:
    """Before vLLM is imported: keep its Triton kernels real ``@triton.jit`` functions, run by the
    interpreter, through an inert "cpu" entry in Triton's backend table (a CPU build of vLLM binds
    them to placeholders where Triton has no "cpu" backend)."""
    import sys

    import triton.backends
    if "vllm.triton_utils" in sys.modules:
        raise RuntimeError("vllm_sees_triton() must run before vLLM is imported")
    triton.backends.backends.setdefault("cpu", triton.backends.Backend(compiler=None, driver=_NoDriver))


@contextlib.contextmanager
def cuda_platform(cc: int):
    """vLLM's ``current_platform`` (patched on its class, so its own helpers see it) and torch's
    capability query answer as a CUDA GPU of capability ``cc``; the allocator's release and vLLM's
    current stream answer as on the host, whose tensors stay on the CPU."""
    import importlib
    for name in PRELOAD:
        importlib.import_module(name)
    from vllm.platforms import PlatformEnum, current_platform
    from vllm.platforms.interface import DeviceCapability
    cap = DeviceCapability(cc // 10, cc % 10)
    cls = type(current_platform)
    patches = {"_enum": PlatformEnum.CUDA, "device_type": "cuda", "device_name": "cuda",
               "get_device_capability": classmethod(lambda c, device_id=0: cap),
               "num_compute_units": classmethod(lambda c, device_id=0: SMS),
               "get_device_name": classmethod(lambda c, device_id=0: f"stub sm_{cc}")}
    with contextlib.ExitStack() as stack:
        for name, value in patches.items():
            stack.enter_context(mock.patch.object(cls, name, value, create=True))
        stack.enter_context(mock.patch.object(torch.cuda, "get_device_capability",
                                              lambda device=None: (cc // 10, cc % 10)))
        # the CUDA caching allocator's release (vLLM's workspace growth calls it): nothing to release
        stack.enter_context(mock.patch.object(torch.accelerator, "empty_cache", lambda: None))
        # vLLM's current CUDA stream (its per-stream workspaces key on it): the host's placeholder
        from vllm.utils import torch_utils
        stack.enter_context(mock.patch.object(torch_utils._current_stream_tls, "value",
                                              torch_utils._StreamPlaceholder(), create=True))
        yield current_platform


@contextlib.contextmanager
def cuda_ops():
    """``torch.ops._C`` / ``torch.ops._moe_C`` answer the ops of :data:`.cuda_ops.STAND_INS` with
    their CPU stand-ins (an op the build has is shadowed, and restored after)."""
    from . import cuda_ops as stand
    import vllm._custom_ops  # noqa: F401  (loads vLLM's _C library before its namespace is patched)
    with contextlib.ExitStack() as stack:
        for ns, ops in stand.STAND_INS.items():
            namespace = getattr(torch.ops, ns)
            for name, fn in ops.items():
                stack.enter_context(mock.patch.object(namespace, name, fn, create=True))
        yield


@contextlib.contextmanager
def cuda_boundary(cc: int):
    """:func:`cuda_platform` and :func:`cuda_ops` together: a GPU of capability ``cc`` as far as
    every piece of Python up to the CUDA call can tell."""
    with cuda_platform(cc), cuda_ops():
        yield
