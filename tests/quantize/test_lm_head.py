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

from vllm_latq.format import FormatError
from vllm_latq.format.checkpoint import Checkpoint, load_dequantized_model
from vllm_latq.format.files import STATS_FILE
from vllm_latq.format.validate import format_report, validate_checkpoint
from vllm_latq.quantize.pipeline import QuantizeOptions, quantize_model

from tests import vllm_helpers as h

VOCAB = 49152 + 16   # not a multiple of vLLM's padding (64): the head shard gets 48 zero rows


@pytest.fixture(scope="module")
def tiny_head(tmp_path_factory):
    d = tmp_path_factory.mktemp("lmhead")
    src = h.make_tiny_llama(d / "model", vocab_size=VOCAB)
    seen = {}
    out = quantize_model(src, d / "ssqr", QuantizeOptions(method="ssqr", bits=3, group_size=32, outlier_rate=0.02,
                                                          nsamples=4, seqlen=64, quantize_lm_head=True),
                         progress=False, on_layer=lambda n, W, H, res: seen.__setitem__(n, (W, H, res)))
    seen8 = {}
    out8 = quantize_model(src, d / "ssqr-head8", QuantizeOptions(method="ssqr", bits=3, group_size=32, outlier_rate=0.02,
                                                                 nsamples=4, seqlen=64, quantize_lm_head=True,
                                                                 lm_head_bits=8),
                          progress=False, on_layer=lambda n, W, H, res: seen8.__setitem__(n, (W, H, res)))
    return {"src": src, "ckpt": out, "seen": seen, "dir": d, "ckpt8": out8, "seen8": seen8}


