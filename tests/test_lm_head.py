"""``latq-quantize --quantize-lm-head``: the output head quantized with the same method.

A tiny random Llama with tied embeddings (like SmolLM2 and Gemma3) goes through the real
pipeline with the head quantized: the checkpoint unties (bf16/fp32 embedding kept, the head
stored as ``lm_head.*``, ``tie_word_embeddings: false``), the head's Hessian comes from the
final norm's outputs, and vLLM's ``ParallelLMHead`` runs the latq method — with a vocabulary
that vLLM pads (49168 → 49216 rows), so the padded rows are exercised too."""
from __future__ import annotations

import json

import pytest
import torch

from vllm_latq import checkpoint as ckpt
from vllm_latq.quantize.pipeline import QuantizeOptions, quantize_model

from . import vllm_helpers as h

VOCAB = 49152 + 16   # not a multiple of vLLM's padding (64): the head shard gets 48 zero rows


@pytest.fixture(scope="module")
def tiny_head(tmp_path_factory):
    d = tmp_path_factory.mktemp("lmhead")
    src = h.make_tiny_llama(d / "model", vocab_size=VOCAB)
    seen = {}
    out = quantize_model(src, d / "ssqr", QuantizeOptions(method="ssqr", bits=3, group_size=32, outlier_rate=0.02,
                                                          nsamples=4, seqlen=64, quantize_lm_head=True),
                         progress=False, on_layer=lambda n, W, H, res: seen.__setitem__(n, (W, H, res)))
    return {"src": src, "ckpt": out, "seen": seen, "dir": d}


def test_checkpoint_unties_and_stores_quantized_head(tiny_head):
    c = tiny_head["ckpt"]
    cfg = json.loads((c / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert cfg["tie_word_embeddings"] is False
    assert qc["lm_head_quantized"] is True
    assert "lm_head" not in qc["modules_not_converted"] and "model.embed_tokens" in qc["modules_not_converted"]
    ck = ckpt.Checkpoint(c)
    assert "lm_head" in ck.layers() and "lm_head.weight" not in ck.where
    assert "model.embed_tokens.weight" in ck.where
    stats = {s["name"]: s for s in json.loads((c / ckpt.STATS_FILE).read_text())["layers"]}
    assert stats["lm_head"]["shape"] == [VOCAB, 64] and stats["lm_head"]["cert"] <= 1 + 1e-6
    # the head was solved on the embedding's weights with a real (non-identity) Hessian
    from safetensors.torch import load_file
    W, H, res = tiny_head["seen"]["lm_head"]
    emb = load_file(tiny_head["src"] / "model.safetensors")["model.embed_tokens.weight"].float()
    assert torch.equal(W.cpu(), emb)
    assert H.shape == (64, 64) and not torch.allclose(H, torch.diag(torch.diagonal(H)))
    # the format's own reader: the dequantized head is the solver's q, the embedding unchanged
    m = ckpt.load_dequantized_model(c)
    assert torch.equal(m.lm_head.weight.detach(), res.q.float())
    assert torch.equal(m.model.embed_tokens.weight.detach(), emb)
    ckpt.validate_checkpoint(c)


def test_option_off_keeps_head_unquantized(tiny_head, tmp_path):
    out = quantize_model(tiny_head["src"], tmp_path / "rtn", QuantizeOptions(method="rtn", group_size=32, nsamples=2,
                                                                            seqlen=32), progress=False)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True and "lm_head_quantized" not in cfg["quantization_config"]
    assert "lm_head" in cfg["quantization_config"]["modules_not_converted"]
    assert "lm_head" not in ckpt.Checkpoint(out).layers()


def test_vllm_quantized_head_equals_hf(tiny_head):
    """vLLM with the reference kernel (fp32): greedy tokens == HF on the dequantized
    checkpoint; the default CPU kernel (bf16 compute) agrees up to near-ties."""
    c = tiny_head["ckpt"]
    ids = h.tokenize(tiny_head["src"])
    want = h.hf_greedy(ckpt.load_dequantized_model(c), ids, 24)
    assert all(len(set(w)) > 6 for w in want), "the tiny model should not be degenerate"
    job = {"prompt_ids": ids, "max_tokens": 24, "model": c}
    res = h.run_vllm_jobs([{**job, "env": {"LATQ_KERNEL": "reference"}}, {**job, "env": {"LATQ_KERNEL": ""}}],
                          tmp=tiny_head["dir"])
    for r in res:
        assert "error" not in r, r.get("traceback")
    loaded = [line for line in res[0]["log"].splitlines() if "linears loaded" in line]
    assert "latq: 9 linears loaded" in loaded[0] and "'reference': 9" in loaded[0], loaded
    assert "'cpu': 9" in loaded[1], loaded
    assert res[0]["tokens"] == want
    if res[1]["tokens"] != want:   # bf16 compute may flip near-ties only
        margins = h.greedy_margins(ckpt.load_dequantized_model(c), ids, res[1]["tokens"])
        assert max(margins) < 0.1, margins
