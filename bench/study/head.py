"""The output head's own cost: a configuration that quantizes the head is evaluated a second
time with the same body and the source model's head (the tied embedding, in fp32 like every
evaluation), so the head's perplexity cost is measured on identical blocks rather than
against another run of the base configuration (``ppl_source_head`` in its record)."""
from __future__ import annotations

from pathlib import Path

import torch


def source_head_ppl(ckpt: Path, src: Path, eval_seqlen: int, nwindows: int) -> float:
    """Perplexity of the checkpoint ``ckpt`` (dequantized, fp32) with its head's weight replaced
    by the head of the source model ``src`` (``lm_head.weight``, or the embedding it is tied to)."""
    from safetensors import safe_open

    from vllm_latq import data
    from vllm_latq.commands.evaluate import load_for_eval

    model, tok, _ = load_for_eval(str(ckpt), verify=False)
    weights = {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            weights.update({k: f for k in h.keys() if k.endswith(("lm_head.weight", "embed_tokens.weight"))})
    name = next((k for k in weights if k.endswith("lm_head.weight")), None) or next(iter(weights))
    with safe_open(str(weights[name]), framework="pt") as h, torch.no_grad():
        model.get_output_embeddings().weight.copy_(h.get_tensor(name).float())
    windows = data.eval_windows(tok, seqlen=eval_seqlen, nwindows=nwindows, docs=data.read_documents("wiki", "eval"))
    return data.perplexity(model, windows, progress=False)["ppl"]


def quantizes_head(cfg) -> bool:
    return bool(cfg.kwargs.get("quantize_lm_head"))
