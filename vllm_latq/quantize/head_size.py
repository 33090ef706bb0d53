"""Whether a tied head quantized by default gets its own copy: only where the checkpoint with the copy
is still smaller than the source. The copy sits beside the embedding the lookup reads, so on a model
whose vocabulary dominates (Gemma3's 262k × 640) it would outweigh what quantizing the linears saves."""
from __future__ import annotations

import logging
import math

import torch

from ..errors import in_units
from ..format.layer import col_dtype, expected_shapes
from .head import HeadPlan
from .options import QuantizeOptions
from .room import linear_shapes
from .source import Source

log = logging.getLogger("vllm_latq.quantize")


def dense_bytes(shape: tuple[int, int], bits: int, opts: QuantizeOptions) -> int:
    """Stored bytes of one dense layer ``[out, in]`` at ``bits`` (outliers counted at their full rate)."""
    shapes = expected_shapes("dense", shape, bits, opts.group_size, coded=opts.scale_bits is not None)
    fixed = sum(math.prod(s) * torch.empty(0, dtype=d).element_size() for s, d in shapes.values() if s is not None)
    if opts.method != "ssqr":   # only SSQR stores outliers
        return fixed
    per_outlier = torch.empty(0, dtype=col_dtype(shape[1])).element_size() + 2   # column and fp16 value
    return fixed + math.ceil(opts.outlier_rate * shape[0] * shape[1]) * per_outlier


def copy_and_saving(linears: dict[str, tuple[int, int]], head: tuple[int, int], itemsize: int,
                    opts: QuantizeOptions) -> tuple[int, int]:
    """(bytes of the head's quantized copy, bytes quantizing ``linears`` saves on ``itemsize``-byte weights)."""
    saved = sum(r * c * itemsize - dense_bytes((r, c), opts.bits, opts) for r, c in linears.values())
    return dense_bytes(head, opts.head_options().bits, opts), saved


def keep_tied(src: Source, plan: HeadPlan, opts: QuantizeOptions) -> bool:
    """Whether the tied head of ``src``, quantized only by default, stays tied: its copy would make the
    checkpoint bigger than the source. Said in one line either way."""
    head = tuple(src.head.weight.shape)
    itemsize = src.weights.handles[src.weights.where[plan.weight]].dtype(plan.weight).itemsize
    copy, saved = copy_and_saving(linear_shapes(src, None), head, itemsize, opts)
    bits = opts.head_options().bits
    if copy < saved:
        log.info("the tied output head is quantized: its %d-bit copy (%s) weighs less than what quantizing the "
                 "linears saves (%s), so the checkpoint stays smaller than the source", bits, in_units(copy),
                 in_units(saved))
        return False
    log.info("the tied output head stays tied in the model dtype: its %d-bit copy (%s) beside the embedding would "
             "outweigh what quantizing the linears saves (%s); --quantize-lm-head unties it anyway", bits,
             in_units(copy), in_units(saved))
    return True
