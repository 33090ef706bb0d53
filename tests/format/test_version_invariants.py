"""What the format states of its versions and files, checked on a sealed checkpoint edited and
sealed again (as anyone can): format_version a JSON integer, version 3 only for the codebook kind,
a shard exactly 8 + header + data bytes, every integer a JSON integer, each method's keys its own,
lm_head_quantized exactly when the head is stored quantized, the parts vLLM fuses at one width,
informational keys ignored, no pickle. Each is refused by the readers in one line naming the file
and key or tensor; the codebook kind without its rotation: tests/quantize/test_e8_method.py; which
FORMAT.md sentence each test holds: tests/format/test_format_invariants.py."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from vllm_latq import format as fmt
from vllm_latq.commands import inspect
from vllm_latq.format.checkpoint import Checkpoint
from vllm_latq.format.files import STATS_FILE
from vllm_latq.format.manifest import MANIFEST_FILE, write_manifest


def _refused(d, capsys, *says) -> str:
    assert inspect.inspect_main([str(d), "--no-served"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    for s in says:
        assert s in err, err
    return err


def test_the_tiny_checkpoint_passes(ck, capsys):
    assert inspect.inspect_main([str(ck), "--no-served"]) == 0   # so each refusal below is the edit's


@pytest.mark.parametrize("change, says", [
    ({"format_version": 1.0}, "format_version must be an integer, got 1.0"),
    ({"format_version": 3}, "format_version 3 marks the codebook kind (method e8), not ssqr"),
    ({"format_version": 2}, "format_version 2 marks a rotated checkpoint, but it has no rotation"),
])
def test_a_version_that_does_not_mean_this_checkpoint_is_refused(ck, capsys, change, says):
    _edit(ck, "config.json", _qc(**change))
    _refused(ck, capsys, "config.json", says)


def test_bytes_after_a_shards_data_are_refused(ck, capsys):
    """The manifest seals a shard's header (its tensors' bytes through their checksums): bytes
    appended after the data change neither, so the reader checks the size itself."""
    shard = sorted(ck.glob("model-*.safetensors"))[0]
    with open(shard, "ab") as f:
        f.write(b"\0" * 8)
    _refused(ck, capsys, shard.name, "8 bytes after the tensors' data")


@pytest.fixture(scope="module")
def headed(tiny_llama, tmp_path_factory):
    """An RTN checkpoint of the tiny Llama with its head quantized (8 bits, the blocks 4) and coded scales."""
    from vllm_latq.quantize.pipeline import QuantizeOptions, quantize_model
    from vllm_latq.testing.tiny_models import TINY_CALIB
    out = tmp_path_factory.mktemp("headed") / "ck"
    return quantize_model(tiny_llama, out, QuantizeOptions(method="rtn", group_size=32, scale_bits=4,
                                                           lm_head_bits=8, **TINY_CALIB), progress=False)


@pytest.fixture
def hd(headed, tmp_path):
    d = tmp_path / "hd"
    shutil.copytree(headed, d)
    return d


def _edit(d, name: str, fn) -> None:
    """``fn`` applied to JSON file ``name`` of ``d``, sealed again (as anyone can)."""
    obj = json.loads((d / name).read_text())
    fn(obj)
    (d / name).write_text(json.dumps(obj))
    if name != MANIFEST_FILE:
        write_manifest(d)


def _qc(**change):
    return lambda c: c["quantization_config"].update(change)


@pytest.mark.parametrize("name, fn, says", [
    ("config.json", _qc(scale_bits=4.0), ["file config.json", "scale_bits must be", "got 4.0"]),
    ("config.json", _qc(bits=4.0), ["file config.json", "bits must be an integer", "got 4.0"]),
    ("config.json", _qc(layer_bits={"lm_head": 8.0}), ["file config.json", "layer_bits['lm_head']", "got 8.0"]),
    ("config.json", lambda c: c.update(hidden_size=64.0),
     ["file config.json", "hidden_size is 64.0, expected an integer"]),
    ("config.json", lambda c: c.update(num_hidden_layers=2.0), ["file config.json", "num_hidden_layers is 2.0"]),
    (MANIFEST_FILE, lambda m: m.update(manifest_version=2.0), [f"file {MANIFEST_FILE}", "manifest_version 2.0"]),
    (STATS_FILE, lambda s: s.update(format_version=1.0),
     [f"file {STATS_FILE}", "format_version must be a JSON integer"]),
    (STATS_FILE, lambda s: s["layers"][0].update(group_size=32.0),
     [f"file {STATS_FILE}, tensor model.layers.0.self_attn.q_proj", "group_size must be a JSON integer, got 32.0"]),
    (STATS_FILE, lambda s: s["layers"][0].update(shape=[80.0, 80]), ["shape must be a list of JSON integers"]),
    (STATS_FILE, lambda s: s["layers"][0].update(hessian_tokens=0.0), ["hessian_tokens must be a JSON integer"]),
])
def test_json_numbers_where_integers_are_meant_are_refused(hd, capsys, name, fn, says):
    """64.0 == 64 in Python: each integer the format means is refused as a float, naming file and key."""
    _edit(hd, name, fn)
    _refused(hd, capsys, *says)


@pytest.mark.parametrize("which, change, says", [
    ("headed", {"outlier_rate": 0.0}, "outlier_rate is ssqr's only, not rtn's"),
    ("headed", {"target_bits": 4.0}, "target_bits is hptq's and hrtn's only, not rtn's"),
    ("ssqr", {"target_bits": 4.0}, "target_bits is hptq's and hrtn's only, not ssqr's"),
])
def test_a_key_of_another_method_is_refused(hd, ck, capsys, which, change, says):
    d = hd if which == "headed" else ck
    _edit(d, "config.json", _qc(**change))
    _refused(d, capsys, "file config.json", says)


def test_lm_head_quantized_is_true_exactly_when_the_head_is_stored_quantized(hd, ck, capsys):
    assert inspect.inspect_main([str(hd), "--no-served"]) == 0   # so each refusal below is the edit's
    capsys.readouterr()
    _edit(hd, "config.json", lambda c: c["quantization_config"].pop("lm_head_quantized"))
    _refused(hd, capsys, "file config.json", "lm_head_quantized is absent, but the output head lm_head is stored "
                                             "quantized")
    _edit(ck, "config.json", _qc(lm_head_quantized=True))   # the SSQR checkpoint keeps its head
    _refused(ck, capsys, "file config.json", "lm_head_quantized is true, but the output head lm_head is stored "
                                             "unquantized")
    _edit(ck, "config.json", _qc(lm_head_quantized=1))
    _refused(ck, capsys, "file config.json", "lm_head_quantized must be true or absent, got 1")


def test_layer_bits_name_quantized_layers_and_fused_parts_agree(hd, capsys):
    lb = lambda more: lambda c: c["quantization_config"]["layer_bits"].update(more)  # noqa: E731
    d = hd.parent / "other"
    shutil.copytree(hd, d)
    _edit(hd, "config.json", lb({"model.layers.0.self_attn.k_proj": 3}))
    _refused(hd, capsys, "file config.json", "q_proj/k_proj/v_proj of model.layers.0.self_attn", "[3, 4]")
    _edit(d, "config.json", lb({"model.layers.0.mlp.nothing": 3}))
    _refused(d, capsys, "file config.json", "layer_bits names ['model.layers.0.mlp.nothing']")


@pytest.mark.parametrize("sealed", [False, True])
def test_a_pickle_file_is_refused_sealed_or_not(ck, capsys, sealed):
    torch.save({"x": torch.zeros(1)}, ck / "pytorch_model.bin")
    if sealed:
        write_manifest(ck)
    _refused(ck, capsys, "file pytorch_model.bin", "safetensors only")


def test_informational_keys_are_ignored_by_readers(ck, tmp_path, capsys):
    """A key readers need nothing of (decoder, a newer writer's addition) changes nothing they read."""
    before = dict(Checkpoint(ck).dequantized_tensors())
    _edit(ck, "config.json", _qc(decoder={"name": "kbest", "beam": 3}, latq_newer_note={"any": [1, "x"]}))
    assert inspect.inspect_main([str(ck), "--no-served"]) == 0, capsys.readouterr().err
    after = dict(Checkpoint(ck).dequantized_tensors())
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert fmt.parse_quantization_config(json.loads((ck / "config.json").read_text())["quantization_config"]).extra[
        "decoder"] == {"name": "kbest", "beam": 3}