def test_checkpoint_unties_and_stores_quantized_head(tiny_head):
    c = tiny_head["ckpt"]
    cfg = json.loads((c / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert cfg["tie_word_embeddings"] is False
    assert qc["lm_head_quantized"] is True
    assert "lm_head" not in qc["modules_not_converted"] and "model.embed_tokens" in qc["modules_not_converted"]
    ck = Checkpoint(c)
    assert "lm_head" in ck.layers() and "lm_head.weight" not in ck.where
    assert "model.embed_tokens.weight" in ck.where
    stats = {s["name"]: s for s in json.loads((c / STATS_FILE).read_text())["layers"]}
    assert stats["lm_head"]["shape"] == [VOCAB, 64] and stats["lm_head"]["cert"] <= 1 + 1e-6
    # the head was solved on the embedding's weights with a real (non-identity) Hessian
    from safetensors.torch import load_file
    W, H, res = tiny_head["seen"]["lm_head"]
    emb = load_file(tiny_head["src"] / "model.safetensors")["model.embed_tokens.weight"].float()
    assert torch.equal(W.cpu(), emb)
    assert H.shape == (64, 64) and not torch.allclose(H, torch.diag(torch.diagonal(H)))
    # the format's own reader: the dequantized head is the solver's q, the embedding unchanged
    m = load_dequantized_model(c)
    assert torch.equal(m.lm_head.weight.detach(), res.q.float())
    assert torch.equal(m.model.embed_tokens.weight.detach(), emb)
    validate_checkpoint(c)


def test_lm_head_bits_quantizes_only_the_head_wider(tiny_head):
    """``lm_head_bits=8``: the head is solved with 8-bit inliers, every other layer as before;
    ``layer_bits`` in the config tells readers, and the format's reader dequantizes it exactly."""
    c = tiny_head["ckpt8"]
    qc = json.loads((c / "config.json").read_text())["quantization_config"]
    assert qc["bits"] == 3 and qc["layer_bits"] == {"lm_head": 8} and qc["lm_head_quantized"] is True
    seen = tiny_head["seen8"]
    assert seen["lm_head"][2].bits == 8 and {r.bits for n, (_, _, r) in seen.items() if n != "lm_head"} == {3}
    # the same layers as the 3-bit head's run, the head's error far smaller
    def stats(d):
        return {x["name"]: x for x in json.loads((d / STATS_FILE).read_text())["layers"]}
    s3, s8 = stats(tiny_head["ckpt"]), stats(c)
    assert s8["lm_head"]["rel_error"] < s3["lm_head"]["rel_error"] / 10
    assert s8["model.layers.0.mlp.down_proj"] == s3["model.layers.0.mlp.down_proj"]
    m = load_dequantized_model(c)
    assert torch.equal(m.lm_head.weight.detach(), seen["lm_head"][2].q.float())
    report = validate_checkpoint(c)
    assert "lm_head 8-bit" in format_report(report)
    from vllm_latq.kernels.served_report import checkpoint_served   # latq-inspect's served bits count the head
    report["totals"]["served_bits_per_weight"] = checkpoint_served(c, report["layers"])
    assert "bits/weight vs stored" in format_report(report) and "the output head included" in format_report(report)
    # a layer_bits entry naming no quantized layer is refused, naming the file
    import shutil
    bad = tiny_head["dir"] / "bad-layer-bits"
    shutil.copytree(c, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"]["layer_bits"]["model.embed_tokens"] = 8
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FormatError, match=r"config.json.*layer_bits names \['model.embed_tokens'\]"):
        validate_checkpoint(bad)


def test_lm_head_bits_needs_the_head_and_a_dense_method():
    with pytest.raises(ValueError, match="needs quantize_lm_head"):
        QuantizeOptions(quantize_lm_head=False, lm_head_bits=8)
    with pytest.raises(ValueError, match="dense methods"):
        QuantizeOptions(method="hptq", quantize_lm_head=True, lm_head_bits=8)
    with pytest.raises(ValueError, match="2..8"):
        QuantizeOptions(quantize_lm_head=True, lm_head_bits=9)


def test_option_off_keeps_head_unquantized(tiny_head, tmp_path):
    out = quantize_model(tiny_head["src"], tmp_path / "rtn", QuantizeOptions(method="rtn", group_size=32, nsamples=2,
                                                                            seqlen=32, quantize_lm_head=False),
                         progress=False)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True and "lm_head_quantized" not in cfg["quantization_config"]
    assert "lm_head" in cfg["quantization_config"]["modules_not_converted"]
    assert "lm_head" not in Checkpoint(out).layers()


def test_dense_methods_quantize_the_head_with_8_bits_by_default(tmp_path):
    """Without a head option a dense method quantizes the head with ``DEFAULT_LM_HEAD_BITS``-bit
    inliers (the rest at ``bits``) — a tied one too where its copy weighs less than quantizing the
    linears saves (here a 256-word vocabulary), so the checkpoint stays smaller than the source; a
    Huffman method keeps it in the model dtype."""
    from vllm_latq.quantize.options import DEFAULT_LM_HEAD_BITS
    from vllm_latq.testing.tiny_models import make_word_level_model
    assert DEFAULT_LM_HEAD_BITS == 8
    src, calib = make_word_level_model(tmp_path)
    out = quantize_model(src, tmp_path / "rtn", QuantizeOptions(method="rtn", group_size=32, calib=str(calib)),
                         progress=False)
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert cfg["tie_word_embeddings"] is False and qc["lm_head_quantized"] is True
    assert qc["layer_bits"] == {"lm_head": 8} and qc["bits"] == 4
    assert "lm_head" in Checkpoint(out).layers() and "model.embed_tokens" in qc["modules_not_converted"]
    assert safetensors_bytes(out) < safetensors_bytes(src)
    hptq = QuantizeOptions(method="hptq")
    assert hptq.quantize_lm_head is False and hptq.lm_head_bits is None


def safetensors_bytes(d) -> int:
    return sum(p.stat().st_size for p in d.glob("*.safetensors"))


def test_a_head_quantized_by_default_is_kept_where_it_cannot_be(tiny_head, tmp_path, monkeypatch, caplog):
    """A model whose head the pipeline cannot quantize (here: made to refuse) keeps it in the model
    dtype under the default, and says so; asked for explicitly, the same head is an error."""
    from vllm_latq import hf_model
    from vllm_latq.quantize import steps

    def refuse(*a, **k):
        raise hf_model.UnsupportedModelError("the output head is not an nn.Linear; cannot quantize it")
    monkeypatch.setattr(steps, "head_plan", refuse)
    with caplog.at_level("INFO", logger="vllm_latq.quantize"):
        out = quantize_model(tiny_head["src"], tmp_path / "kept", QuantizeOptions(method="rtn", group_size=32),
                             progress=False)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "lm_head_quantized" not in qc and "lm_head" in qc["modules_not_converted"]
    assert "output head stays in the model dtype" in caplog.text
    with pytest.raises(hf_model.UnsupportedModelError):
        quantize_model(tiny_head["src"], tmp_path / "asked", QuantizeOptions(method="rtn", group_size=32,
                                                                             lm_head_bits=8), progress=False)


def test_vllm_quantized_head_equals_hf(tiny_head):
    """vLLM with the reference kernel (fp32): greedy tokens == HF on the dequantized
    checkpoint; the default CPU kernel (bf16 compute) agrees up to near-ties. Both for a head
    with the model's 3 bits and one with ``lm_head_bits=8`` (the CPU kernel's 8-bit path)."""
    ids = h.tokenize(tiny_head["src"])
    jobs = []
    for c in (tiny_head["ckpt"], tiny_head["ckpt8"]):
        job = {"prompt_ids": ids, "max_tokens": 24, "model": c}
        jobs += [{**job, "env": {"LATQ_KERNEL": "reference"}}, {**job, "env": {"LATQ_KERNEL": ""}}]
    res = h.run_vllm_jobs(jobs, tmp=tiny_head["dir"])
    for r in res:
        assert "error" not in r, r.get("traceback")
    loaded = [line for line in res[0]["log"].splitlines() if "linears loaded" in line]   # one per job, in order
    assert len(loaded) == 4, loaded
    for i, (c, widths) in enumerate(((tiny_head["ckpt"], "{3: 9}"), (tiny_head["ckpt8"], "{3: 8, 8: 1}"))):
        ref, cpu = res[2 * i:2 * i + 2]
        want = h.hf_greedy(load_dequantized_model(c), ids, 24)
        assert all(len(set(w)) > 6 for w in want), "the tiny model should not be degenerate"
        assert "latq: 9 linears loaded" in loaded[2 * i] and "'reference': 9" in loaded[2 * i], loaded
        assert "'cpu': 9" in loaded[2 * i + 1] and f"inlier widths {widths}" in loaded[2 * i + 1], loaded
        assert ref["tokens"] == want
        if cpu["tokens"] != want:   # bf16 compute may flip near-ties only
            margins = h.greedy_margins(load_dequantized_model(c), ids, cpu["tokens"])
            assert max(margins) < 0.1, margins
