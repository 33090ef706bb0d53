"""What gives a checkpoint its meaning is checked or refused: config.json and latq_stats.json are
covered by latq_manifest.json's checksums (missing = refused, ``--no-verify`` says what it skips),
config sizes are bounded before any tensor is read, a file linked out of the checkpoint is refused,
and a Huffman chunk table that does not fit its stream is named by file and tensor."""
from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch

from vllm_latq.errors import FormatError
from vllm_latq.commands.evaluate import main as eval_main
from vllm_latq.format.checkpoint import Checkpoint, load_dequantized_model
from vllm_latq.format.files import MANIFEST_FILE, STATS_FILE
from vllm_latq.format.safetensors_file import SafetensorsFile, write_safetensors
from vllm_latq.format.validate import validate_checkpoint
from vllm_latq.commands.inspect import inspect_main
from vllm_latq.testing.header_edits import edit_bytes_in_place, edit_entry, read_header, with_header

L0 = "model.layers.0.self_attn.q_proj"
EVAL = ["--nwindows", "1", "--seqlen", "16", "--no-progress"]


def _copy(tiny_checkpoints, method, tmp_path):
    d = tmp_path / method
    shutil.copytree(tiny_checkpoints[method][0], d)
    return d


def _edit(path, fn):
    obj = json.loads(path.read_text())
    fn(obj)
    path.write_text(json.dumps(obj, indent=1))


def _qc(fn):
    return lambda c: fn(c["quantization_config"])


CONFIG_EDITS = {   # each keeps every shape consistent: only a checksum can tell
    "group_size_64_to_65": _qc(lambda q: q.update(group_size=65)),   # same group counts for in 80 and 144
    "damp": _qc(lambda q: q.update(damp=0.02)),
    "order": _qc(lambda q: q.update(order="natural")),
    "rms_norm_eps": lambda c: c.update(rms_norm_eps=0.5),
}
STATS_EDITS = {
    "certificate": lambda s: s["layers"][0].update(cert=0.001),
    "rel_error": lambda s: s["layers"][0].update(rel_error=1e-9),
    "totals": lambda s: s["totals"].update(rel_error_mean=1e-9),
}


@pytest.mark.parametrize("edit", sorted(CONFIG_EDITS))
def test_config_edit_is_refused(tiny_checkpoints, tmp_path, capsys, edit):
    d = _copy(tiny_checkpoints, "ssqr", tmp_path)
    _edit(d / "config.json", CONFIG_EDITS[edit])
    assert inspect_main([str(d), "--no-served"]) == 2
    err = capsys.readouterr().err
    assert "config.json" in err and "edited" in err, err
    assert eval_main([str(d), *EVAL]) == 2
    assert "config.json" in capsys.readouterr().err


@pytest.mark.parametrize("edit", sorted(STATS_EDITS))
def test_forged_stats_are_refused(tiny_checkpoints, tmp_path, capsys, edit):
    d = _copy(tiny_checkpoints, "hptq", tmp_path)
    _edit(d / STATS_FILE, STATS_EDITS[edit])
    assert inspect_main([str(d), "--no-served"]) == 2
    err = capsys.readouterr().err
    assert STATS_FILE in err and "edited" in err, err


def test_reformatted_json_is_not_an_edit(tiny_checkpoints, tmp_path, capsys):
    """The checksums cover the JSON's values, not its layout: re-indented files still verify."""
    d = _copy(tiny_checkpoints, "ssqr", tmp_path)
    for f in ("config.json", STATS_FILE):
        _edit(d / f, lambda obj: None)
    assert inspect_main([str(d), "--no-served"]) == 0, capsys.readouterr().err
    capsys.readouterr()


def test_missing_manifest_is_refused_and_no_verify_says_what_it_skips(tiny_checkpoints, tmp_path, capsys):
    d = _copy(tiny_checkpoints, "ssqr", tmp_path)
    (d / MANIFEST_FILE).unlink()
    assert inspect_main([str(d), "--no-served"]) == 2
    err = capsys.readouterr().err
    assert MANIFEST_FILE in err and "re-quantize" in err and "--no-verify" in err, err
    assert eval_main([str(d), *EVAL]) == 2
    capsys.readouterr()
    assert inspect_main([str(d), "--no-served", "--no-verify"]) == 0
    err = capsys.readouterr().err
    assert err.count("--no-verify") == 1 and "sha256" in err and MANIFEST_FILE in err, err
    assert eval_main([str(d), *EVAL, "--no-verify"]) == 0
    err = capsys.readouterr().err
    assert err.count("--no-verify") == 1 and MANIFEST_FILE in err, err


