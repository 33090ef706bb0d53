"""Served bits/weight of a checkpoint's layers per kernel family, for ``latq-inspect``: what one
decode step streams in each family's prepared form, from ``layout_bytes`` without preparing
(HPTQ at the width the transcode picks; a layer no kernel lays out as the bf16 fallback; CPU
figures for this host's build)."""
from __future__ import annotations

import os

import torch

from .. import format as fmt
from ..format.checkpoint import Checkpoint
from .selector import families
from .served_bytes import FALLBACK_BYTES, GridStats, choose_width
from .weight import from_dense_tensors


def layer_served(t: dict[str, torch.Tensor], kind: str, shape, bits: int, group: int, fams,
                 rotation_block: int = 0) -> dict[str, dict]:
    """One checkpoint layer's tensors → {family: {"bits", "kernel", "bytes", "bits_per_weight"}};
    ``rotation_block``: a rotated layer's block, whose fp32 signs a compressed kernel reads too (0: the
    signs are counted with another layer of that block, the model's layers sharing one vector)."""
    n, k = shape
    scale_bits = None
    if kind == "dense":
        w = from_dense_tensors(t, bits, group, k)
        stats = GridStats.from_weight(w)
        scale_bits = None if w.coded is None else w.coded.bits
    else:
        z = fmt.decode_integers(t, "huffman", tuple(shape), None)
        stats = GridStats.from_integers(z, t["hscale"].float().expand(n))
        group = k
    out = {}
    for fam in fams:
        b = bits if kind == "dense" else choose_width(n, k, stats, fam)
        try:
            parts, kernel = fam.layout_bytes(n, k, b, group, stats, scale_bits), fam.name
        except ValueError:
            parts, kernel = {"weights": FALLBACK_BYTES * n * k}, "bf16"   # it folds a rotation into them
        if rotation_block and kernel != "bf16":
            parts = {**parts, "rotation": 4 * rotation_block}
        total = sum(parts.values())
        out[fam.name] = {"bits": b, "kernel": kernel, "bytes": total, "parts": parts,
                         "bits_per_weight": 8 * total / (n * k)}
    return out


def checkpoint_served(path: str | os.PathLike, rows: list[dict]) -> dict[str, float]:
    """Adds ``served`` (:func:`layer_served`) to each layer row of a
    :func:`~vllm_latq.format.validate.validate_checkpoint` report; returns each family's
    served bits/weight over all those layers."""
    ck = Checkpoint(path)
    spec, fams = ck.spec, families()
    blocks = set()   # the signs of a block size: one vector for the model, counted with its first layer
    for r in rows:
        t = ck.layer_tensors(r["name"])
        block = spec.rotation.block_size(r["shape"][1]) if spec.rotation is not None else 0
        first = block not in blocks
        blocks.add(block)
        r["served"] = layer_served(t, spec.kind, r["shape"], spec.bits_of(r["name"]), spec.group_size, fams,
                                   block if first else 0)
    weights = sum(r["shape"][0] * r["shape"][1] for r in rows)
    return {f.name: 8 * sum(r["served"][f.name]["bytes"] for r in rows) / weights if weights else 0.0
            for f in fams}
