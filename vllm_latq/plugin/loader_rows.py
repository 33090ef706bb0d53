"""Row regroupings that vLLM's model loaders apply to a fused checkpoint matrix (Falcon), and the
models that cannot load latq's tensors (Bloom's fused matrices, OPT's head); docs/ARCHITECTURE.md, "Loading"."""
from __future__ import annotations

import torch


def _falcon_qkv(hf_config, rows: int) -> torch.Tensor:
    heads = hf_config.num_attention_heads
    if hf_config.new_decoder_architecture:
        kv = hf_config.num_kv_heads
    else:
        kv = 1 if hf_config.multi_query else heads
    grouped = torch.arange(rows).view(kv, heads // kv + 2, -1)   # the view vLLM's loader takes
    return torch.cat([grouped[:, :-2].reshape(-1), grouped[:, -2].reshape(-1), grouped[:, -1].reshape(-1)])


# (vLLM model class, layer name) → checkpoint row of each of vLLM's rows (vLLM's registry
# serves RWForCausalLM, the original Falcon checkpoints, with FalconForCausalLM's loader)
REGROUPED = {("FalconForCausalLM", "query_key_value"): _falcon_qkv,
             ("RWForCausalLM", "query_key_value"): _falcon_qkv}
REPACKS_EVERY_TENSOR = {("BloomForCausalLM", "query_key_value"): "BloomModel._repack_qkv"}
# vLLM model classes that build their output head without the quantization config (OPT, Bloom) or build
# none, their logits from the input embedding (Gemma 2): their loader stops at a quantized head's tensors
HEAD_WITHOUT_QUANT_CONFIG = ("OPTForCausalLM", "BloomForCausalLM", "Gemma2ForCausalLM")


def loading_model() -> tuple[str | None, object]:
    """The architecture vLLM is building and its HF config; (None, None) outside a model load."""
    from vllm.config import get_current_vllm_config_or_none
    model_config = getattr(get_current_vllm_config_or_none(), "model_config", None)
    if model_config is None:
        return None, None
    return model_config.architecture, model_config.hf_config


def checkpoint_rows(architecture: str | None, hf_config, prefix: str, rows: int) -> torch.Tensor | None:
    """The checkpoint row that becomes each of vLLM's rows of fused layer ``prefix``; None if unchanged."""
    fn = REGROUPED.get((architecture, prefix.rpartition(".")[2]))
    return None if fn is None else fn(hf_config, rows)


def refusal(architecture: str | None, prefix: str) -> str | None:
    """Why vLLM's loader of ``architecture`` cannot load latq layer ``prefix``, or None."""
    leaf = prefix.rpartition(".")[2]
    where = REPACKS_EVERY_TENSOR.get((architecture, leaf))
    if where is None:
        return None
    return (f"latq: {prefix}: vLLM's {where} reshapes every checkpoint tensor of {leaf} to [heads, 3, -1], "
            "which latq's CSR outliers and Huffman streams are not; a latq checkpoint of this model runs in "
            "transformers (latq-eval) only")


def head_refusal(architecture: str | None) -> str | None:
    """Why vLLM's model of ``architecture`` cannot load a quantized output head, or None."""
    if architecture not in HEAD_WITHOUT_QUANT_CONFIG:
        return None
    return (f"latq: vLLM's {architecture} builds no output head with a quantization config, so it cannot load "
            "this checkpoint's quantized head (quantization_config.lm_head_quantized); quantize with "
            "--no-quantize-lm-head to serve the model with vLLM")


def runs(sources: torch.Tensor) -> list[tuple[int, int]]:
    """Row indices → ``(first row, count)`` blocks of consecutive rows, in the same order."""
    if sources.numel() == 0:
        return []
    breaks = (torch.nonzero(sources[1:] != sources[:-1] + 1).flatten() + 1).tolist()
    starts = [0] + breaks
    ends = breaks + [sources.numel()]
    return [(int(sources[a]), b - a) for a, b in zip(starts, ends)]
