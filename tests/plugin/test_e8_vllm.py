"""An E8 checkpoint (method e8, the codebook form) served by vLLM through the latq plugin: each linear's
runtime form is its codes and group scales, cut per rank on the codebook's 8-column blocks, and its
greedy tokens are HF transformers' on ``latq-eval``'s weights."""
from __future__ import annotations

import pytest
import torch

from tests import vllm_helpers as h
from vllm_latq.format.codebook import DIM
from vllm_latq.kernels.weight import CodebookWeight, dequantize
from vllm_latq.plugin.slicing import merge, pad_rows, slice_codebook


def _codebook_tensors(n=32, k=64, bits=3, group=16, seed=0):
    from vllm_latq.format import codebook as cb
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k // DIM, cb.CODEBOOKS[bits].index_bytes), generator=g, dtype=torch.uint8)
    return {"codes": codes, "scales": (torch.rand(n, k // group, generator=g) + 0.5).half()}


def test_a_rank_cuts_whole_blocks_and_groups_split_off_their_boundary():
    t = _codebook_tensors()
    full = dequantize(CodebookWeight(t["codes"], t["scales"], 3, 16, 64))
    got = slice_codebook(t, 3, 16, [(0, 8), (20, 12)], 24, 40)     # columns [24, 64): groups split to 8
    want = torch.cat([full[0:8, 24:64], full[20:32, 24:64]])
    assert got.group_size == 8 and got.in_features == 40 and torch.equal(dequantize(got), want)
    with pytest.raises(ValueError, match=r"columns \[4, 36\) cut the codebook's 8-column blocks"):
        slice_codebook(t, 3, 16, [(0, 32)], 4, 32)
    both = merge([slice_codebook(t, 3, 16, [(0, 16)], 0, 64), slice_codebook(t, 3, 16, [(16, 16)], 0, 64)])
    assert torch.equal(dequantize(both), full)
    padded = dequantize(pad_rows(both, 40))
    assert torch.equal(padded[:32], full) and not padded[32:].any()


@pytest.fixture(scope="module")
def e8_tiny(tmp_path_factory):
    """make_tiny_llama quantized by the pipeline with method e8 (3 bits, coded scales per 32 columns)."""
    from vllm_latq.quantize.pipeline import QuantizeOptions, quantize_model
    d = tmp_path_factory.mktemp("e8")
    src = h.make_tiny_llama(d / "model")
    ck = quantize_model(src, d / "e8", QuantizeOptions(method="e8", bits=3, group_size=32, scale_bits=4, nsamples=4,
                                                       seqlen=64, rotate="hadamard"), progress=False)
    return d, ck


def test_vllm_serves_an_e8_checkpoint(e8_tiny):
    """The fp32 dequantize-once kernel (exact): greedy 32 tokens == HF on the dequantized weights; the
    kernel chosen by default (its codebook kernel on CPU, or the bf16 fallback) greedy up to near-ties."""
    d, ck = e8_tiny
    log = _serve_exact_and_default(ck, d, 32)
    assert "linears loaded (e8 checkpoint" in log


@pytest.mark.slow
def test_vllm_serves_it_with_int8_activations_when_forced(e8_tiny):
    """``LATQ_KERNEL=cpu-e8-a8`` through vLLM: every layer on the opt-in kernel, greedy tokens HF's on the
    dequantized weights with each quantized linear's input rounded as the kernel rounds it, up to near-ties."""
    from bench.e8_a8_accuracy import round_inputs
    from vllm_latq.format.checkpoint import Checkpoint, load_dequantized_model
    from vllm_latq.kernels.cpu.codebook import CPUCodebookA8Kernel
    if CPUCodebookA8Kernel.unavailable_here():
        pytest.skip(f"cpu-e8-a8 {CPUCodebookA8Kernel.unavailable_here()}")
    d, ck = e8_tiny
    ids = h.tokenize(ck)
    hf = load_dequantized_model(ck)
    round_inputs(hf, Checkpoint(ck))
    want = h.hf_greedy(hf, ids, 16)
    (r,) = h.run_vllm_jobs([{"model": ck, "prompt_ids": ids, "max_tokens": 16, "env": {"LATQ_KERNEL": "cpu-e8-a8"}}],
                           tmp=d)
    assert "error" not in r, r.get("traceback")
    assert "cpu-e8-a8" in r["log"]
    if r["tokens"] != want:
        assert max(h.greedy_margins(hf, ids, r["tokens"])) < 0.1


def _serve_exact_and_default(ck, tmp, n: int) -> str:
    """Greedy ``n`` tokens of ``ck`` through vLLM: with the exact kernel HF's on the dequantized
    weights, with the default kernel up to near-ties → the exact run's log."""
    from vllm_latq.format.checkpoint import load_dequantized_model
    ids = h.tokenize(ck)
    hf = load_dequantized_model(ck)
    want = h.hf_greedy(hf, ids, n)
    jobs = [{"model": ck, "prompt_ids": ids, "max_tokens": n, "env": {"LATQ_KERNEL": k}} for k in ("dequant", "")]
    exact, default = h.run_vllm_jobs(jobs, tmp=tmp)
    for r in (exact, default):
        assert "error" not in r, r.get("traceback")
    assert exact["tokens"] == want
    if default["tokens"] != want:
        assert max(h.greedy_margins(hf, ids, default["tokens"])) < 0.1
    return exact["log"]


@pytest.mark.slow
def test_vllm_serves_it_on_two_ranks(tmp_path):
    """Tensor-parallel size 2: each rank cuts its rows (q/k/v, gate/up) or its columns (o, down) on
    whole blocks of the codebook and of the rotation; greedy tokens as on one rank, up to near-ties."""
    from vllm_latq.format.checkpoint import load_dequantized_model
    from vllm_latq.quantize.pipeline import QuantizeOptions, quantize_model
    # o and down take 512 columns, 256 a rank: whole blocks of the rotation (256 columns at most)
    src = h.make_tiny_llama(tmp_path / "model", heads=16, kv_heads=2, intermediate=512)
    ck = quantize_model(src, tmp_path / "e8", QuantizeOptions(method="e8", bits=3, group_size=16, scale_bits=4,
                                                              nsamples=4, seqlen=64, rotate="hadamard"),
                        progress=False)
    ids = h.tokenize(ck)
    hf = load_dequantized_model(ck)
    res = h.run_vllm_jobs([{"model": ck, "prompt_ids": ids, "max_tokens": 16, "env": {"LATQ_KERNEL": "dequant"}}],
                          tp=2, tmp=tmp_path)[0]
    assert "error" not in res, res.get("traceback")
    want = h.hf_greedy(hf, ids, 16)
    if res["tokens"] != want:
        assert max(h.greedy_margins(hf, ids, res["tokens"])) < 0.1


@pytest.mark.slow
def test_vllm_serves_e8_experts(tmp_path):
    """A tiny Qwen3-MoE quantized with method e8, experts included: vLLM's MoE kernels refuse the
    form, latq's serve each expert with its codebook kernel. The exact kernel's greedy tokens are HF's
    on the dequantized weights; the default kernel's up to near-ties; at TP 2 (each rank half of every
    expert's rows of gate and up and columns of down, whole rotation blocks) as on one rank."""
    from vllm_latq.format.checkpoint import load_dequantized_model
    from vllm_latq.quantize.pipeline import QuantizeOptions, quantize_model
    from vllm_latq.testing.moe_models import make_moe_model
    # o and down take 512 columns, 256 a rank: whole blocks of the rotation (256 columns at most)
    src = make_moe_model(tmp_path / "src", "qwen3_moe", head_dim=256, moe_intermediate_size=512)
    ck = quantize_model(src, tmp_path / "e8", QuantizeOptions(method="e8", bits=3, group_size=16, scale_bits=4,
                                                              nsamples=4, seqlen=64, rotate="hadamard"),
                        progress=False)
    assert "refused by vllm: experts: the codebook form" in _serve_exact_and_default(ck, tmp_path, 16)
    ids = h.tokenize(ck)
    hf = load_dequantized_model(ck)
    two = h.run_vllm_jobs([{"model": ck, "prompt_ids": ids, "max_tokens": 16, "env": {"LATQ_KERNEL": "dequant"}}],
                          tp=2, tmp=tmp_path, timeout=1800)[0]
    assert "error" not in two, two.get("traceback")
    if two["tokens"] != h.hf_greedy(hf, ids, 16):
        assert max(h.greedy_margins(hf, ids, two["tokens"])) < 0.1
