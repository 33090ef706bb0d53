"""Mixture-of-experts in ``latq-quantize``: tiny random Qwen3-MoE and Mixtral built
here from their configs, quantized per expert (SSQR, HPTQ), stored under the original per-expert
checkpoint names, validated, dequantized exactly; per-expert Hessians checked against an
independent computation from the model's own router; an expert no token reaches still
quantized, its fallback recorded."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_latq.testing.tiny_models import TINY_OPTS, make_tiny_model
from vllm_latq import hf_model
from vllm_latq.format.checkpoint import Checkpoint, load_dequantized_model
from vllm_latq.format.validate import validate_checkpoint
from vllm_latq.commands.inspect import inspect_main
from vllm_latq.quantize.pipeline import QuantizeOptions, quantize_model

NAMES = {  # model type: (its mixture's checkpoint prefix, its expert linears: gate, up, down)
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "qwen2_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "olmoe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
}


def _meta(arch, **extra):
    from transformers import AutoConfig
    from vllm_latq.testing.tiny_models import TINY_CONFIGS
    common = dict(vocab_size=256, hidden_size=80, intermediate_size=144, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)
    cfg = AutoConfig.for_model(arch, **{**common, **TINY_CONFIGS.get(arch, {}), **extra})
    return hf_model.empty_model(cfg)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen2_moe", "olmoe"])
def test_experts_found_and_named_as_the_original_checkpoint(arch):
    """Experts, routers and a shared expert are found structurally; each expert's linear is
    named as in the model's original per-expert layout (transformers' conversion mapping), its
    rows in the fused gate_up_proj / down_proj exactly covered."""
    m = _meta(arch)
    prefix, layers = hf_model.check_supported(m)
    E, two_i = m.get_parameter("model.layers.0.mlp.experts.gate_up_proj").shape[:2]
    gates = hf_model.moe_gates(layers[0])
    linears = set(hf_model.block_linears(layers[0], "model.layers.0"))
    assert gates == ({"mlp.gate", "mlp.shared_expert_gate"} if arch == "qwen2_moe" else {"mlp.gate"})
    assert not any(f"model.layers.0.{g}" in linears for g in gates)
    if arch == "qwen2_moe":
        assert {f"model.layers.0.mlp.shared_expert.{p}" for p in ("gate_proj", "up_proj", "down_proj")} <= linears
    names = hf_model.checkpoint_names(m)
    moe, (gate, up, down) = NAMES[arch]
    fused = "model.layers.1.mlp.experts."
    for e in range(E):
        got = {n: names.experts[f"model.layers.1.{moe}.experts.{e}.{n}"] for n in (gate, up, down)}
        assert got[gate] == hf_model.ExpertLinear(fused + "gate_up_proj", e, slice(0, two_i // 2))
        assert got[up] == hf_model.ExpertLinear(fused + "gate_up_proj", e, slice(two_i // 2, two_i))
        assert got[down] == hf_model.ExpertLinear(fused + "down_proj", e, slice(0, 80))
    assert len(names.experts) == 2 * 3 * E
    assert names.original["model.layers.0.mlp.gate.weight"] == f"model.layers.0.{moe}.gate.weight"


def test_unsupported_experts_refused_naming_the_module():
    """GPT-OSS's transposed experts with biases, and a ModuleList of expert MLPs (a remote-code
    layout), fail at the start with the module and why."""
    with pytest.raises(hf_model.UnsupportedModelError, match=r"model\.layers\.0\.mlp\.experts \(GptOssExperts.*"
                                                              r"'has_bias': True.*without biases"):
        hf_model.check_supported(_meta("gpt_oss", num_local_experts=4, head_dim=20))
    from transformers.models.llama.modeling_llama import LlamaMLP
    m = _meta("llama")
    m.model.layers[1].mlp.experts = torch.nn.ModuleList([LlamaMLP(m.config) for _ in range(2)])
    with pytest.raises(hf_model.UnsupportedModelError, match=r"model\.layers\.1\.mlp\.experts \(ModuleList of 2 "
                                                              r"LlamaMLP\): a list of expert modules"):
        hf_model.check_supported(m)


def _never_route_expert_0(src, layer=0):
    """Router rows 1..4 as ±v, ±u: two of their logits are > 0 for every token, expert 0's is 0,
    so top-2 never picks expert 0."""
    f = src / "model.safetensors"
    t = load_file(f)
    key = f"model.layers.{layer}.mlp.gate.weight"
    W = t[key].float()
    W[0], W[2], W[4] = 0, -W[1], -W[3]
    t[key] = W.to(t[key].dtype)
    save_file(t, f, metadata={"format": "pt"})


def _quantize(src, out, method, **opts):
    results, hessians = {}, {}

    def on_layer(name, W, H, res):
        results[name], hessians[name] = res, H
    d = quantize_model(src, out, QuantizeOptions(method=method, **{**TINY_OPTS, **opts}), progress=False,
                       on_layer=on_layer)
    return d, results, hessians


@pytest.fixture(scope="module")
def qwen3_ssqr(tmp_path_factory):
    """A one-block Qwen3-MoE (6 experts, top-2, expert 0 never routed) quantized with SSQR,
    fp32 forwards (for the Hessian comparison)."""
    root = tmp_path_factory.mktemp("moe")
    src = make_tiny_model(root / "qwen3_moe", "qwen3_moe", layers=1)
    _never_route_expert_0(src)
    return (src, *_quantize(src, root / "out", "ssqr", compute_dtype="float32", moe_min_tokens=48))


def _check_checkpoint(arch, src, d, results, layers):
    """Valid (latq-inspect too); one layer per expert and projection under the original names
    besides the dense ones; latq-eval's model holds exactly the solver's weights in its fused
    experts; the kept tensors (router included) are the source's, under their original names."""
    report = validate_checkpoint(d)
    assert inspect_main([str(d), "--no-served"]) == 0
    ck = Checkpoint(d)
    cfg = json.loads((d / "config.json").read_text())
    E = cfg.get("num_experts") or cfg["num_local_experts"]
    moe, projs = NAMES[arch]
    experts = {f"model.layers.{i}.{moe}.experts.{e}.{p}" for i in range(layers) for e in range(E) for p in projs}
    dense = {f"model.layers.{i}.self_attn.{p}_proj" for i in range(layers) for p in "qkvo"}
    if arch == "qwen2_moe":   # its shared expert is a plain MLP
        dense |= {f"model.layers.{i}.mlp.shared_expert.{p}" for i in range(layers) for p in projs}
    assert set(ck.layers()) == set(results) == experts | dense
    assert report["totals"]["layers"] == len(experts | dense)
    qc = cfg["quantization_config"]
    gates = {f"model.layers.{i}.{moe}.{g}" for i in range(layers)
             for g in (("gate", "shared_expert_gate") if arch == "qwen2_moe" else ("gate",))}
    assert gates <= set(qc["modules_not_converted"])
    model = load_dequantized_model(d)
    names = hf_model.checkpoint_names(model)
    for name, res in results.items():
        x = names.experts.get(name)
        got = model.get_parameter(x.param)[x.expert, x.rows] if x else model.get_parameter(f"{name}.weight")
        assert torch.equal(got, res.q), name
    source = load_file(src / "model.safetensors")
    for n in ck.plain_names():
        assert torch.equal(ck.tensor(n), source[n]), n
    assert f"model.layers.0.{moe}.gate.weight" in ck.plain_names()
    return json.loads((d / "latq_stats.json").read_text())["layers"]


