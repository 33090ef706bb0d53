"""What a run's options ask of the model and of this machine is refused before any work, one line,
exit 2, naming the option (or the source's config.json, or its tokenizer): options at their
integer extremes, a beam the memory cannot hold, activations the disk cannot hold, a sequence
past the model's positions, a config.json its weights contradict, token ids past the embedding."""
from __future__ import annotations

import json
import shutil

import pytest

from vllm_latq import cpu_features
from vllm_latq.commands import quantize as cli
from vllm_latq.testing.tiny_models import make_tiny_model

ARGS = ["--nsamples", "4", "--seqlen", "64", "--no-progress", "-q"]


def _refused(capfd, src, out, *args) -> str:
    """``latq-quantize SRC OUT ARGS``: exit 2 with one line, nothing written; → that line."""
    capfd.readouterr()
    assert cli.main([str(src), str(out), *ARGS, *map(str, args)]) == 2
    out_, err = capfd.readouterr()
    assert err.count("\n") == 1 and err.startswith("latq-quantize: error: "), err
    assert not out.exists() and not out.with_name(out.name + ".tmp-latq").exists()
    return err


@pytest.mark.parametrize("args,message", [
    (["--group-size", 2 ** 31], "group_size must be an integer in 1..1048576"),
    (["--group-size", 2 ** 63 - 1], "group_size must be an integer in 1..1048576"),
    (["--group-size", 2 ** 64], "group_size must be an integer in 1..1048576"),
    (["--decoder", "kbest", "--beam", 100_000], "beam must be an integer in 1..4096, got 100000"),
    (["--bits", 2 ** 64], "bits must be an integer in 2..8"),
    (["--nsamples", -1], "nsamples must be a positive integer, got -1"),
    (["--rotate", "hadamard", "--rotate-seed", 2 ** 64], "rotate_seed must be an integer in [0, 2^63)"),
    (["--seed", 2 ** 64], f"seed must be an integer in [-2^63, 2^63), got {2 ** 64}"),
    (["--moe-min-tokens", 0], "moe_min_tokens must be an integer in [1, 2^63), got 0"),
])
def test_options_at_their_extremes_are_refused_by_name(tiny_llama, tmp_path, capfd, args, message):
    assert message in _refused(capfd, tiny_llama, tmp_path / "out", *args)


def test_a_beam_the_memory_cannot_hold_is_refused_before_any_work(tiny_llama, tmp_path, capfd, monkeypatch):
    """The largest solved matrix's decoder buffers against the memory available (1 GiB here)."""
    monkeypatch.setattr(cpu_features, "available_memory", lambda: 1 << 30)
    err = _refused(capfd, tiny_llama, tmp_path / "out", "--decoder", "kbest", "--beam", 64,
                   "--quantize-lm-head")   # asked for: the tied head of this vocabulary stays tied by default
    assert "beam 64: the kbest decoder holds 6.56 GiB for lm_head [49152, 80], more than the 1.00 GiB of cpu memory " \
           "available (beam 9 at most)" in err, err


def test_activations_the_disk_cannot_hold_are_refused_before_any_work(tiny_llama, tmp_path, capfd):
    err = _refused(capfd, tiny_llama, tmp_path / "out", "--nsamples", 2 ** 40)
    assert f"nsamples {2 ** 40} x seqlen 64: the calibration activations saved in out.tmp-latq for --resume need" in err
    assert f"free in {tmp_path}" in err


def test_a_sequence_past_the_model_positions_is_refused(tiny_llama, tmp_path, capfd):
    positions = json.loads((tiny_llama / "config.json").read_text())["max_position_embeddings"]
    err = _refused(capfd, tiny_llama, tmp_path / "out", "--seqlen", positions + 1)
    assert f"seqlen {positions + 1} is longer than the model's {positions} positions" in err
    assert str(tiny_llama / "config.json") in err


@pytest.mark.parametrize("method", ["gptq", "rtn"])
def test_a_config_its_weights_contradict_is_blamed_on_the_config(tiny_llama, tmp_path, capfd, method):
    """Not on the run's own output shard (RTN used to write it and fail its validation)."""
    src = tmp_path / "src"
    shutil.copytree(tiny_llama, src)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 160}))
    err = _refused(capfd, src, tmp_path / "out", "--method", method)
    assert (f"file {src / 'config.json'}: describes model.layers.0.mlp.gate_proj.weight as (160, 80), but "
            "model.safetensors holds (144, 80): config.json does not match the weights") in err, err


def test_a_tokenizer_past_the_embedding_is_refused_before_a_forward(tmp_path, capfd):
    """SmolLM2's tokenizer (49152 ids) on a model of 1000 embedding rows: named, not an IndexError."""
    src = make_tiny_model(tmp_path / "src", "llama", layers=1, vocab_size=1000)
    err = _refused(capfd, src, tmp_path / "out")
    assert f"the tokenizer of {src} (49152 ids) gives token id " in err
    assert "but the model's embedding has 1000 rows" in err
