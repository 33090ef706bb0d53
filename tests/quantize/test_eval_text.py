"""The user's own text: ``latq-eval --text FILE`` and ``latq-quantize --calib FILE`` (.txt, .jsonl).

Both read the file through ``data.read_documents`` and cut it with the windowing of the
Wikipedia protocol; these tests check the CLIs against a by-hand computation on the tiny
Llama of tests/conftest.py (SmolLM2's tokenizer) and a character tokenizer.
"""
from __future__ import annotations

import hashlib
import json
import re

import pytest
import torch

from tests.data.test_data import char_ids, char_tokenizer
from vllm_latq import data
from vllm_latq.format.checkpoint import Checkpoint
from vllm_latq import cpu_features
from vllm_latq.commands import quantize as cli
from vllm_latq.commands import evaluate


def write_txt_and_jsonl(tmp_path, docs: list[str], stem: str = "mine"):
    """The same documents as one .txt (joined with a blank line) and as a .jsonl."""
    txt = tmp_path / f"{stem}.txt"
    txt.write_text("\n\n".join(docs), encoding="utf-8")
    jsonl = tmp_path / f"{stem}.jsonl"
    jsonl.write_text("".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs)), encoding="utf-8")
    return txt, jsonl


def run_eval(capfd, *args) -> tuple[int, str, str]:
    capfd.readouterr()
    rc = evaluate.main([*map(str, args), "--no-progress"])
    out, err = capfd.readouterr()
    return rc, out, err


# ------------------------------------------------------------------------------ latq-eval


