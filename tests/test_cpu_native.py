"""The CPU kernel's C++ op (``vllm_latq/native.py``, ``csrc/latq_cpu.cpp``): the op a vLLM
layer calls, its two outlier paths, and the fallback when it cannot be built. (Every exactness
test of ``test_cpu_kernel.py`` also runs through it.)"""
from __future__ import annotations

import pytest
import torch

from tests.test_cpu_kernel import check, prepared
from vllm_latq import native
from vllm_latq.kernels import cpu
from vllm_latq.kernels.cpu import CPUKernel

pytestmark = [pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta"),
              pytest.mark.skipif(not native.available(), reason=f"C++ op unavailable: {native.load()}")]


def test_native_op_is_the_layer_op_for_every_m(monkeypatch):
    """``latq_cpu::linear`` (what a vLLM layer calls with the C++ op built) against the Python
    custom op, over the flattened state: the same result at small M (C++) and at large M (it
    calls back into ``latq::cpu_linear``); also under torch.compile(fullgraph, dynamic)."""
    from vllm_latq.kernels import ops
    monkeypatch.setattr(cpu, "NATIVE", False)
    assert CPUKernel.native_op() is None
    monkeypatch.setattr(cpu, "NATIVE", True)
    w, state = prepared((640, 2048, 4, 0.01, 128))
    op = ops.op_for(CPUKernel)
    assert op is torch.ops.latq_cpu.linear.default
    tensors, ints = CPUKernel.flatten(state)
    g = torch.Generator().manual_seed(21)
    bias = torch.randn(640, generator=g).to(torch.bfloat16)
    for shape in ((1, 2048), (8, 2048), (2, 3, 2048), (cpu.LARGE_M, 2048)):
        x = torch.randn(*shape, generator=g).to(torch.bfloat16)
        for b in (None, bias):
            want = CPUKernel.apply(state, x, b)
            assert torch.equal(op(x, tensors, ints, b, 640), want), (shape, b is None)
    f = torch.compile(lambda x: op(x, tensors, ints, None, 640), fullgraph=True, dynamic=True)
    for m in (1, 5):
        x = torch.randn(m, 2048, generator=g).to(torch.bfloat16)
        assert torch.equal(f(x), CPUKernel.apply(state, x))


def test_native_unavailable_falls_back(monkeypatch):
    monkeypatch.setattr(native, "_STATUS", native._UNSET)
    monkeypatch.setenv(native.ENV, "0")
    assert native.load() == "LATQ_CPU_NATIVE=0" and not native.available()
    assert CPUKernel.native_op() is None
    w, state = prepared((640, 2048, 4, 0.01, 128))
    check(w, state, torch.randn(3, 2048).to(torch.bfloat16))


@pytest.mark.parametrize("loop_max", [0, 1 << 40])
def test_native_outliers_by_loop_and_by_mkl(loop_max):
    """The C++ op sums outliers with its own loop or MKL (M=1 by outlier count, M > 16 always
    MKL): both exact to the emulation, for M=1 and every row-block width of the loop (4, 8,
    16), and MKL at M=21."""
    w, state = prepared((640, 2048, 4, 0.05, 128))
    g = torch.Generator().manual_seed(22)
    torch.ops.latq_cpu.set_loop_max(loop_max)
    try:
        for M in (1, 3, 8, 16, 21):
            check(w, state, torch.randn(M, 2048, generator=g).to(torch.bfloat16))
            check(w, state, torch.randn(M, 2048, generator=g), torch.randn(640, generator=g))
    finally:
        torch.ops.latq_cpu.set_loop_max(native.LOOP_MAX)
