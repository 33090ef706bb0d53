"""Row regroupings that vLLM's model loaders apply to a fused checkpoint matrix.

A few of vLLM's loaders reorder the output rows of a fused ``query_key_value`` tensor
before the layer's weight loader sees it, because the checkpoint interleaves q, k and v
per head group while vLLM's ``QKVParallelLinear`` wants all q rows, then all k, then all v:

- Falcon (``FalconModel.load_weights``) regroups only parameters with an ``output_dim``:
  rows ``[kv group, q heads per group + 2, head_dim]`` → q, k, v. latq's placeholders have
  none, so its tensors arrive as stored and :func:`checkpoint_rows` gives the layer's
  geometry the same order as row sources (packed rows, scales, CSR outliers and decoded
  Huffman rows are all cut by those row blocks: no tensor is reshaped).
- Bloom (``BloomModel._repack_qkv``) reshapes *every* tensor whose name holds
  ``query_key_value`` to ``[heads, 3, -1]`` — also the 1-D CSR row pointers and Huffman
  streams, which have no such shape: :func:`refusal` names it before any tensor is read.
"""
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


def loading_model() -> tuple[str | None, object]:
    """The architecture vLLM is building (its model class's registry name) and its HF config;
    (None, None) for a layer built outside a model load, as in unit tests."""
    from vllm.config import get_current_vllm_config_or_none
    model_config = getattr(get_current_vllm_config_or_none(), "model_config", None)
    if model_config is None:
        return None, None
    return model_config.architecture, model_config.hf_config


def checkpoint_rows(architecture: str | None, hf_config, prefix: str, rows: int) -> torch.Tensor | None:
    """For the fused layer ``prefix`` (``rows`` output rows) of a model vLLM builds as
    ``architecture``: the checkpoint row that becomes each of vLLM's rows, int64 ``[rows]``;
    None when the model's loader keeps the checkpoint's order."""
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


def runs(sources: torch.Tensor) -> list[tuple[int, int]]:
    """Row indices → ``(first row, count)`` blocks of consecutive rows, in the same order."""
    if sources.numel() == 0:
        return []
    breaks = (torch.nonzero(sources[1:] != sources[:-1] + 1).flatten() + 1).tolist()
    starts = [0] + breaks
    ends = breaks + [sources.numel()]
    return [(int(sources[a]), b - a) for a, b in zip(starts, ends)]