def test_eval_text_equals_perplexity_by_hand(tiny_llama, tmp_path, capfd):
    """--text on a .txt and on the same documents as .jsonl: the perplexity of the first
    --nwindows consecutive --seqlen-token windows of the tokenized text, computed by hand."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    docs = data.wiki_split()[0][:4]  # any text that is not the eval split
    txt, jsonl = write_txt_and_jsonl(tmp_path, docs)
    ids = AutoTokenizer.from_pretrained(tiny_llama)("\n\n".join(docs), add_special_tokens=False)["input_ids"]
    assert len(ids) > 4 * 32  # more than the 3 windows asked for
    windows = torch.tensor(ids[: 3 * 32]).view(3, 32)  # SmolLM2 adds no BOS
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    want = data.perplexity(model, windows, progress=False)

    for path in (txt, jsonl):
        out = tmp_path / f"{path.name}.json"
        rc, stdout, err = run_eval(capfd, tiny_llama, "--text", path, "--seqlen", 32, "--nwindows", 3,
                                   "--output", out, "--json")
        assert rc == 0, err
        r = json.loads(out.read_text())
        assert r == json.loads(stdout)
        assert r["text"] == {"path": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
        assert (r["windows"], r["seqlen"], r["tokens"]) == (3, 32, 3 * 31)
        assert (r["ppl"], r["nll"]) == (want["ppl"], want["nll"])

    wiki = evaluate.evaluate(str(tiny_llama), seqlen=32, nwindows=3, progress=False)
    assert wiki["text"] == {"source": "wiki", "split": "eval"}
    assert wiki["ppl"] != want["ppl"]


def test_text_windows_are_consecutive_ids(tiny_llama, tmp_path):
    """The windows of a user's file are its tokenizer ids in order (.jsonl records joined by
    a blank line), BOS + seqlen-1 ids each for a BOS tokenizer; --nwindows caps them."""
    from transformers import AutoTokenizer

    docs = ["the quick brown fox jumps over the lazy dog.", "pack my box\nwith five dozen liquor jugs."] * 2
    txt, jsonl = write_txt_and_jsonl(tmp_path, docs)
    want = char_ids("\n\n".join(docs))
    assert len(want) == 174  # 10 windows of 16 and 14 left over; 11 of BOS + 15
    for path in (txt, jsonl):
        got = data.eval_windows(char_tokenizer(bos=False), 16, None, data.read_documents(path))
        assert got.dtype == torch.long and got.shape == (10, 16)
        assert got.flatten().tolist() == want[:160]
        assert torch.equal(data.eval_windows(char_tokenizer(bos=False), 16, 4, data.read_documents(path)), got[:4])
        bos = data.eval_windows(char_tokenizer(bos=True), 16, 64, data.read_documents(path))
        assert bos.shape == (11, 16) and bos[:, 0].tolist() == [0] * 11
        assert bos[:, 1:].flatten().tolist() == want[: 11 * 15]

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    real = data.wiki_split()[0][:3]
    _, jsonl = write_txt_and_jsonl(tmp_path, real, "real")
    ids = tok("\n\n".join(real), add_special_tokens=False)["input_ids"]
    got = data.eval_windows(tok, 24, None, data.read_documents(jsonl))
    assert got.flatten().tolist() == ids[: len(ids) // 24 * 24]


def test_too_short_text_says_tokens_had_and_needed(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("abcdefghij")  # 10 character tokens
    docs = data.read_documents(path)
    with pytest.raises(ValueError, match=r"short\.txt is too short: it has 10 tokens, but one 16-token "
                                         r"perplexity window needs 16 text tokens"):
        data.eval_windows(char_tokenizer(bos=False), 16, 4, docs)
    with pytest.raises(ValueError, match=r"has 10 tokens, but one 16-token perplexity window needs 15"):
        data.eval_windows(char_tokenizer(bos=True), 16, 4, docs)  # BOS + 15
    assert data.eval_windows(char_tokenizer(bos=False), 10, 4, docs).shape == (1, 10)


def test_eval_text_errors_name_the_file(tiny_llama, tmp_path, capfd):
    """Every bad --text is exit 2 and one line naming the file (and the line of a .jsonl).
    The text is read before the model is loaded: here the model does not even exist."""
    no_model = tmp_path / "no-model"
    cases = {
        "nothere.txt": (None, r"text file not found: .*nothere\.txt"),
        "empty.txt": (" \n\n", r"empty\.txt: empty text"),
        "empty.jsonl": ('\n{"text": ""}\n', r"empty\.jsonl: empty text"),
        "badjson.jsonl": ('{"text": "ok"}\n{"text": oops}\n', r"badjson\.jsonl: line 2: invalid JSON"),
        "notext.jsonl": ('{"text": "ok"}\n\n{"body": "x"}\n', r'notext\.jsonl: line 3: expected an object with a '
                                                            r'string "text" field'),
        "wrong.csv": ("a,b\n", r"'wiki', a \.txt or a \.jsonl file: .*wrong\.csv"),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / name
        if content is not None:
            path.write_text(content)
        rc, out, err = run_eval(capfd, no_model, "--text", path)
        assert (rc, out) == (2, ""), name
        assert err.startswith("latq-eval: error: ") and err.count("\n") == 1, err
        assert re.search(message, err), (name, err)

    short = tmp_path / "short.txt"
    short.write_text("Too short to fill a window.")
    from transformers import AutoTokenizer
    n = len(AutoTokenizer.from_pretrained(tiny_llama)(short.read_text(), add_special_tokens=False)["input_ids"])
    rc, out, err = run_eval(capfd, tiny_llama, "--text", short, "--seqlen", 64)
    assert rc == 2 and f"{short} is too short: it has {n} tokens, but one 64-token perplexity window needs 64" in err


# ------------------------------------------------------------------- latq-quantize --calib


def test_quantize_calib_file_recorded_and_used(tiny_llama, tmp_path, capfd):
    """--calib a.txt / b.jsonl: the checkpoint records the file (path and sha256, as latq-eval
    records its --text) as its calibration source, and
    GPTQ calibrated on each text (and on the wiki) ends with different integers somewhere."""
    evals = data.wiki_split()[1]
    txt, _ = write_txt_and_jsonl(tmp_path, evals[:12], "a")
    _, jsonl = write_txt_and_jsonl(tmp_path, evals[12:24], "b")
    opts = ["--method", "gptq", "--group-size", "64", "--nsamples", "2", "--seqlen", "32", "--no-progress"]
    qweights = {}
    for calib in ("wiki", txt, jsonl):
        out = tmp_path / f"ckpt-{getattr(calib, 'suffix', 'wiki')}"
        assert cli.main([str(tiny_llama), str(out), "--calib", str(calib), *opts]) == 0
        qc = json.loads((out / "config.json").read_text())["quantization_config"]
        source = {"source": "wiki", "split": "calibration"} if calib == "wiki" else {
            "path": str(calib), "sha256": hashlib.sha256(calib.read_bytes()).hexdigest()}
        assert qc["calibration"] == {**source, "nsamples": 2, "seqlen": 32, "seed": 0,
                                    "compute_dtype": "bfloat16" if cpu_features.native_bf16() else "float32"}
        ck = Checkpoint(out)
        qweights[calib] = {m: ck.layer_tensors(m)["qweight"] for m in ck.layers()}  # the packed integers
    for a, b in (("wiki", txt), ("wiki", jsonl), (txt, jsonl)):
        assert qweights[a].keys() == qweights[b].keys()
        assert any(not torch.equal(qweights[a][m], qweights[b][m]) for m in qweights[a]), (a, b)
