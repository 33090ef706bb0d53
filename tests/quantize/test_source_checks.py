"""Sources that would give a wrong or unreadable checkpoint: a head its config ties to the embedding
but which the source holds apart (dropped and named when equal, refused when it differs), a source
without a tokenizer (refused before any work: latq-eval could not read its checkpoint), and a source
edited in place, which a sealed run directory or ``--resume`` does not take as the same."""
from __future__ import annotations

import json
import os
import shutil

import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from vllm_latq.commands import quantize as cli
from vllm_latq.quantize import faults
from vllm_latq.quantize.output import TMP_SUFFIX

RTN = ["--method", "rtn", "--group-size", "32", "--no-progress"]


def _with_own_head(src, scale: float):
    f = src / "model.safetensors"
    t = load_file(f)
    t["lm_head.weight"] = (t["model.embed_tokens.weight"].float() * scale).to(t["model.embed_tokens.weight"].dtype)
    save_file(t, str(f), metadata={"format": "pt"})


@pytest.fixture
def source(tiny_llama, tmp_path):
    shutil.copytree(tiny_llama, tmp_path / "tiny")
    return tmp_path / "tiny"


def _tensors(ck) -> set[str]:
    names = set()
    for f in ck.glob("*.safetensors"):
        with safe_open(f, "pt") as h:
            names |= set(h.keys())
    return names


@pytest.mark.parametrize("head", ["kept", "quantized"])
def test_a_tied_head_equal_to_the_embedding_is_dropped_and_named(source, tmp_path, head, capsys):
    _with_own_head(source, 1.0)
    out = tmp_path / "ck"
    flag = "--no-quantize-lm-head" if head == "kept" else "--quantize-lm-head"
    assert cli.main([str(source), str(out), *RTN, flag]) == 0
    assert "dropping the source's lm_head.weight (equal to model.embed_tokens.weight)" in capsys.readouterr().err
    assert "lm_head.weight" not in _tensors(out)
    tied = json.loads((out / "config.json").read_text())["tie_word_embeddings"]
    assert tied == (head == "kept")   # a quantized head is written untied, as lm_head.*


def test_a_tied_head_that_differs_from_the_embedding_is_refused_before_any_work(source, tmp_path, capsys):
    _with_own_head(source, 2.0)
    out = tmp_path / "ck"
    assert cli.main([str(source), str(out), *RTN]) == 2
    [err] = [x for x in capsys.readouterr().err.splitlines() if x.startswith("latq-quantize: error:")]
    assert "holds its own lm_head.weight, which differs from model.embed_tokens.weight" in err, err
    assert "Set tie_word_embeddings to false in config.json" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_a_source_without_a_tokenizer_is_refused_before_any_work(source, tmp_path, method, capsys):
    """Its checkpoint would be sealed, and latq-eval could not read it."""
    for f in source.glob("tokenizer*"):
        f.unlink()
    out = tmp_path / "ck"
    assert cli.main([str(source), str(out), "--method", method, "--group-size", "32", "--nsamples", "2",
                     "--seqlen", "16", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{source}: its tokenizer (" in err and "could not be read by latq-eval" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]


def test_a_source_edited_in_place_is_not_resumed(source, tmp_path, capsys):
    """The resume fingerprint is the source's bytes: an edit that keeps the size and the times is seen."""
    out = tmp_path / "ck"
    os.environ[faults.STOP_ENV] = "0"
    try:
        assert cli.main([str(source), str(out), *RTN]) == 3
    finally:
        del os.environ[faults.STOP_ENV]
    f = source / "model.safetensors"
    st = f.stat()
    raw = bytearray(f.read_bytes())
    raw[-2] ^= 0x01
    f.write_bytes(bytes(raw))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    for resume in ([], ["--resume"]):   # neither resumed nor discarded, asked to resume or not
        assert cli.main([str(source), str(out), *RTN, *resume]) == 2
        assert "holds an interrupted run of another source or other options" in capsys.readouterr().err
    assert (tmp_path / ("ck" + TMP_SUFFIX)).is_dir() and not out.exists()
