"""A checkpoint is what it says or it is refused, with file and tensor named: a header edit that
keeps the bytes (dtype BF16→F16), a shard without checksums, scales that are 0, negative or too
large, a Huffman symbol past any real weight, a tensor declaring a memory bomb's shape, and a
directory whose quantization_config was removed (latq-eval would otherwise measure random
linears)."""
from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from vllm_latq.commands.evaluate import main as eval_main
from vllm_latq.format.checkpoint import Checkpoint
from vllm_latq.format.safetensors_file import CHECKSUM_KEY, SafetensorsFile, write_safetensors
from vllm_latq.format.validate import validate_checkpoint
from vllm_latq.errors import FormatError
from vllm_latq.commands.inspect import inspect_main
from vllm_latq.testing.header_edits import read_header, with_header

ROOT = Path(__file__).resolve().parents[2]
NORM = "model.norm.weight"
L0 = "model.layers.0.self_attn.q_proj"


def _copy(tiny_checkpoints, method, tmp_path):
    d = tmp_path / method
    shutil.copytree(tiny_checkpoints[method][0], d)
    return d


def _edit_header(path, fn):
    """Apply ``fn`` to the parsed JSON header of a shard, bytes untouched (padded to its length)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    fn(header)
    new = json.dumps(header, separators=(",", ":")).encode()
    assert len(new) <= n
    path.write_bytes(raw[:8] + new + b" " * (n - len(new)) + raw[8 + n:])


def _rewrite(d, name, fn):
    """Replace tensor ``name`` by ``fn(tensor)``, checksums recomputed (a value that verifies)."""
    shard = Checkpoint(d).where[name]
    f = SafetensorsFile(d / shard)
    t = {n: f.get(n) for n in f.names()}
    t[name] = fn(t[name])
    write_safetensors(d / shard, t)


def _refused(d, capsys, *fragments):
    assert inspect_main([str(d)]) == 2
    err = capsys.readouterr().err
    for f in fragments:
        assert f in err, err
    return err


def test_header_dtype_edit_is_refused(tiny_checkpoints, tmp_path, capsys):
    """BF16 → F16 on a norm, bytes untouched: the same size, another meaning."""
    d = _copy(tiny_checkpoints, "ssqr", tmp_path)
    shard = Checkpoint(d).where[NORM]
    assert SafetensorsFile(d / shard).entries[NORM].dtype == "BF16"
    _edit_header(d / shard, lambda h: h[NORM].update(dtype="F16"))
    _refused(d, capsys, shard, NORM, "the header was edited")


def test_shard_without_checksums_is_refused(tiny_checkpoints, tmp_path, capsys):
    d = _copy(tiny_checkpoints, "ssqr", tmp_path)
    shard = Checkpoint(d).where[f"{L0}.qweight"]
    _edit_header(d / shard, lambda h: h["__metadata__"].pop(CHECKSUM_KEY))
    _refused(d, capsys, shard, f"no {CHECKSUM_KEY} checksum table")
    assert inspect_main([str(d), "--no-checksums"]) == 0   # on purpose: says what it skips
    capsys.readouterr()


@pytest.mark.parametrize("value, why", [(0.0, "must be > 0"), (-0.01, "must be > 0"), (65504.0, "exceeds 65504")])
def test_group_scales_out_of_range_are_refused(tiny_checkpoints, tmp_path, capsys, value, why):
    d = _copy(tiny_checkpoints, "ssqr", tmp_path)
    _rewrite(d, f"{L0}.scales", lambda s: s.index_fill(1, torch.tensor([0]), value))
    _refused(d, capsys, f"{L0}.scales", why)


def _set(i, v):
    return lambda t: t.index_fill(0, torch.tensor([t.numel() - 1 if i < 0 else i]), v)


@pytest.mark.parametrize("edits, tensor, why", [
    ({"hscale": lambda t: t * 0}, "hscale", "must be > 0"),
    ({"hscale": lambda t: -t}, "hscale", "must be > 0"),
    ({"hscale": lambda t: t + 1e-6}, "hscale", "not fp16-exact"),   # the runtime form keeps it in fp16
    ({"hsymbols": _set(-1, 2**22)}, "hsymbols", "beyond 65504"),     # 2^22 x hscale (~0.027): past fp16
    # the scale small enough for fp16 (2^25 x 2^-12 = 8192), the symbol past fp32's exact integers
    ({"hscale": lambda t: torch.full_like(t, 2.0**-12), "hsymbols": _set(-1, 2**25)}, "hsymbols", "exceeds 2^24"),
    ({"hsymbols": _set(0, -2**31)}, "hsymbols", "exceeds 2^24")])   # |-2^31| overflows int32
def test_huffman_values_out_of_range_are_refused(tiny_checkpoints, tmp_path, capsys, edits, tensor, why):
    d = _copy(tiny_checkpoints, "hptq", tmp_path)
    for sfx, edit in edits.items():
        _rewrite(d, f"{L0}.{sfx}", edit)
    _refused(d, capsys, f"{L0}.{tensor}", why)


def _declare_bomb(shard, name: str, nbytes: int) -> None:
    """Make ``shard``'s header declare ``name`` as ``nbytes`` of data past the others' (its own
    dtype), the file extended to hold them sparsely: no disk, the size declared."""
    raw = shard.read_bytes()
    header, n = read_header(raw)
    end = max(e["data_offsets"][1] for k, e in header.items() if k != "__metadata__")
    item = {"I16": 2, "I32": 4}[header[name]["dtype"]]
    header[name] = {**header[name], "shape": [nbytes // item], "data_offsets": [end, end + nbytes]}
    new = with_header(raw, n, header)
    with shard.open("wb") as f:
        f.write(new)
        f.truncate(len(new) - len(raw) + 8 + n + end + nbytes)


def test_memory_bomb_is_refused_before_any_byte_is_read(tiny_checkpoints, tmp_path, monkeypatch):
    """A tensor declaring 64 GiB in a sparse file of that size: refused from its header, in
    seconds, without reading it."""
    d = _copy(tiny_checkpoints, "ssqr", tmp_path)
    name = f"{L0}.outlier_col"
    shard = d / Checkpoint(d).where[name]
    _declare_bomb(shard, name, 64 << 30)

    def no_read(*a, **k):
        raise AssertionError("a byte of the bomb was read")
    monkeypatch.setattr(SafetensorsFile, "pieces", no_read)
    monkeypatch.setattr(SafetensorsFile, "get", no_read)
    t0 = time.time()
    with pytest.raises(FormatError, match=rf"{shard.name}.*{name}.*more than the"):
        validate_checkpoint(d)
    assert time.time() - t0 < 30


def test_memory_bomb_is_refused_under_a_memory_limit(tiny_checkpoints, tmp_path):
    """latq-inspect (--no-verify: no checksum or written layout to fall back on) and latq-eval as
    processes limited to 3 GiB of address space, on a shard whose header declares a 100 GiB
    tensor (a sparse file): each exits 2 naming file and tensor, in seconds (reading the tensor
    whole would end in a MemoryError)."""
    d = _copy(tiny_checkpoints, "ssqr", tmp_path)
    name = f"{L0}.outlier_col"
    shard = d / Checkpoint(d).where[name]
    _declare_bomb(shard, name, 100 << 30)
    text = tmp_path / "text.txt"
    text.write_text("The tiny model reads this. " * 40)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
    cmds = {"latq-inspect": ["-m", "vllm_latq.commands.inspect", str(d), "--no-served", "--no-verify"],
            "latq-eval": ["-m", "vllm_latq.commands.evaluate", str(d), "--text", str(text), "--nwindows", "1", "--seqlen",
                          "16", "--no-progress"]}
    t0 = time.time()
    try:
        procs = {k: subprocess.Popen([sys.executable, *c], env=env, preexec_fn=limit, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True) for k, c in cmds.items()}
        for k, p in procs.items():   # both at once: most of their time is Python's imports
            _, err = p.communicate(timeout=300)
            assert p.returncode == 2, (k, err[-3000:])
            assert f"file {shard.name}, tensor {name}: shape (53687091200,): more than the" in err, (k, err[-3000:])
        assert time.time() - t0 < 120
    finally:
        shard.unlink()   # no 100 GiB file left to a tool that reads sizes


def test_eval_refuses_a_checkpoint_stripped_of_its_quantization_config(tiny_checkpoints, tmp_path, capsys):
    d = _copy(tiny_checkpoints, "ssqr", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["quantization_config"]
    (d / "config.json").write_text(json.dumps(cfg))
    assert eval_main([str(d), "--nwindows", "1", "--seqlen", "16", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "weights of the model are not in its files" in err and "quantization_config" in err


def test_nan_in_a_norm_is_refused(tiny_checkpoints, tmp_path, capsys):
    d = _copy(tiny_checkpoints, "ssqr", tmp_path)
    _rewrite(d, NORM, lambda t: t.index_fill(0, torch.tensor([3]), float("nan")))
    _refused(d, capsys, NORM, "NaN/Inf")


def test_outliers_in_a_method_that_stores_none_are_refused(tiny_checkpoints, tmp_path, capsys):
    """An SSQR checkpoint relabelled gptq: its layers carry outliers GPTQ never writes."""
    d = _copy(tiny_checkpoints, "ssqr", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["method"] = "gptq"
    cfg["quantization_config"].pop("outlier_rate", None)
    (d / "config.json").write_text(json.dumps(cfg))
    _refused(d, capsys, "outliers, but method gptq stores none")


# ----------------------------------------------------------------------------- plain tensors' dtype and values

def test_plain_dtype_edit_is_refused_without_checksums_too(tiny_checkpoints, tmp_path, capsys):
    """--no-verify skips the sha256 checks, not the rule that a plain tensor keeps the dtype
    recorded for it when the checkpoint was written; a shard re-saved without that record is
    held to the config's dtype."""
    from vllm_latq.format.safetensors_file import LAYOUT_KEY
    d = _copy(tiny_checkpoints, "ssqr", tmp_path)
    shard = Checkpoint(d).where[NORM]
    _edit_header(d / shard, lambda h: h[NORM].update(dtype="F16"))
    assert inspect_main([str(d), "--no-served", "--no-verify"]) == 2
    err = capsys.readouterr().err
    assert f"file {shard}, tensor {NORM}: header says F16[80], the tensor was written as BF16[80]" in err, err
    _edit_header(d / shard, lambda h: h["__metadata__"].pop(LAYOUT_KEY))
    assert inspect_main([str(d), "--no-served", "--no-verify"]) == 2
    err = capsys.readouterr().err
    assert f"file {shard}, tensor {NORM}: dtype torch.float16, expected torch.bfloat16 from config.json" in err, err


