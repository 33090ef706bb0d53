"""CUDA-graph facts the kernels decide by, in one place: whether a graph is being captured, and
whether a batch may be one vLLM captures (its warm-up must take the capture's path)."""
from __future__ import annotations

import sys

import torch

# vLLM's largest CUDA-graph batch (its default capture sizes end at 512 tokens); the plugin
# sets it from the engine's compilation config, 0 when graphs are off (enforce_eager)
GRAPH_TOKENS = 512


def graph_device(device) -> bool:
    """Whether calls on ``device`` can be captured into a CUDA graph."""
    return torch.device(device).type == "cuda"


def capturing(device) -> bool:
    """A CUDA graph is being captured on ``device``'s current stream."""
    return graph_device(device) and torch.cuda.is_current_stream_capturing()


def may_be_captured(device, tokens: int) -> bool:
    """A call of ``tokens`` rows on ``device`` is being captured, or is one vLLM may capture
    (its warm-up runs eagerly at every capture size first)."""
    return capturing(device) or (graph_device(device) and tokens <= GRAPH_TOKENS)


def concurrent_streams() -> list:
    """Streams on which vLLM runs layers concurrently with the forward (``aux_stream()``: MoE shared
    experts), once created; every other stream it forwards on is ordered with the forward. Read
    without importing vLLM."""
    mod = sys.modules.get("vllm.utils.torch_utils")
    aux = getattr(mod, "_aux_stream", None) if mod is not None else None
    return [aux] if aux is not None else []
