"""CUDA-graph facts the kernels decide by, asked in one place: whether a graph is being
captured now, and whether a call of a given batch may be one that vLLM captures (its
eager warm-up at a capture size must take the path the capture will take, or the capture
meets kernels, scratch and host reads the warm-up never prepared)."""
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
    """Streams on which vLLM runs model layers concurrently with the forward's own stream: the
    one ``vllm.utils.torch_utils.aux_stream()`` makes (MoE shared experts, and the few models
    that overlap other work), once some layer has created it. Every other stream vLLM runs a
    forward on (the default one, each CUDA-graph capture stream, the memory profiler's) is
    ordered with the forward. Read without importing vLLM or creating the stream."""
    mod = sys.modules.get("vllm.utils.torch_utils")
    aux = getattr(mod, "_aux_stream", None) if mod is not None else None
    return [aux] if aux is not None else []