def test_stripped_shard_layouts_are_refused(tiny_checkpoints, tmp_path, capsys):
    """A shard stripped of its written layouts (the dtypes then held to config.json's) is caught
    by the manifest's checksum of the shard's header; a dtype edit with it, by the dtype rule
    first, naming the tensor."""
    from vllm_latq.format.safetensors_file import LAYOUT_KEY
    d = _copy(tiny_checkpoints, "ssqr", tmp_path)
    shard = Checkpoint(d).where["model.norm.weight"]
    path = d / shard
    raw = path.read_bytes()
    header, n = read_header(raw)
    del header["__metadata__"][LAYOUT_KEY]
    path.write_bytes(with_header(raw, n, header))
    assert inspect_main([str(d), "--no-served"]) == 2
    err = capsys.readouterr().err
    assert f"file {shard}: the header" in err and "edited" in err, err
    edit_entry(header, "model.norm.weight", "dtype", dtype="F16")
    path.write_bytes(with_header(raw, n, header))
    assert inspect_main([str(d), "--no-served"]) == 2
    err = capsys.readouterr().err
    assert f"file {shard}, tensor model.norm.weight: dtype torch.float16, expected torch.bfloat16" in err, err


def _capture_latq_log():
    """(records, detach): the plugin logger's records (vLLM's configuration may stop it propagating)."""
    records, log = [], logging.getLogger("vllm.latq")
    handler = logging.Handler()
    handler.emit = records.append
    log.addHandler(handler)
    return records, lambda: log.removeHandler(handler)


def test_vllm_loader_refuses_an_edited_config(tiny_checkpoints, tmp_path, monkeypatch):
    """The plugin's check, run where vLLM hands it the model directory; LATQ_NO_VERIFY=1 skips
    the checksums with one log line saying what."""
    from vllm_latq.format.validate import verify_for_serving
    d = _copy(tiny_checkpoints, "ssqr", tmp_path)
    verify_for_serving(d)
    _edit(d / "config.json", CONFIG_EDITS["damp"])
    with pytest.raises(FormatError, match=r"config.json.*quantization_config.*edited"):
        verify_for_serving(d)
    monkeypatch.setenv("LATQ_NO_VERIFY", "1")
    records, detach = _capture_latq_log()
    try:
        verify_for_serving(d)
    finally:
        detach()
    assert sum("LATQ_NO_VERIFY=1: the sha256 checks" in r.getMessage() for r in records) == 1
    _edit(d / "config.json", CONFIG_EDITS["group_size_64_to_65"])   # a value bound: refused unchecked too
    with pytest.raises(FormatError, match=r"config.json: quantization_config.group_size is 65, but .* group size 64"):
        verify_for_serving(d)


def _with_outliers(d) -> str:
    ck = Checkpoint(d)
    return next(n for n in ck.where if n.endswith(".outlier_val") and ck.shards[ck.where[n]].shape(n)[0] > 0)


IN_PLACE = {   # (tensor, edit, what the value check says when LATQ_NO_VERIFY=1 skips the sha256; None: in bounds)
    "outliers_x100": (_with_outliers, lambda t: t * 100, None),
    "nan_in_a_norm": (lambda d: "model.norm.weight", lambda t: t.index_fill(0, torch.tensor([3]), float("nan")),
                      "NaN/Inf"),
    "a_scale_set_to_0": (lambda d: f"{L0}.scales", lambda t: t.index_fill(1, torch.tensor([0]), 0.0), "must be > 0"),
}


