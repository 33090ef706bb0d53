"""A rotated checkpoint served by vLLM through the latq plugin: the runtime form carries the
rotation (the plugin's one line, ``kernels.rotated.with_rotation``) and every kernel rotates the
activations, so vLLM's greedy tokens are those of HF transformers on ``latq-eval``'s weights
``Q·Rᵀ``; a tensor-parallel cut off the rotation's blocks is refused naming the layer."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests import vllm_helpers as h
from vllm_latq.format.rotation import Rotation
from vllm_latq.kernels.rotated import with_rotation
from vllm_latq.testing.weights import random_weight


def test_a_rank_rotates_its_own_columns_only_on_block_boundaries():
    w = random_weight(16, 80, 4, 0.0, group=16)
    rot = Rotation(0)   # 160 columns: 32-column blocks
    with pytest.raises(ValueError, match=r"layer mlp.down_proj: this rank's input columns \[80, 160\) cut the "
                                         r"rotation's 32-column blocks"):
        with_rotation(w, rot, 160, 80, "mlp.down_proj")   # TP 2: 80 columns a rank
    w128 = replace(w, in_features=128)
    got = with_rotation(w128, rot, 384, 128, "x")          # 384 = 3·128 at TP 3: a block a rank
    assert torch.equal(got.rotation, rot.signs(384)) and got.rotation.numel() == 128
    assert with_rotation(w, None, 160, 80, "x") is w


@pytest.fixture(scope="module")
def rotated_tiny(tmp_path_factory):
    """make_tiny_llama (head_dim 32, as vLLM's CPU attention wants) quantized by the pipeline at
    3 bits with --rotate hadamard and the 8-bit head asked for (its tied head would stay tied by
    default: the vocabulary outweighs the blocks): GPTQ and SSQR."""
    from vllm_latq.quantize.pipeline import QuantizeOptions, quantize_model
    d = tmp_path_factory.mktemp("rot")
    src = h.make_tiny_llama(d / "model")
    out = {"dir": d}
    for method, kw in (("gptq", {}), ("ssqr", {"outlier_rate": 0.02})):
        out[method] = quantize_model(src, d / method, QuantizeOptions(method=method, bits=3, group_size=32, nsamples=4,
                                                                       seqlen=64, rotate="hadamard", lm_head_bits=8,
                                                                       **kw),
                                     progress=False)
    return out


def test_vllm_serves_a_rotated_checkpoint(rotated_tiny):
    """The reference kernel (exact): greedy 32 tokens == HF on the dequantized weights Q·Rᵀ;
    the CPU kernel (bf16, its C++ op rotating before its GEMV) greedy up to near-ties."""
    from vllm_latq.format.checkpoint import load_dequantized_model
    ids = h.tokenize(rotated_tiny["gptq"])
    jobs, want = [], {}
    for m in ("gptq", "ssqr"):
        want[m] = h.hf_greedy(load_dequantized_model(rotated_tiny[m]), ids, 32)
        jobs += [{"model": rotated_tiny[m], "prompt_ids": ids, "max_tokens": 32, "env": {"LATQ_KERNEL": k}}
                 for k in ("reference", "")]
    res = h.run_vllm_jobs(jobs, tmp=rotated_tiny["dir"])
    for r in res:
        assert "error" not in r, r.get("traceback")
    log = res[0]["log"]
    assert "kernels {'reference+hadamard': 9}" in log   # 8 linears and the 8-bit head, [x for x in log.splitlines() if "linears loaded" in x]
    assert "cpu+hadamard" in log
    for i, m in enumerate(("gptq", "ssqr")):
        assert res[2 * i]["tokens"] == want[m], m
        if res[2 * i + 1]["tokens"] != want[m]:
            hf = load_dequantized_model(rotated_tiny[m])
            assert max(h.greedy_margins(hf, ids, res[2 * i + 1]["tokens"])) < 0.1, m


def _compiled(f, x):
    """``f(x)`` compiled as vLLM compiles a model (Dynamo, full graph): its result and the ops its graph calls."""
    import torch._dynamo
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch._dynamo.config.patch(disable=False):        # the fast test config sets TORCH_COMPILE_DISABLE=1
        y = torch.compile(f, backend=keep, fullgraph=True)(x)
    return y, {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("form", ["gptq", "e8"])
def test_eager_cpu_layer_calls_its_cpp_op_not_the_kernels_python(monkeypatch, form):
    """vLLM's eager mode: a layer whose kernel has a C++ op calls it on the tensors flattened at load
    (the kernel's Python around it cost as much as a small layer's op), with and without a bias, the
    same numbers as ``kernel.apply``; without the op (``latq_native`` None) the kernel's apply."""
    from vllm_latq import native
    from vllm_latq.kernels import selector
    from vllm_latq.plugin.linear_method import LatqLinearMethod, install_kernel
    from vllm_latq.testing.weights import random_codebook_weight
    if not native.available():
        pytest.skip(f"C++ ops unavailable: {native.load()}")
    w = random_weight(64, 256, 4, 0.0, group=64) if form == "gptq" else random_codebook_weight(64, 256, 3, group=16)
    w = replace(w, rotation=Rotation(3).signs(256))
    kernel = selector.select(w, torch.device("cpu"), torch.bfloat16)
    layer, state = torch.nn.Module(), kernel.prepare(w)
    install_kernel(layer, kernel, state, w.out_features)
    method = LatqLinearMethod(None, None)
    x, bias = torch.randn(3, 256).bfloat16(), torch.randn(64).bfloat16()
    want = [kernel.apply(state, x), kernel.apply(state, x, bias)]
    assert layer.latq_native is not None
    with monkeypatch.context() as m:
        m.setattr(kernel, "apply", classmethod(lambda *a: pytest.fail("eager went through the kernel's Python")))
        assert torch.equal(method.apply(layer, x), want[0]) and torch.equal(method.apply(layer, x, bias), want[1])
    layer.latq_native = None
    with monkeypatch.context() as m:
        m.setattr(kernel, "apply", classmethod(lambda cls, st, t, b=None: t.new_full((t.shape[0], 64), 7.0)))
        assert (method.apply(layer, x) == 7).all()


def test_compiled_rotated_cpu_layer_calls_the_lean_op():
    """A rotated CPU layer without outliers in vLLM's compiled mode (``LatqLinearMethod.apply``
    under Dynamo): without bias its graph calls the lean ``latq_cpu::rotated_plain_linear``, with
    a bias the list op; both equal the eager forward bit for bit."""
    from vllm_latq import native
    from vllm_latq.kernels import selector
    from vllm_latq.plugin.linear_method import LatqLinearMethod, install_kernel
    if not native.available():
        pytest.skip(f"C++ ops unavailable: {native.load()}")
    w = replace(random_weight(64, 256, 4, 0.0, group=64), rotation=Rotation(3).signs(256))
    kernel = selector.select(w, torch.device("cpu"), torch.bfloat16)
    assert kernel.name == "cpu+hadamard"
    layer = torch.nn.Module()
    install_kernel(layer, kernel, kernel.prepare(w), w.out_features)
    method = LatqLinearMethod(None, None)
    x, bias = torch.randn(3, 256).bfloat16(), torch.randn(64).bfloat16()
    y, called = _compiled(lambda t: method.apply(layer, t), x)
    assert called == {"latq_cpu.rotated_plain_linear.default"}, called
    assert torch.equal(y, method.apply(layer, x))
    y, called = _compiled(lambda t: method.apply(layer, t, bias), x)
    assert called == {"latq_cpu.linear.default"}, called
    assert torch.equal(y, method.apply(layer, x, bias))
