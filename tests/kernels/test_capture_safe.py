"""Capture-safe by construction: vLLM's start-up order (eager warm-up at each capture size,
then the capture) with the capture patched on, for dense layers and every MoE path at 2/3/4/5
bits, identical dummy tokens and fresh random routing per call — no new kernel variant, no
autotuning, no host sync and no latq scratch allocation inside a capture."""
from unittest import mock

import pytest
import torch

triton = pytest.importorskip("triton")
from vllm_latq.kernels import graphs, moe  # noqa: E402
from vllm_latq.kernels.triton.kernel import ENV_INTERPRET_OK, INTERPRET, TritonKernel  # noqa: E402
from vllm_latq.testing.capture import CaptureWatch, warmup_then_capture  # noqa: E402
from vllm_latq.testing.weights import random_weight  # noqa: E402

pytestmark = pytest.mark.skipif(not INTERPRET, reason="runs the kernels in Triton's interpreter")
DENSE_SIZES = (1, 2, 4, 8, 16, 24, 40)
MOE_SIZES = (1, 4, 16, 40)
E, H, INTER, TOPK = 4, 64, 32, 2


@pytest.fixture(autouse=True)
def _interpreter_ok(monkeypatch):
    monkeypatch.setenv(ENV_INTERPRET_OK, "1")


def dummy_tokens(t, k, seed=0):
    """vLLM's dummy batch: one token repeated."""
    row = torch.randn(1, k, generator=torch.Generator().manual_seed(seed))
    return row.expand(t, k).contiguous().to(torch.bfloat16)


def test_dense_layers():
    """2/3/4/5-bit layers with and without outliers, coded scales, bias: every capture size
    runs in capture only what its warm-up ran (the large-M path included)."""
    layers = []
    for bits, rate, scale_bits in ((2, 0.0, 4), (3, 0.02, None), (4, 0.0, None), (5, 0.02, None)):
        w = random_weight(48, 256, bits, rate, group=64, seed=bits, fp16_values=True, scale_bits=scale_bits)
        st = TritonKernel.prepare(w)
        TritonKernel.reserve(st, torch.bfloat16)
        layers.append(st)
    bias = torch.randn(48).to(torch.bfloat16)
    watch = CaptureWatch()

    def run(size, phase):
        x = dummy_tokens(size, 256)
        for st in layers:
            TritonKernel.apply(st, x, bias)

    with watch.installed(interpreted=True):
        warmup_then_capture(watch, DENSE_SIZES, run)
    assert watch.violations == []
    assert len(watch.keys) >= len(layers) * 2


def test_dense_layers_on_the_pipelined_kernels(monkeypatch):
    """The same with every launch config pipelined where the width has a pipelined kernel and
    M < 8 routed to tensor cores at 3 and 4 rows (what a measured table may serve)."""
    from vllm_latq.kernels.triton import configs as cfg
    choose = cfg.choose

    def pipelined(kernel, bits, bm, *args):
        c = choose(kernel, bits, bm, *args)
        depth = cfg.PIPE_DEPTH.get((kernel, bits, bm))
        return dict(c, DEPTH=depth) if depth else c
    monkeypatch.setattr(cfg, "choose", pipelined)
    monkeypatch.setattr(cfg, "route", lambda bits, m, *a: "mma" if m in (3, 4) else "gemv")
    layers = []
    for bits, rate in ((2, 0.02), (4, 0.0), (4, 0.02)):
        w = random_weight(48, 256, bits, rate, group=64, seed=bits, fp16_values=True)
        layers.append(TritonKernel.prepare(w))
        TritonKernel.reserve(layers[-1], torch.bfloat16)
    watch = CaptureWatch()

    def run(size, phase):
        x = dummy_tokens(size, 256)
        for st in layers:
            TritonKernel.apply(st, x)

    with watch.installed(interpreted=True):
        warmup_then_capture(watch, DENSE_SIZES + (3,), run)
    assert watch.violations == []
    assert any("pipelined" in str(k) for k in watch.keys)


def experts_of(bits, rate=0.03, seed=0):
    experts = []
    for e in range(E):
        w13 = random_weight(2 * INTER, H, bits, rate, group=32, seed=seed + 2 * e, fp16_values=True)
        w2 = random_weight(H, INTER, bits, 0.0 if e == 1 else rate, group=32, seed=seed + 2 * e + 1)
        experts.append(moe.Expert((TritonKernel, TritonKernel.prepare(w13)), (TritonKernel, TritonKernel.prepare(w2))))
        for _, st in (experts[-1].w13, experts[-1].w2):
            TritonKernel.reserve(st, torch.bfloat16)
    return experts


def random_routing(t, seed):
    g = torch.Generator().manual_seed(seed)
    w, ids = torch.randn(t, E, generator=g).softmax(-1).topk(TOPK, -1)
    return w.to(torch.bfloat16), ids.int()


@pytest.mark.parametrize("stacked", [True, False], ids=["stackable", "unstacked"])
@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_moe_paths(bits, stacked):
    """Routed experts (stacked where the grouped kernel reads the width, else per expert): the
    capture takes the path its warm-up took and meets nothing new; routing differs per call."""
    experts = experts_of(bits)
    stacks = None
    if stacked:
        stacks, why = moe.stack_experts(experts)
        if stacks is not None:
            moe.compile_stacked(stacks, torch.bfloat16)
        else:
            assert bits == 5, why
    paths = {}
    choose = moe.choose_path
    watch = CaptureWatch()

    def recorded(x, topk, st):
        p = choose(x, topk, st)
        paths.setdefault(x.shape[0], []).append(p)
        return p

    def run(size, phase):
        w, ids = random_routing(size, seed=size * 2 + (phase == "capture"))
        moe.experts_forward(dummy_tokens(size, H), w, ids, experts, "silu", stacked=stacks)

    with mock.patch.object(moe, "choose_path", recorded), watch.installed(interpreted=True):
        warmup_then_capture(watch, MOE_SIZES, run)
    assert watch.violations == []
    assert all(len(set(p)) == 1 for p in paths.values()), paths
    assert {p for ps in paths.values() for p in ps} <= {"stacked", "masked"}


def test_eager_batches_above_capture_sizes_take_the_host_path(monkeypatch):
    """Batches no graph captures keep the host path (no E/k masked work) — and the watcher
    sees its host read, which is why it must never run in a capture."""
    experts = experts_of(4)
    monkeypatch.setattr(graphs, "GRAPH_TOKENS", 8)
    watch = CaptureWatch()
    with watch.installed(interpreted=True):
        x = dummy_tokens(16, H)
        w, ids = random_routing(16, 0)
        assert moe.choose_path(x, TOPK, None) == "host"
        with watch.capture():
            moe.experts_forward(x, w, ids, experts, "silu", path="host")
    assert any("tolist" in v for v in watch.violations)