def test_a_plain_tensor_written_in_fp32_is_valid(tiny_checkpoints, tmp_path, capsys):
    """Sources keep some plain tensors in fp32 in a bf16 model; written so, they are valid."""
    from vllm_latq.format.manifest import write_manifest
    d = _copy(tiny_checkpoints, "ssqr", tmp_path)
    _rewrite(d, NORM, lambda t: t.float())
    write_manifest(d)
    assert inspect_main([str(d), "--no-served"]) == 0, capsys.readouterr().err
    capsys.readouterr()


def _with_attention_biases(d, fill: float):
    """The checkpoint ``d`` made a Llama with attention biases (all ``fill``, but the first
    entry of the last one NaN), written and signed as the quantizer would."""
    from vllm_latq.format.manifest import write_manifest
    cfg = json.loads((d / "config.json").read_text())
    cfg["attention_bias"] = True
    (d / "config.json").write_text(json.dumps(cfg))
    ck = Checkpoint(d)
    shard = ck.where[NORM]
    f = SafetensorsFile(d / shard)
    t = {n: f.get(n) for n in f.names()}
    biases = {k: torch.full(v.shape, fill, dtype=torch.bfloat16) for k, v in ck.empty_model().state_dict().items()
              if k.endswith("_proj.bias")}
    last = sorted(biases)[-1]
    biases[last][0] = float("nan")
    write_safetensors(d / shard, {**t, **biases})
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    idx["weight_map"].update({k: shard for k in biases})
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    write_manifest(d)
    return shard, last


def test_nan_in_a_bias_is_refused(tiny_checkpoints, tmp_path, capsys):
    d = _copy(tiny_checkpoints, "ssqr", tmp_path)
    shard, name = _with_attention_biases(d, 0.01)
    assert name.startswith("model.layers.1.self_attn.") and name.endswith("_proj.bias")
    assert inspect_main([str(d), "--no-served"]) == 2
    err = capsys.readouterr().err
    assert f"file {shard}, tensor {name}: has NaN/Inf values" in err, err
    _rewrite(d, name, lambda b: torch.nan_to_num(b))   # the control: finite biases are valid
    from vllm_latq.format.manifest import write_manifest
    write_manifest(d)
    assert inspect_main([str(d), "--no-served"]) == 0, capsys.readouterr().err
    capsys.readouterr()