def _check_routing(stats, layers, top_k, min_tokens, fallback="blend", certified=True):
    """Per expert: tokens routed, summing to tokens × top_k per block; the fallback exactly
    where fewer than min_tokens were routed; an error, and a certificate ≤ 1 (unclipped methods)."""
    tokens = TINY_OPTS["nsamples"] * TINY_OPTS["seqlen"]
    for i in range(layers):
        per_expert = {s["expert"]: s for s in stats if s["name"].startswith(f"model.layers.{i}.") and "expert" in s}
        assert sum(s["expert_tokens"] for s in per_expert.values()) == tokens * top_k
        for s in per_expert.values():
            assert s["moe_fallback"] == (fallback if s["expert_tokens"] < min_tokens else None), s
            assert s["rel_error"] is not None and (s["cert"] <= 1 if certified else s["cert"] is None)


def test_qwen3_moe_ssqr(qwen3_ssqr):
    src, d, results, _ = qwen3_ssqr
    stats = _check_checkpoint("qwen3_moe", src, d, results, layers=1)
    _check_routing(stats, 1, top_k=2, min_tokens=48)
    zero = [s for s in stats if s.get("expert") == 0]
    assert len(zero) == 3 and all(s["expert_tokens"] == 0 and s["moe_fallback"] == "blend" for s in zero)
    cfg = json.loads((d / "config.json").read_text())["quantization_config"]["calibration"]
    assert cfg["moe_min_tokens"] == 48 and cfg["moe_route_all"] is False


