"""CUDA graphs and ``torch.compile`` through latq's custom ops.

Run by ``scripts/gpu_check.sh`` on a CUDA machine (``TRITON_INTERPRET=0``); skipped elsewhere.
"""
from __future__ import annotations

import pytest
import torch

from tests.gpu.cases import DEV, activations, assert_matches_reference, bias_for, kernel, needs_cuda, pytestmark, triton_state, weight
from vllm_latq.kernels import ops
from vllm_latq.kernels.triton.dequant import use_large_m


def _graph_cases():
    return [pytest.param(1, None, 3, id="m1-op"), pytest.param(16, None, 3, id="m16-op"),
            pytest.param(64, None, 3, id="m64-op"), pytest.param(100, None, 3, id="m100-op"),
            pytest.param(1, dict(BN=32, SPLIT=4, num_warps=2), 3, id="m1-splitk4"),
            pytest.param(12, dict(BN=64, SPLIT=2, BR=8, num_warps=4), 3, id="m12-mma-splitk2"),
            pytest.param(1, dict(BN=64, SPLIT=4, num_warps=4, DEPTH=4), 4, id="m1-pipelined-splitk4"),
            pytest.param(4, dict(BN=32, SPLIT=2, BR=8, num_warps=4, DEPTH=4), 4, id="m4-mma-pipelined-splitk2")]


@needs_cuda
@pytest.mark.parametrize("m,cfg,bits", _graph_cases())
def test_cuda_graph_capture_and_replay(m, cfg, bits):
    """Capture one call (after the warm-up that compiles and autotunes), replay it on new
    inputs: equal to eager calls bit for bit, right, tickets back to 0 after every replay."""
    triton_k = kernel("triton")
    n, k = 1000, 4096
    w = weight(n, k, bits, 0.01, seed=7)
    st = triton_state(w)
    tensors, ints = triton_k.flatten(st)
    op = ops.op_for(triton_k)
    x = torch.zeros(m, k, dtype=torch.bfloat16, device=DEV)
    bias = bias_for(n, torch.bfloat16)

    def call():
        if cfg is None:
            return op(x, tensors, ints, bias, n)
        kind = "mma" if m >= 8 or "BR" in cfg else "gemv"
        return triton_k.apply(st, x, bias, kernel=kind, config=cfg)

    triton_k.reserve(st, torch.bfloat16)                         # as the loader does: scratches sized
    scratch = triton_k.splitk_workspace.flat(1, torch.float32, DEV).data_ptr()
    inputs = [activations(m, k, torch.bfloat16, seed=s) for s in range(3)]
    x.copy_(inputs[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):          # vLLM captures on its warm-up stream
        y = call()
    for inp in inputs:
        x.copy_(inp)
        graph.replay()
        torch.cuda.synchronize()
        assert int(st.tickets.abs().sum()) == 0
        assert torch.equal(y, call()), "graph replay differs from an eager call"
        # the op dequantises once above MMA_MAX_M rows: bf16 weights, the bf16 bound
        assert_matches_reference(y, x, w, bias, exact=cfg is not None or not use_large_m(x),
                                 what=f"graph M={m} {cfg}")
    assert triton_k.splitk_workspace.flat(1, torch.float32, DEV).data_ptr() == scratch


class _Layer(torch.nn.Module):
    """What the vLLM layer keeps: the flattened state as buffers, static ints, the op."""

    def __init__(self, kern, state, n, bias):
        super().__init__()
        tensors, self.ints = kern.flatten(state)
        self.nt, self.n, self.op = len(tensors), n, ops.op_for(kern)
        for i, t in enumerate(tensors):
            self.register_buffer(f"t{i}", t, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x):
        return self.op(x, [getattr(self, f"t{i}") for i in range(self.nt)], self.ints, self.bias, self.n)


@needs_cuda
def test_torch_compile_fullgraph():
    """Dynamo + Inductor through the op (no graph break, dynamic M, ops fused around it):
    the op's output equals the eager op's bit for bit, and the reference."""
    triton_k = kernel("triton")
    n, k = 1000, 4096
    w = weight(n, k, 4, 0.01, seed=8)
    bias = bias_for(n, torch.bfloat16)
    layer = _Layer(triton_k, triton_state(w), n, bias)

    def f(x):
        y = layer(x * 0.5)
        return y, torch.nn.functional.silu(y.float()) + 1.0

    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    for m in (1, 5, 16, 33):
        x = activations(m, k, torch.bfloat16, seed=m)
        y, z = compiled(x)
        y_eager, z_eager = f(x)
        assert torch.equal(y, y_eager), f"M={m}: compiled op output differs from eager"
        torch.testing.assert_close(z, z_eager, rtol=1e-5, atol=1e-5)
        assert_matches_reference(y, x * 0.5, w, bias, exact=not use_large_m(x), what=f"compiled M={m}")
