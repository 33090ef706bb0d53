"""Values are bounded where they are read, with or without --no-verify, and whether or not the edit
was sealed again: floating-point tensors of any rank finite and within fp16's range, config
numbers in their meaningful range (nested ones too), attention heads that divide into their
key/value groups, ``architectures`` naming the class that is built, and a config whose model
would compute huge tables on build refused before it is built."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from vllm_latq import hf_model
from vllm_latq.commands import inspect, quantize as cli
from vllm_latq.errors import FormatError
from vllm_latq.format.checkpoint import Checkpoint
from vllm_latq.format.manifest import write_manifest
from vllm_latq.format.safetensors_file import SafetensorsFile, write_safetensors
from vllm_latq.testing.tiny_models import make_tiny_model

EMBED = "model.embed_tokens.weight"


def _resealed(d, name, fn):
    """Tensor ``name`` replaced by ``fn(tensor)``, its checksum recomputed and the checkpoint sealed
    again: what a deliberate edit looks like to every unkeyed check."""
    shard = Checkpoint(d).where[name]
    f = SafetensorsFile(d / shard)
    t = {n: f.get(n) for n in f.names()}
    t[name] = fn(t[name].clone())
    write_safetensors(d / shard, t)
    write_manifest(d)
    return shard


def _edit_config(d, fn, reseal=True):
    cfg = json.loads((d / "config.json").read_text())
    fn(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    if reseal:
        write_manifest(d)


def _refused_both_ways(d, capsys, *fragments):
    for extra in ([], ["--no-verify"]):
        assert inspect.inspect_main([str(d), "--no-served", *extra]) == 2
        err = capsys.readouterr().err
        assert all(f in err for f in fragments), err


@pytest.mark.parametrize("edit, what", [
    (lambda t: t.index_fill(0, torch.tensor([7]), float("nan")), "has NaN/Inf values"),
    (lambda t: t.index_fill(1, torch.tensor([3]), float("-inf")), "has NaN/Inf values"),
    (lambda t: t.index_fill(0, torch.tensor([1]), 3e38), "has values up to 3.00406e+38, beyond ±65504"),
])
def test_a_2d_embedding_out_of_bounds_is_refused_even_resealed(ck, capsys, edit, what):
    shard = _resealed(ck, EMBED, edit)
    _refused_both_ways(ck, capsys, f"file {shard}, tensor {EMBED}: {what}")


@pytest.mark.parametrize("edit, what", [
    (lambda c: c.update(rms_norm_eps=0.0), "rms_norm_eps is 0.0, expected a number in (0, 1]"),
    (lambda c: c.setdefault("rope_parameters", {}).update(rope_theta=-1.0),
     "rope_parameters.rope_theta is -1.0, expected a number in (0, 1e+12]"),
    (lambda c: c.update(rope_scaling={"rope_type": "linear", "factor": 0}),
     "rope_scaling.factor is 0, expected a number in (0, 1e+06]"),
    (lambda c: c.update(num_key_value_heads=3), "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    (lambda c: c.update(architectures=["MistralForCausalLM"]),
     "architectures is ['MistralForCausalLM'], but model_type 'llama' builds LlamaForCausalLM"),
])
def test_config_values_are_bounded_even_resealed(ck, capsys, edit, what):
    _edit_config(ck, edit)
    _refused_both_ways(ck, capsys, f"config.json: {what}")


def test_build_tables_are_budgeted_before_the_model_is_built():
    """GPT-J keeps a position table per layer, StarCoder a positions² mask: their sizes come from
    the config, measured on a build that allocates nothing."""
    from transformers import AutoConfig
    small = AutoConfig.for_model("gptj", n_embd=80, n_head=4, n_layer=2, rotary_dim=10, vocab_size=100)
    hf_model.check_build_budget(small)
    for cfg in (AutoConfig.for_model("gptj", n_embd=80, n_head=4, n_layer=8, rotary_dim=64, n_positions=1 << 21,
                                     vocab_size=100),
                AutoConfig.for_model("gpt_bigcode", n_embd=80, n_head=4, n_layer=2, n_positions=1 << 16,
                                     vocab_size=100)):
        with pytest.raises(FormatError, match=r"config.json: building this model computes \d+ MiB of tables"):
            hf_model.empty_model(cfg)


def test_a_source_whose_build_exceeds_the_budget_is_refused_before_any_work(tmp_path, capsys):
    src = make_tiny_model(tmp_path / "gptj", "gptj")
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(n_positions=1 << 22, n_layer=2)
    (src / "config.json").write_text(json.dumps(cfg))
    assert cli.main([str(src), str(tmp_path / "out"), "--method", "rtn", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{src / 'config.json'}: building this model computes" in err, err
    assert not list(tmp_path.glob("out*"))


def test_a_source_with_another_architecture_is_refused_before_any_work(tiny_llama, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(tiny_llama, src)
    _edit_config(src, lambda c: c.update(architectures=["Qwen2ForCausalLM"]), reseal=False)
    assert cli.main([str(src), str(tmp_path / "out"), "--method", "rtn", "--no-progress"]) == 2
    assert "architectures is ['Qwen2ForCausalLM'], but model_type 'llama'" in capsys.readouterr().err