@pytest.mark.parametrize("edit", sorted(IN_PLACE))
def test_serving_check_reads_bytes_and_bounds(tiny_checkpoints, tmp_path, monkeypatch, edit):
    """An in-place byte edit, its header and checksum table left as written: the plugin's check
    refuses it by the tensor's sha256, naming file and tensor; with LATQ_NO_VERIFY=1 (sha256
    skipped) the value bounds still refuse what is out of them."""
    from vllm_latq.format.validate import verify_for_serving
    d = _copy(tiny_checkpoints, "ssqr", tmp_path)
    pick, fn, bound = IN_PLACE[edit]
    name = pick(d)
    shard = Checkpoint(d).where[name]
    edit_bytes_in_place(d / shard, name, fn)
    with pytest.raises(FormatError, match=rf"file {shard}, tensor {name}: sha256 mismatch"):
        verify_for_serving(d)
    monkeypatch.setenv("LATQ_NO_VERIFY", "1")
    if bound is None:
        verify_for_serving(d)
    else:
        with pytest.raises(FormatError, match=rf"file {shard}, tensor {name}: .*{bound}"):
            verify_for_serving(d)


# ----------------------------------------------------------------------------- config sizes

@pytest.mark.parametrize("field, value", [("num_hidden_layers", 100000), ("hidden_size", 2**40),
                                          ("vocab_size", 10**12), ("intermediate_size", 0),
                                          ("num_experts", 10**9)])
def test_config_sizes_are_bounded_before_any_tensor_is_read(tiny_checkpoints, tmp_path, monkeypatch, field, value):
    d = _copy(tiny_checkpoints, "ssqr", tmp_path)
    _edit(d / "config.json", lambda c: c.update({field: value}))

    def no_read(*a, **k):
        raise AssertionError("a shard was opened")
    monkeypatch.setattr(SafetensorsFile, "__init__", no_read)
    with pytest.raises(FormatError, match=rf"config.json: {field} is {value}, .*expected"):
        validate_checkpoint(d, verify_checksums=False)


def test_source_config_sizes_are_bounded_before_quantizing(tiny_llama, tmp_path, capsys):
    from vllm_latq.commands.quantize import main as quantize_main
    src = tmp_path / "src"
    shutil.copytree(tiny_llama, src)
    _edit(src / "config.json", lambda c: c.update(num_hidden_layers=100000))
    assert quantize_main([str(src), str(tmp_path / "out"), "--method", "rtn"]) == 2
    err = capsys.readouterr().err
    assert f"{src / 'config.json'}: num_hidden_layers is 100000, expected an integer in [1, 1024]" in err, err
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- symbolic links

@pytest.mark.parametrize("which", ["shard", "config.json"])
def test_a_file_linked_out_of_the_checkpoint_is_refused(tiny_checkpoints, tmp_path, capsys, which):
    d = _copy(tiny_checkpoints, "ssqr", tmp_path)
    name = Checkpoint(d).where[f"{L0}.qweight"] if which == "shard" else which
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.move(d / name, outside / name)
    os.symlink(outside / name, d / name)
    assert inspect_main([str(d), "--no-served", "--no-verify"]) == 2
    err = capsys.readouterr().err
    assert name in err and "symbolic link" in err and "outside" in err, err


def test_a_link_inside_the_checkpoint_is_read(tiny_checkpoints, tmp_path, capsys):
    d = _copy(tiny_checkpoints, "ssqr", tmp_path)
    (d / "sub").mkdir()
    shutil.move(d / STATS_FILE, d / "sub" / STATS_FILE)
    os.symlink(os.path.join("sub", STATS_FILE), d / STATS_FILE)
    assert inspect_main([str(d), "--no-served"]) == 0, capsys.readouterr().err
    capsys.readouterr()


# ----------------------------------------------------------------------------- Huffman chunk table

def test_huffman_chunk_mismatch_names_file_and_tensor(tiny_checkpoints, tmp_path, capsys):
    """A chunk table whose lengths do not sum to the stream's, with checksums recomputed and
    --no-verify (what a re-saved edit looks like): eval names the file and tensor."""
    d = _copy(tiny_checkpoints, "hptq", tmp_path)
    name = f"{L0}.hchunk_bits"
    shard = Checkpoint(d).where[name]
    f = SafetensorsFile(d / shard)
    t = {n: f.get(n) for n in f.names()}
    t[name] = t[name].clone()
    t[name][0] -= 8
    write_safetensors(d / shard, t)
    assert eval_main([str(d), *EVAL, "--no-verify"]) == 2
    err = capsys.readouterr().err
    assert shard in err and f"{L0}.hstream" in err and "chunk" in err, err
    with pytest.raises(FormatError, match=rf"{shard}.*{L0}.hstream"):
        load_dequantized_model(d, torch.float32)