def test_expert_hessians_are_the_routed_tokens(qwen3_ssqr):
    """Each expert's gate/up Hessian is XᵀX/n over exactly the tokens the model's own router
    sends it, its down Hessian that of act(x W_gᵀ)·(x W_uᵀ) on them (computed here from the
    transformers model's forward); an expert routed nothing (0) or too little is blended with
    all tokens, H = (S_e + (t − n_e)/N·S_all)/t."""
    from transformers import AutoModelForCausalLM

    from vllm_latq import data
    src, d, _, hessians = qwen3_ssqr
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    moe = model.model.layers[0].mlp
    seen = []
    hook = moe.gate.register_forward_hook(lambda mod, args, out: seen.append((args[0], out[2])))
    from transformers import AutoTokenizer
    ids = data.calibration_batches(AutoTokenizer.from_pretrained(src), nsamples=TINY_OPTS["nsamples"],
                                   seqlen=TINY_OPTS["seqlen"], seed=0, source="wiki")
    with torch.no_grad():
        for row in ids:
            model(row[None])
    hook.remove()
    X = torch.cat([x for x, _ in seen]).double()
    routed = torch.cat([i for _, i in seen])
    W = moe.experts.gate_up_proj.detach().double()
    t, N = 48, len(X)
    for e in range(moe.experts.num_experts):
        mask = (routed == e).any(-1)
        g, u = (X @ W[e].T).chunk(2, dim=-1)
        A = torch.nn.functional.silu(g) * u
        S_in, S_mid = X[mask].T @ X[mask], A[mask].T @ A[mask]
        n = int(mask.sum())
        if n < t:
            want_in, want_mid = (S_in + X.T @ X * ((t - n) / N)) / t, (S_mid + A.T @ A * ((t - n) / N)) / t
        else:
            want_in, want_mid = S_in / n, S_mid / n
        if e == 0:
            assert n == 0
        got_in, got_mid = hessians[f"model.layers.0.mlp.experts.{e}.gate_proj"], \
            hessians[f"model.layers.0.mlp.experts.{e}.down_proj"]
        assert torch.equal(got_in, hessians[f"model.layers.0.mlp.experts.{e}.up_proj"])
        torch.testing.assert_close(got_in, want_in, rtol=1e-4, atol=1e-6 * want_in.abs().max().item())
        torch.testing.assert_close(got_mid, want_mid, rtol=1e-4, atol=1e-6 * want_mid.abs().max().item())


def test_mixtral_hptq(tmp_path):
    """Mixtral: experts stored as block_sparse_moe.experts.{e}.w1/w3/w2, the router as
    block_sparse_moe.gate.weight (the original names vLLM's loader maps), HPTQ layers."""
    src = make_tiny_model(tmp_path / "mixtral", "mixtral", layers=1)
    d, results, _ = _quantize(src, tmp_path / "out", "hptq", moe_min_tokens=140)
    stats = _check_checkpoint("mixtral", src, d, results, layers=1)
    _check_routing(stats, 1, top_k=2, min_tokens=140)


