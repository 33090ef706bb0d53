"""A tied head under the default (no head option): quantized into its own copy only where the checkpoint
with it stays smaller than the source, else kept tied in the model dtype — and every reader (latq-inspect,
latq-eval, latq-serve's check, vLLM on CPU, latq-export) takes the kept-tied checkpoint.

The tiny Llama's vocabulary dominates (49152 × 64 against two small blocks), as Gemma3-270M's does."""
from __future__ import annotations

import json
import logging

import pytest
import torch

from vllm_latq.format.checkpoint import Checkpoint, load_dequantized_model
from vllm_latq.quantize.head_size import copy_and_saving
from vllm_latq.quantize.pipeline import QuantizeOptions, quantize_model
from vllm_latq.testing.tiny_models import TINY_CALIB, make_tiny_model

from tests import vllm_helpers as h


def safetensors_bytes(d) -> int:
    return sum(p.stat().st_size for p in d.glob("*.safetensors"))


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def kept(tmp_path_factory):
    d = tmp_path_factory.mktemp("tied")
    # widths that 64-groups divide: the export maps every layer (hidden 80 would end in a ragged group)
    src = make_tiny_model(d / "src", "llama", hidden_size=64, intermediate_size=128, head_dim=32)
    said, log = Lines(), logging.getLogger("vllm_latq.quantize")
    level = log.level
    log.addHandler(said)
    log.setLevel(logging.INFO)
    try:   # the default: no head option
        out = quantize_model(src, d / "gptq", QuantizeOptions(**TINY_CALIB), progress=False)
    finally:
        log.removeHandler(said)
        log.setLevel(level)
    return {"src": src, "ckpt": out, "said": said.lines, "dir": d}


def test_a_dominating_tied_head_stays_tied_and_the_checkpoint_is_smaller(kept):
    c = kept["ckpt"]
    cfg = json.loads((c / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert cfg["tie_word_embeddings"] is True and "lm_head_quantized" not in qc and "layer_bits" not in qc
    assert "lm_head" in qc["modules_not_converted"] and "lm_head" not in Checkpoint(c).layers()
    assert "lm_head.weight" not in Checkpoint(c).where   # no copy: the embedding serves both
    assert safetensors_bytes(c) < safetensors_bytes(kept["src"])
    decided = [s for s in kept["said"] if "tied output head" in s]
    assert len(decided) == 1 and "stays tied" in decided[0] and "--quantize-lm-head" in decided[0], decided


@pytest.mark.parametrize("model, shapes, keeps", [
    # SmolLM2-135M: 30 blocks, hidden 576, 9/3 heads of 64, intermediate 1536, vocabulary 49152
    ("smollm2-135m", (30, 576, 576, 192, 1536), False),
    # Gemma3-270M: 18 blocks, hidden 640, 4/1 heads of 256, intermediate 2048, vocabulary 262144
    ("gemma3-270m", (18, 640, 1024, 256, 2048), True)])
def test_the_rule_on_the_reference_models_shapes(model, shapes, keeps):
    """SmolLM2's 8-bit copy (28 MiB) is far below what its linears save (148 MiB): it stays; Gemma3's
    (166 MiB) outweighs its linears' 140 MiB: the head stays tied (with the copy: 537.4 MiB against the source's 511.4)."""
    blocks, hidden, q, kv, inter = shapes
    vocab = {"smollm2-135m": 49152, "gemma3-270m": 262144}[model]
    block = {"q": (q, hidden), "k": (kv, hidden), "v": (kv, hidden), "o": (hidden, q), "gate": (inter, hidden),
             "up": (inter, hidden), "down": (hidden, inter)}
    linears = {f"{i}.{n}": s for i in range(blocks) for n, s in block.items()}
    copy, saved = copy_and_saving(linears, (vocab, hidden), 2, QuantizeOptions())
    assert (copy >= saved) == keeps, (copy / 2**20, saved / 2**20)


def test_latq_inspect_reads_it(kept, capsys):
    from vllm_latq.commands.inspect import inspect_main
    assert inspect_main([str(kept["ckpt"])]) == 0
    assert "is a valid latq checkpoint" in capsys.readouterr().out


def test_latq_eval_ties_the_head_to_the_dequantized_embedding(kept):
    from vllm_latq.commands.evaluate import load_for_eval
    m, _, info = load_for_eval(str(kept["ckpt"]))
    emb = m.get_input_embeddings().weight
    assert m.get_output_embeddings().weight is emb   # tied as transformers ties it, not a random head
    from safetensors.torch import load_file
    src = load_file(kept["src"] / "model.safetensors")["model.embed_tokens.weight"].float()
    assert torch.equal(emb.detach(), src) and info["method"] == "gptq"


def test_latq_serve_check_passes_it(kept):
    from vllm_latq.commands.serve import preflight
    assert preflight([str(kept["ckpt"])]) is None


def test_latq_export_keeps_it_tied(kept, tmp_path):
    pytest.importorskip("compressed_tensors")
    from vllm_latq.commands import export
    out = tmp_path / "ex"
    assert export.export_checkpoint(kept["ckpt"], out)["bf16"] == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True and cfg["quantization_config"]["ignore"] == ["lm_head"]
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = load_dequantized_model(kept["ckpt"])(input_ids=ids).logits
        got = export.load_in_transformers(out, dtype=torch.float32)(input_ids=ids).logits
    assert torch.equal(got, want)


def test_vllm_on_cpu_serves_it_as_hf_reads_it(kept):
    ids = h.tokenize(kept["src"])
    res = h.run_vllm_jobs([{"prompt_ids": ids, "max_tokens": 16, "model": kept["ckpt"]}], tmp=kept["dir"])[0]
    assert "error" not in res, res.get("traceback")
    want = load_dequantized_model(kept["ckpt"])
    if res["tokens"] != h.hf_greedy(want, ids, 16):   # bf16 compute may flip near-ties only
        assert max(h.greedy_margins(want, ids, res["tokens"])) < 0.1
