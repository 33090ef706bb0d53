"""Mixture of experts on a GPU: stacked experts in the grouped kernel, per-expert paths, graphs.

Run by ``scripts/gpu_check.sh`` on a CUDA machine (``TRITON_INTERPRET=0``); skipped elsewhere.
"""
from __future__ import annotations

import pytest
import torch

from tests.gpu.cases import BITS, DEV, kernel, make_weight, needs_cuda, pytestmark
from vllm_latq.kernels import ops
from vllm_latq.kernels.weight import dequantize


MOE_E, MOE_H, MOE_I, MOE_TOPK = 16, 512, 256, 4


def moe_experts(bits: int, rate: float, scale_bits: int | None = None, stacks: bool = True):
    """MOE_E Triton experts on DEV (crowded outlier rows: some experts' outliers are CSR, which
    the stack converts; ``scale_bits``: coded scales at group 64), stacked, and their fp32
    dequantized weights on the CPU."""
    from vllm_latq.kernels import moe
    tk = kernel("triton")
    experts, dense = [], []
    for e in range(MOE_E):
        w13, w2 = (make_weight(n, k, bits, rate, seed=100 * bits + 2 * e + i, group=128 if scale_bits is None else 64,
                               scale_bits=scale_bits)
                   for i, (n, k) in enumerate(((2 * MOE_I, MOE_H), (MOE_H, MOE_I))))
        experts.append(moe.Expert((tk, tk.prepare(w13)), (tk, tk.prepare(w2))))
        with torch.device(DEV):
            dense.append((dequantize(w13).cpu(), dequantize(w2).cpu()))
    stacked, why = moe.stack_experts(experts)
    assert (why is None) == stacks, why
    return experts, stacked, dense


def moe_routing(t: int, seed: int):
    """bf16 activations and top-k routing on DEV; expert 5 never routed, token 0 to the first and
    the last expert, one slot on another rank (−1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, MOE_H, generator=g).bfloat16()
    logits = torch.randn(t, MOE_E, generator=g)
    logits[:, 5] = -1e9
    w, ids = logits.softmax(-1).topk(MOE_TOPK, -1)
    ids[0, :2] = torch.tensor([0, MOE_E - 1])
    ids[-1, -1] = -1
    return x.to(DEV), (w / w.sum(-1, keepdim=True)).to(DEV), ids.int().to(DEV)


def assert_moe_close(y, x, w, ids, dense, what):
    from vllm_latq.testing.moe_models import moe_reference
    want = moe_reference(x.float().cpu(), w.cpu(), ids.cpu(), dense)
    err = (y.float().cpu() - want).abs().max().item()
    # bf16: the intermediate activations and the output are rounded once each
    assert err <= 2e-2 * want.abs().max().item(), f"{what}: max error {err:.4g} vs |ref| {want.abs().max():.4g}"


@pytest.mark.parametrize("m", [1, 7, 16, 64, 512], ids=lambda m: f"m{m}")
@pytest.mark.parametrize("bits", [b for b in BITS if b.values[0] != 5])   # 5 bits do not stack (test_moe_5bit_experts_run_per_expert)
def test_moe_grouped_vs_reference(bits, m):
    """The grouped kernel (stacked path) and the per-expert host path against the token-by-token
    fp32 definition, bf16 activations, 1 % outliers."""
    from vllm_latq.kernels import moe
    experts, stacked, dense = moe_experts(bits, 0.01)
    x, w, ids = moe_routing(m, m)
    for path in ("stacked", "host"):
        y = moe.experts_forward(x, w, ids, experts, "silu", stacked=stacked, path=path)
        assert y.dtype == torch.bfloat16 and y.device == x.device
        assert_moe_close(y, x, w, ids, dense, f"{path} M={m}")


@pytest.mark.parametrize("m", [1, 64], ids=lambda m: f"m{m}")
def test_moe_5bit_experts_run_per_expert(m):
    """5-bit experts are not stacked (the grouped kernel reads 2/3/4 bits): the per-expert
    host path serves them, right."""
    from vllm_latq.kernels import moe
    experts, stacked, dense = moe_experts(5, 0.01, stacks=False)
    assert stacked is None and "5-bit" in moe.stack_experts(experts)[1]
    x, w, ids = moe_routing(m, m)
    assert_moe_close(moe.experts_forward(x, w, ids, experts, "silu", path="host"), x, w, ids, dense, f"5-bit M={m}")


@pytest.mark.parametrize("m", [1, 16, 64], ids=lambda m: f"m{m}")
@pytest.mark.parametrize("bits", [pytest.param(b, id=f"{b}bit") for b in (2, 3, 4)])   # 3 bits: w2's K = 256 all tail
def test_moe_grouped_coded_scales(bits, m):
    """Experts with coded scales: the grouped kernel decodes the stacked codes."""
    from vllm_latq.kernels import moe
    experts, stacked, dense = moe_experts(bits, 0.01, scale_bits=4)
    assert stacked.w13.coded_scales
    x, w, ids = moe_routing(m, m)
    y = moe.experts_forward(x, w, ids, experts, "silu", stacked=stacked, path="stacked")
    assert_moe_close(y, x, w, ids, dense, f"coded stacked M={m}")


@needs_cuda
@pytest.mark.parametrize("warm", ["stacked", "host"])
@pytest.mark.parametrize("m", [1, 8, 64], ids=lambda m: f"m{m}")
def test_moe_cuda_graph_capture_and_replay(m, warm):
    """latq::moe_experts captured in a CUDA graph runs the stacked path (not every expert), and
    replays with new activations AND new routing: equal to eager stacked calls bit for bit,
    and right. ``warm``: the eager warm-up before the capture ran the stacked path, or only the
    host path (the eager choice at large batches) after the loader's compile of every row
    block — the grouped kernel then first runs inside the capture."""
    from vllm_latq.kernels import moe
    experts, stacked, dense = moe_experts(4, 0.01)
    moe.compile_stacked(stacked, torch.bfloat16)
    tensors, ints = moe.flatten(experts, stacked)
    op = ops.moe_op()
    x, w, ids = moe_routing(m, 0)
    paths = []

    def call():
        paths.append(moe.choose_path(x, MOE_TOPK, stacked))
        return op(x, w, ids, tensors, ints, "silu", False)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            moe.experts_forward(x, w, ids, experts, "silu", stacked=stacked, path=warm)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):          # vLLM captures on its warm-up stream
        y = call()
    assert paths[-1] == "stacked"
    for seed in (1, 2, 3):
        xs, ws, idss = moe_routing(m, seed)
        for dst, src in ((x, xs), (w, ws), (ids, idss)):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        eager = moe.experts_forward(x, w, ids, experts, "silu", stacked=stacked, path="stacked")
        assert torch.equal(y, eager), f"seed {seed}: replay differs from an eager stacked call"
        assert_moe_close(y, x, w, ids, dense, f"graph M={m} seed {seed}")
