"""CUDA-graph facts the kernels decide by, asked in one place: whether a graph is being
captured now, and whether a call of a given batch may be one that vLLM captures (its
eager warm-up at a capture size must take the path the capture will take, or the capture
meets kernels, scratch and host reads the warm-up never prepared)."""
from __future__ import annotations

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
