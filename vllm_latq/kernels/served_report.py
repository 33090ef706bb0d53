"""Served bits/weight of a checkpoint's layers per kernel family, for ``latq-inspect``: what one
decode step streams in each family's prepared form, from ``layout_bytes`` without preparing
(HPTQ at the width the transcode picks; a layer no kernel lays out as the bf16 fallback; CPU
figures for this host's build)."""
from __future__ import annotations

import os

import torch

from .. import format as fmt
from ..format.checkpoint import Checkpoint
from ..progress import step
from .selector import families, family_member, family_name
from .served_bytes import FALLBACK_BYTES, GridStats, choose_width
from .weight import CodebookWeight, from_dense_tensors


def layer_served(t: dict[str, torch.Tensor], kind: str, shape, bits: int, group: int, fams) -> dict[str, dict]:
    """One checkpoint layer's tensors → {family: {"bits", "kernel", "bytes", "bits_per_weight"}}."""
    n, k = shape
    scale_bits = None
    if kind == "codebook":
        return _codebook_served(t, n, k, bits, group, fams)
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
            out[fam.name] = _served(b, fam.name, fam.layout_bytes(n, k, b, group, stats, scale_bits), n * k)
        except ValueError:
            out[fam.name] = _fallback(b, n * k)
    return out


def _served(bits: int, kernel: str, parts: dict[str, int], weights: int) -> dict:
    total = sum(parts.values())
    return {"bits": bits, "kernel": kernel, "bytes": total, "parts": parts, "bits_per_weight": 8 * total / weights}


def _fallback(bits: int, weights: int, why: str | None = None) -> dict:
    """The bf16 dequantize-once kernel's record (it folds a rotation into its weights); ``why``: the
    kernel that refused the layer and its reason, which the report prints."""
    return {**_served(bits, "bf16", {"weights": FALLBACK_BYTES * weights}, weights), **({"why": why} if why else {})}


def _codebook_served(t, n: int, k: int, bits: int, group: int, fams) -> dict[str, dict]:
    """A codebook layer in each family: its kernel for the form's ``codebook_bytes``, or the bf16
    fallback (where the family has none, or its kernel refuses any layout the format allows)."""
    scale_bits = fmt.scale_codes.from_tensors(t, n).bits if fmt.has_coded_scales(t) else None
    out = {}
    for fam in fams:
        member = family_member(family_name(fam), CodebookWeight)
        if member is None:
            out[fam.name] = _fallback(bits, n * k)
            continue
        try:
            out[fam.name] = _served(bits, member.name, member.codebook_bytes(n, k, bits, group, scale_bits), n * k)
        except ValueError as e:
            out[fam.name] = _fallback(bits, n * k, f"not served by {member.name}: {e}")
    return out


def add_rotation_signs(rows: list[dict], fams, rotation) -> None:
    """Adds a rotated model's signs to its served rows (each ``{"shape", "served"}``): in each family,
    the fp32 vector of a block size counted once, with the first layer of that block whose kernel
    reads it (the bf16 fallback folds R into its weights; every other layer shares the vector)."""
    for fam in fams:
        counted = set()
        for r in rows:
            f, (n, k) = r["served"][fam.name], r["shape"]
            b = rotation.block_size(k)
            if f["kernel"] != "bf16" and b not in counted:
                counted.add(b)
                f["parts"] = {**f["parts"], "rotation": 4 * b}
                f["bytes"] += 4 * b
                f["bits_per_weight"] = 8 * f["bytes"] / (n * k)


def checkpoint_served(path: "str | os.PathLike | Checkpoint", rows: list[dict], progress: bool = False
                      ) -> dict[str, float]:
    """Adds ``served`` (:func:`layer_served`) to each layer row of a
    :func:`~vllm_latq.format.validate.validate_checkpoint` report (``path``: its ``checkpoint``, to
    read what it verified); returns each family's served bits/weight over all those layers."""
    ck = path if isinstance(path, Checkpoint) else Checkpoint(path)
    spec, fams = ck.spec, families()
    with step(f"served bits of {ck.path} per kernel family", progress, total=len(rows), unit="layer") as advance:
        for r in rows:
            t = ck.layer_tensors(r["name"])
            r["served"] = layer_served(t, spec.kind, r["shape"], spec.bits_of(r["name"]), spec.group_size, fams)
            advance(1)
    if spec.rotation is not None:
        add_rotation_signs(rows, fams, spec.rotation)
    weights = sum(r["shape"][0] * r["shape"][1] for r in rows)
    return {f.name: 8 * sum(r["served"][f.name]["bytes"] for r in rows) / weights if weights else 0.0
            for f in fams}
