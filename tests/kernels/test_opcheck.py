"""``torch.library.opcheck`` on every latq custom op: schema (no input mutated or aliased),
autograd registration, the fake implementation against the real one (shape, dtype, strides,
device) and AOT dispatch with dynamic shapes — what torch.compile and vLLM's compiled mode rely
on (``kernels/ops.py``).

Ops: ``latq::<kernel>_linear`` for every kernel in ``selector.kernels()`` (the Triton one in
its interpreter on CPU), the CPU kernel's native ``latq_cpu::linear`` / ``small_linear`` when
the C++ ops build. CPU cases run in the default suite; CUDA cases are marked ``gpu`` and run by
``scripts/gpu_check.sh``.
"""
from __future__ import annotations

import importlib
import os

import pytest
import torch

from vllm_latq.kernels import ops, selector
from vllm_latq.kernels.weight import CodebookWeight, LatqWeight
from vllm_latq.testing.weights import random_weight

N, K, GROUP, M = 32, 256, 128, 3          # CPU kernel: N % 16 == 0, its op groups divide K
NAMES = [k.name for k in selector.kernels() if not k.delegated]   # vLLM's own: test_cuda_boundary.py
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
GPU = pytest.mark.gpu
NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET,
                             reason="CUDA cases: need a GPU with TRITON_INTERPRET=0 (scripts/gpu_check.sh)")
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=[GPU, NO_CUDA])]


def kernel(name: str):
    return next(k for k in selector.kernels() if k.name == name)


def make_weight(device, bits=4, rate=0.03, seed=0) -> LatqWeight:
    return random_weight(N, K, bits, rate, group=GROUP, seed=seed, scale_lo=0.002, scale_span=0.02,
                         val_std=0.2, fp16_values=True).to(device)


def make_codebook_weight(device, bits=3, seed=0) -> CodebookWeight:
    """A codebook layer of the same shape (random codes: each a point of its codebook)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (N, K // 8, bits), generator=g, dtype=torch.uint8)
    return CodebookWeight(codes, (torch.rand(N, K // GROUP, generator=g) * 0.02 + 0.002).half(), bits, GROUP,
                          K).to(device)


def op_args(device, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(M, K, generator=g).to(dtype).to(device)
    bias = torch.randn(N, generator=g).to(dtype).to(device)
    return x, bias


def _skip_unrunnable(name, device, w, dtype, monkeypatch):
    if name == "triton" and device == "cpu":
        if not INTERPRET:
            pytest.skip("the Triton op runs on CPU only in Triton's interpreter")
        tk = importlib.import_module(kernel("triton").__module__)
        monkeypatch.setenv(tk.ENV_INTERPRET_OK, "1")
    monkeypatch.setenv(selector.ENV_FORCE, name)       # the opt-in kernel (dequant) too
    ok, why = kernel(name).can_implement(w, torch.device(device), dtype)
    if not ok:
        pytest.skip(f"{name} cannot run on {device}: {why}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", NAMES)
def test_python_op(name, device, monkeypatch):
    """``latq::<name>_linear``: the op every layer calls (or a native op calls back into), on a
    layer of the kernel's first runtime form."""
    w = make_weight(device) if kernel(name).forms[0] is LatqWeight else make_codebook_weight(device)
    x, bias = op_args(device)
    _skip_unrunnable(name, device, w, x.dtype, monkeypatch)
    K_ = kernel(name)
    tensors, ints = K_.flatten(K_.prepare(w))
    op = ops.python_op_for(K_)
    torch.library.opcheck(op, (x, tensors, ints, bias, N))
    torch.library.opcheck(op, (x[:1], tensors, ints, None, N))


def _native_cpu():
    from vllm_latq import native
    why = native.load()
    if why is not None:
        pytest.skip(f"C++ ops unavailable: {why}")
    return kernel("cpu")


def test_native_linear():
    """``latq_cpu::linear`` (C++), small M in C++ and large M calling back into Python."""
    cpu_kernel = _native_cpu()
    cpu = importlib.import_module(cpu_kernel.__module__)
    w = make_weight("cpu")
    tensors, ints = cpu_kernel.flatten(cpu_kernel.prepare(w))
    op = cpu_kernel.native_op()
    assert op is not None
    x, bias = op_args("cpu")
    torch.library.opcheck(op, (x, tensors, ints, bias, N))
    big = torch.randn(cpu.large_m() + 1, K).bfloat16()   # the Python op behind the C++ one
    torch.library.opcheck(op, (big, tensors, ints, None, N))


def test_native_plain_linear():
    """``latq_cpu::plain_linear`` (a state without outliers, no bias), small and large M."""
    cpu_kernel = _native_cpu()
    cpu = importlib.import_module(cpu_kernel.__module__)
    state = cpu_kernel.prepare(make_weight("cpu", rate=0.0))
    tensors, ints = cpu_kernel.flatten(state)
    op = cpu_kernel.plain_op(state)
    assert op is not None
    x, _ = op_args("cpu")
    torch.library.opcheck(op, (x, tensors[0], tensors[1], ints, N))
    big = torch.randn(cpu.large_m() + 1, K).bfloat16()
    torch.library.opcheck(op, (big, tensors[0], tensors[1], ints, N))


def test_native_small_linear():
    cpu_kernel = _native_cpu()
    st = cpu_kernel.prepare(make_weight("cpu"))
    x, bias = op_args("cpu")
    args = (x, st.packed, st.scales, st.crow, st.col, st.val, st.tile_off, st.tile_rows, st.tile_col,
            st.tile_val, st.row_scale, bias, st.group_size, st.planes)
    torch.library.opcheck(torch.ops.latq_cpu.small_linear.default, args)