def test_route_all_and_fused_source(tmp_path):
    """``moe_route_all``: every expert's Hessians from every token (recorded "all-tokens").
    A source that stores the fused 3-D expert tensors instead of per-expert ones gives the same
    checkpoint tensors (read per expert from the fused tensor)."""
    src = make_tiny_model(tmp_path / "mixtral", "mixtral", layers=1)
    d, results, hessians = _quantize(src, tmp_path / "out", "gptq", moe_route_all=True)
    stats = _check_checkpoint("mixtral", src, d, results, layers=1)
    assert all(s["moe_fallback"] == "all-tokens" for s in stats if "expert" in s)
    w1 = [hessians[f"model.layers.0.block_sparse_moe.experts.{e}.w1"] for e in range(4)]
    assert all(torch.equal(h, w1[0]) for h in w1)
    _check_routing(stats, 1, top_k=2, min_tokens=10 ** 9, fallback="all-tokens", certified=False)

    fused = tmp_path / "fused"
    fused.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (fused / f.name).write_bytes(f.read_bytes())
    model = hf_model.empty_model(hf_model.hf_config(hf_model.config_dict(src)))
    names = hf_model.checkpoint_names(model)
    tensors = load_file(src / "model.safetensors")
    for p, t in model.state_dict().items():
        if t.dim() == 3:
            whole = torch.empty(t.shape, dtype=torch.bfloat16)
            for name, x in names.of_param(p).items():
                whole[x.expert, x.rows] = tensors.pop(f"{name}.weight")
            tensors[p] = whole
        elif p not in tensors and names.original[p] in tensors:   # the router under the model's name
            tensors[p] = tensors.pop(names.original[p])
    assert "model.layers.0.mlp.gate.weight" in tensors
    save_file(tensors, fused / "model.safetensors", metadata={"format": "pt"})
    a = quantize_model(src, tmp_path / "a", QuantizeOptions(method="rtn", group_size=64), progress=False)
    b = quantize_model(fused, tmp_path / "b", QuantizeOptions(method="rtn", group_size=64), progress=False)
    ca, cb = Checkpoint(a), Checkpoint(b)
    assert set(ca.where) == set(cb.where)
    assert all(torch.equal(ca.tensor(n), cb.tensor(n)) for n in ca.where)


@pytest.mark.slow
@pytest.mark.parametrize("arch,method", [("qwen3_moe", "hptq"), ("mixtral", "ssqr"), ("qwen2_moe", "ssqr"),
                                         ("olmoe", "hptq")])
def test_two_blocks(arch, method, tmp_path):
    """Two blocks, the second calibrated on the quantized first's outputs (Qwen2-MoE: a shared
    expert quantized like a dense MLP, its gate kept)."""
    src = make_tiny_model(tmp_path / arch, arch, layers=2)
    d, results, _ = _quantize(src, tmp_path / "out", method)
    stats = _check_checkpoint(arch, src, d, results, layers=2)
    _check_routing(stats, 2, top_k=2, min_tokens=QuantizeOptions().moe_min_tokens)


def test_no_cpu_only_tensor_on_the_way(tmp_path):
    """The MoE steps under the device guard (``device="cpu"``, the proxy for ``--device
    cuda``): every tensor factory names its device, but the integer probes through which
    transformers' conversion mapping names the experts (host data, on purpose)."""
    from tests.device_guard import factories_follow_inputs
    from tests.kernels.test_device_clean import HUFFMAN_NUMPY, THIRD_PARTY, TOKEN_IDS
    src = make_tiny_model(tmp_path / "mixtral", "mixtral", layers=1)
    opts = QuantizeOptions(method="ssqr", device="cpu", moe_min_tokens=140, **TINY_OPTS)
    with factories_follow_inputs(allow=THIRD_PARTY + TOKEN_IDS + HUFFMAN_NUMPY + ("hf_model.py:checkpoint_names",)):
        quantize_model(src, tmp_path / "out", opts, progress=False)
