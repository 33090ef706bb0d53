"""vLLM's start-up on a GPU (run by scripts/gpu_check.sh): eager warm-up at each capture
size, then a real CUDA-graph capture on the same stream, for dense layers and routed experts
at 2/3/4/5 bits — no new kernel variant, autotune, host sync or scratch allocation inside a
capture, and every graph replays to its eager output."""
from __future__ import annotations

import os

import pytest
import torch

from vllm_latq.kernels import moe
from vllm_latq.kernels.triton.kernel import TritonKernel
from vllm_latq.testing.capture import CaptureWatch, warmup_then_capture
from vllm_latq.testing.weights import random_weight

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET,
                                 reason="a CUDA device with TRITON_INTERPRET=0 (scripts/gpu_check.sh)")]
SIZES = (1, 2, 8, 16, 24, 64, 256)
BITS = [pytest.param(b, id=f"{b}bit") for b in (2, 3, 4, 5)]


def captured(watch, sizes, forward):
    """Warm up and capture ``forward(size, phase)`` per size on one side stream; replay each graph and
    compare with an eager call."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graphs, outs = {}, {}

    def run(size, phase):
        out = forward(size, phase)
        if phase == "capture":
            outs[size] = out

    def graph():
        g = graphs.setdefault(len(graphs), torch.cuda.CUDAGraph())
        return torch.cuda.graph(g, stream=side)

    with torch.cuda.stream(side), watch.installed(interpreted=False):
        warmup_then_capture(watch, sizes, run, graph)
    torch.cuda.current_stream().wait_stream(side)
    for g in graphs.values():
        g.replay()
    torch.cuda.synchronize()
    return outs


@pytest.mark.parametrize("bits", BITS)
def test_dense_capture(bits):
    layers = []
    for n, k in ((6144, 4096), (4096, 12288)):
        st = TritonKernel.prepare(random_weight(n, k, bits, 0.01, seed=bits).to("cuda"))
        TritonKernel.reserve(st, torch.bfloat16)
        layers.append(st)
    x = torch.randn(1, 4096, device="cuda").to(torch.bfloat16).expand(max(SIZES), 4096).contiguous()
    xd = torch.randn(1, 12288, device="cuda").to(torch.bfloat16).expand(max(SIZES), 12288).contiguous()
    watch = CaptureWatch()
    outs = captured(watch, SIZES, lambda s, phase: (TritonKernel.apply(layers[0], x[:s]), TritonKernel.apply(layers[1], xd[:s])))
    assert watch.violations == []
    for s, (a, b) in outs.items():
        torch.testing.assert_close(a, TritonKernel.apply(layers[0], x[:s]), rtol=0, atol=0)
        torch.testing.assert_close(b, TritonKernel.apply(layers[1], xd[:s]), rtol=0, atol=0)


@pytest.mark.parametrize("bits", BITS)
def test_moe_capture(bits):
    E, H, inter, topk = 8, 1024, 512, 2
    experts = []
    for e in range(E):
        pair = []
        for n, k, s in ((2 * inter, H, 2 * e), (H, inter, 2 * e + 1)):
            st = TritonKernel.prepare(random_weight(n, k, bits, 0.01, group=64, seed=s).to("cuda"))
            TritonKernel.reserve(st, torch.bfloat16)
            pair.append((TritonKernel, st))
        experts.append(moe.Expert(*pair))
    stacks, _ = moe.stack_experts(experts)
    if stacks is not None:
        moe.compile_stacked(stacks, torch.bfloat16)
    x = torch.randn(1, H, device="cuda").to(torch.bfloat16).expand(64, H).contiguous()
    sizes = (1, 4, 16, 64)
    g = torch.Generator(device="cuda").manual_seed(0)
    routing = {}                                   # fresh random routing per call, drawn outside the capture
    for s in sizes:
        for phase in ("warmup", "capture"):
            w, ids = torch.randn(s, E, device="cuda", generator=g).softmax(-1).topk(topk, -1)
            routing[s, phase] = (w.to(torch.bfloat16), ids.int())

    def forward(s, phase):
        return moe.experts_forward(x[:s], *routing[s, phase], experts, "silu", stacked=stacks)

    watch = CaptureWatch()
    captured(watch, sizes, forward)
    assert watch.violations == []
