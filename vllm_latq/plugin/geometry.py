"""Which rows and columns of which checkpoint matrices a vLLM linear holds on this rank (tensor
parallelism), for any linear type vLLM builds."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

from . import loader_rows
from .names import checkpoint_module


@dataclass
class Part:
    """One part of a layer (vLLM's ``shard_id``: q, k, v; gate, up; or the whole): a logical
    matrix as stored in the checkpoint and the rows this rank keeps."""
    name: str                              # checkpoint module name (for messages)
    rows: int                              # rows of the checkpoint matrix
    blocks: list[tuple[int, int]]          # (first source row, row count), in output order


@dataclass
class Geometry:
    parts: dict                            # vLLM's shard id → Part, in output order
    fused: Part | None                     # the same matrix when stored fused (shard id None)
    in_features: int                       # checkpoint columns
    col0: int                              # this rank's first column
    ncols: int                             # this rank's column count
    pad_rows: int | None = None            # lm_head: rows of this rank's padded vocabulary slice


def geometry(layer, hf_names: list[str]) -> Geometry:
    """Which rows/columns of which checkpoint matrices this rank's layer holds."""
    cin = layer.input_size
    col0, ncols = 0, cin
    if isinstance(layer, RowParallelLinear):
        ncols = layer.input_size_per_partition
        col0 = layer.tp_rank * ncols
    module = checkpoint_module(layer.prefix)
    name = hf_names[0] if len(hf_names) == 1 else module
    if isinstance(layer, ParallelLMHead):
        # vocab rows split over ranks; a rank's slice is padded (padding_size) past the real vocab
        if layer.num_added_embeddings:
            raise NotImplementedError(f"latq: {module}: a quantized lm_head with added (LoRA) vocabulary "
                                      "is not supported")
        si = layer.shard_indices
        r0, r1 = si.org_vocab_start_index, si.org_vocab_end_index
        geo = _split([layer.org_vocab_size], [(r0, r1 - r0)], hf_names, name, cin, 0, cin)
        geo.pad_rows = layer.num_embeddings_per_partition
        return geo
    if isinstance(layer, ReplicatedLinear):
        sizes = getattr(layer, "output_sizes", None) or [layer.output_size]
        return _split(sizes, [(0, s) for s in sizes], hf_names, name, cin, col0, ncols)
    if isinstance(layer, QKVParallelLinear):
        r, kr = layer.tp_rank, layer.tp_rank // layer.num_kv_head_replicas
        full = [layer.total_num_heads * layer.head_size, layer.total_num_kv_heads * layer.head_size,
                layer.total_num_kv_heads * layer.v_head_size]
        part = [layer.num_heads * layer.head_size, layer.num_kv_heads * layer.head_size,
                layer.num_kv_heads * layer.v_head_size]
        blocks = [(r * part[0], part[0]), (kr * part[1], part[1]), (kr * part[2], part[2])]
        return _split(full, blocks, hf_names, name, cin, col0, ncols, ids=("q", "k", "v"))
    if isinstance(layer, MergedColumnParallelLinear):
        tp, r = layer.tp_size, layer.tp_rank
        sizes = list(layer.output_sizes)
        return _split(sizes, [(r * (s // tp), s // tp) for s in sizes], hf_names, name, cin, col0, ncols)
    if isinstance(layer, ColumnParallelLinear):
        n = layer.output_size_per_partition
        return _split([layer.output_size], [(layer.tp_rank * n, n)], hf_names, name, cin, col0, ncols)
    if isinstance(layer, RowParallelLinear):
        return _split([layer.output_size], [(0, layer.output_size)], hf_names, name, cin, col0, ncols)
    raise NotImplementedError(f"latq: unsupported linear layer type {type(layer).__name__} ({module})")


def _split(full, blocks, hf_names, name, cin, col0, ncols, ids=None) -> Geometry:
    if len(full) == 1:
        return Geometry({None: Part(name, full[0], [blocks[0]])}, None, cin, col0, ncols)
    ids = ids or tuple(range(len(full)))
    names = hf_names if len(hf_names) == len(full) else [f"{name}[{i}]" for i in ids]
    parts = {i: Part(n, f, [b]) for i, n, f, b in zip(ids, names, full, blocks)}
    offs = [sum(full[:i]) for i in range(len(full))]
    fused = Part(name, sum(full), [(o + s0, n) for o, (s0, n) in zip(offs, blocks)])
    return Geometry(parts, fused, cin, col0, ncols)


def in_loader_order(geo: Geometry, sources: torch.Tensor | None) -> Geometry:
    """``geo`` for a fused matrix the model's loader regroups: checkpoint rows in vLLM's order."""
    if sources is None:
        return geo
    if sources.numel() != geo.fused.rows:
        raise ValueError(f"latq: {geo.fused.name}: a row regrouping of {sources.numel()} rows for "
                         f"{geo.fused.rows} rows")
    blocks = [b for r0, n in geo.fused.blocks for b in loader_rows.runs(sources[r0:r0 + n])]
    return replace(geo, fused=replace(geo.fused, blocks=blocks))

