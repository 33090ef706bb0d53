"""vLLM's layer names → the checkpoint's (``vllm_latq/plugin/names.py``): every lookup of a vLLM
prefix in the checkpoint's quantization_config (bits, modules not converted, fused parts) names the
module the checkpoint wrote, however vLLM's model class spelled the prefix or renamed its tensors."""
from __future__ import annotations

import pytest

pytest.importorskip("vllm")
from vllm.model_executor.models.utils import WeightsMapper  # noqa: E402

from vllm_latq import format as fmt  # noqa: E402
from vllm_latq.plugin.config import LatqConfig  # noqa: E402
from vllm_latq.plugin.names import checkpoint_module, vllm_module  # noqa: E402


def _config(head: str = "lm_head", skip=()) -> LatqConfig:
    """``latq-quantize``'s default form: 4-bit layers, an 8-bit head ``head``; ``skip`` not converted."""
    return LatqConfig(fmt.quantization_config("rtn", bits=4, group_size=64, layer_bits={head: 8},
                                              modules_not_converted=skip, lm_head_quantized=True))


def test_an_empty_prefix_joined_with_a_dot_names_the_module():
    """StableLM, GPT-2 and PLaMo 3 build their head as ``f"{prefix}.lm_head"`` with the engine's empty
    prefix: ``.lm_head`` is the checkpoint's ``lm_head`` in every lookup (it was read as a 4-bit layer)."""
    assert checkpoint_module(".lm_head") == "lm_head"
    assert checkpoint_module(".model..layers.0.mlp.") == "model.layers.0.mlp"
    c = _config(skip=["model.layers.1"])
    assert c.bits_of(".lm_head") == 8 and c.is_converted(".lm_head")
    assert c.hf_names(".model.layers.0.self_attn.qkv_proj") == [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    assert c.bits_of(".model.layers.0.mlp.gate_up_proj") == 4
    assert not c.is_converted(".model.layers.1.mlp.down_proj")
    assert not _config(skip=["lm_head"]).is_converted(".lm_head")


def test_spec_names_are_mapped_as_vllm_maps_their_tensors():
    """A renaming that matches only a tensor's name (transformers' ``^embed_out\\.`` → ``lm_head.`` for
    GPT-NeoX, which vLLM's Transformers backend applies) renames the module's entries too."""
    mapper = WeightsMapper(orig_to_new_prefix={"embed_out.": "lm_head.", "gpt_neox.": "model."})
    assert mapper.map_name("embed_out") == "embed_out"          # the module name alone misses it
    assert vllm_module(mapper, "embed_out", "qweight") == "lm_head"
    c = _config("embed_out", skip=["gpt_neox.layers.1"])
    c.apply_vllm_mapper(mapper)
    assert c.bits_of("lm_head") == 8 and c.bits_of("model.layers.0.attention.query_key_value") == 4
    assert not c.is_converted("model.layers.1.mlp.dense_4h_to_h") and c.is_converted("model.layers.0.mlp.dense_4h_to_h")
    with pytest.raises(ValueError, match="renames the tensor x.qweight to y.weight, not a tensor qweight"):
        vllm_module(WeightsMapper(orig_to_new_prefix={"x.qweight": "y.weight"}), "x", "qweight")


# model type → (its head in the checkpoint, a layer the checkpoint keeps unquantized, vLLM's name of it)
MODELS = {
    "stablelm": ("lm_head", "model.layers.0.mlp.down_proj", "model.layers.0.mlp.down_proj"),   # ".lm_head"
    "gpt2": ("lm_head", "transformer.h.0.mlp.c_proj", "transformer.h.0.mlp.c_proj"),           # ".lm_head"
    # vLLM's Transformers backend: gpt_neox.* → model.*, embed_out → lm_head
    "gpt_neox": ("embed_out", "gpt_neox.layers.0.mlp.dense_4h_to_h", "model.layers.0.mlp.dense_4h_to_h"),
    "llama": ("lm_head", "model.layers.0.mlp.down_proj", "model.layers.0.mlp.down_proj"),
}
# built with the head unquantized (Bloom's fused matrices too, which its loader cannot take): does vLLM ask
# latq for the head's method? OPT with a quantized head: refused, naming why
HEAD_ASKED = {**{t: (head, []) for t, (head, _, _) in MODELS.items()}, "opt": ("lm_head", []), "gemma2": ("lm_head", []),
              "bloom": ("lm_head", ["transformer.h.0.self_attention.query_key_value"])}
UNASKED = {"opt": "OPTForCausalLM", "gemma2": "Gemma2ForCausalLM", "bloom": "BloomForCausalLM"}


def _spec(head: str | None, skip: list[str]) -> dict:
    bits = {head: 8} if head else None
    return fmt.quantization_config("rtn", bits=4, group_size=64, layer_bits=bits, modules_not_converted=skip,
                                   **({"lm_head_quantized": True} if head else {}))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Model type → what building vLLM's model of it with a latq config gave (``vllm_layer_names``):
    the checkpoints of ``MODELS`` with an 8-bit head, then ``HEAD_ASKED``'s with the head unquantized."""
    from vllm_latq.testing.vllm_layer_names import config_dir, run
    root = tmp_path_factory.mktemp("configs")
    dirs = {t: config_dir(root, t, n_embd=64, n_head=2, n_layer=1) for t in HEAD_ASKED}
    cases = [(dirs[t], _spec(head, [skip])) for t, (head, skip, _) in MODELS.items()]
    cases += [(dirs[t], _spec(None, skip)) for t, (_, skip) in HEAD_ASKED.items()]
    cases += [(dirs[t], _spec("lm_head", [])) for t in ("opt", "gemma2")] + [(config_dir(root, "cohere"), _spec("lm_head", []))]
    out = run(cases)
    return dict(zip(MODELS, out)), dict(zip(HEAD_ASKED, out[len(MODELS):])), out[-3:]


def test_vllm_models_load_the_checkpoints_head_and_layers(built):
    """vLLM's own model classes, built as its engine builds them: each latq
    layer's loader expects the module and bits the checkpoint wrote — the 8-bit head whatever vLLM
    calls it, 4-bit layers — and the layer the checkpoint keeps unquantized is not a latq layer."""
    for model_type, res in built[0].items():
        layers, vllm_skip = res["layers"], MODELS[model_type][2]
        heads = {p: m for p, m in layers.items() if p.rpartition(".")[2] == "lm_head"}
        assert list(heads.values()) == [["lm_head", 8]], (model_type, layers)
        assert len(layers) == 4 and all(bits == 4 for p, (_, bits) in layers.items() if p not in heads), layers
        assert all(m == checkpoint_module(p) for p, (m, _) in layers.items()), layers
        assert vllm_skip not in layers, (model_type, layers)


def test_a_head_vllm_builds_unquantized_is_refused_naming_why(built):
    """The vLLM classes that never ask latq for their head's method — OPT and Bloom build it without
    the quantization config, Gemma 2 builds none — are ``HEAD_WITHOUT_QUANT_CONFIG``; a quantized head
    is refused there before any tensor is read (vLLM's loader would stop at its first tensor)."""
    from vllm_latq.plugin.loader_rows import HEAD_WITHOUT_QUANT_CONFIG
    asked = {t: any(checkpoint_module(p) == "lm_head" for p in res["asked"]) for t, res in built[1].items()}
    assert asked == {t: t not in UNASKED for t in HEAD_ASKED}, built[1]
    assert set(HEAD_WITHOUT_QUANT_CONFIG) == set(UNASKED.values())
    for res, cls in zip(built[2], ("OPTForCausalLM", "Gemma2ForCausalLM")):
        assert res == {"error": f"latq: vLLM's {cls} builds no output head with a quantization config, so it cannot "
                                "load this checkpoint's quantized head (quantization_config.lm_head_quantized); "
                                "quantize with --no-quantize-lm-head to serve the model with vLLM"}


def test_a_head_vllm_drops_is_refused_naming_why(built):
    """vLLM's Cohere drops every ``lm_head`` tensor and computes its logits with the input embedding,
    whatever the config says: a quantized head is refused once its tensors are read, not silently
    replaced by the embedding (where vLLM built the head, the first layer says what it lacks)."""
    assert built[2][2]["processed"] == (
        "latq: vLLM's CohereForCausalLM built no output head for this checkpoint's quantized head (quantization_config."
        "lm_head_quantized): the head's tensors were dropped unread and the logits come from another weight; quantize "
        "with --no-quantize-lm-head to serve the model with vLLM")
    assert all(res["processed"].startswith("latq checkpoint is missing tensors for layer ") for res in built[0].values())
