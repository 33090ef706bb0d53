"""Served bits/weight of a study configuration: the bytes one decode step streams for
its quantized linears in each kernel family's prepared form (CPU, Triton), the cost a user buys.

Computed from the layers the run produced with the kernels' own cost models
(:func:`vllm_latq.kernels.served_report.checkpoint_served`: ``layout_bytes`` on each layer's integer
statistics, HPTQ/HRTN layers at the width :func:`~vllm_latq.kernels.transcode.transcode` gives
them for that family; a codebook layer by its family's codebook kernel, ``codebook_bytes``). A dense
layout without outliers (RTN, GPTQ, llm-compressor's GPTQ) and a codebook layout (E8) stream bytes
set by their shapes, bits, group size and scale coding alone, so their served bits are computed
exactly from the model's linear shapes (:func:`outlier_free_served`), without a checkpoint: the
results of runs that kept none get theirs that way; the others are re-quantized
(``runner.backfill_served``). A codebook result that a family serves only by the bf16 fallback (no
codebook kernel there) has no served figure in it (:func:`served_bits`).
"""
from __future__ import annotations

import copy
import functools
import hashlib
from collections import Counter
from pathlib import Path

import torch

from vllm_latq import format as fmt
from vllm_latq.format.checkpoint import Checkpoint
from vllm_latq.kernels.selector import family_member, family_name
from vllm_latq.kernels.served_bytes import GridStats
from vllm_latq.kernels.served_report import add_rotation_signs, checkpoint_served, families, layer_served
from vllm_latq.kernels.weight import CodebookWeight

# layers whose served bytes fingerprint the kernels' cost models: ragged and round widths, every
# width the runtime form takes, integers spread past the narrow grids (outliers at 2–5 bits)
_PROBE_SHAPES = ((64, 576), (48, 640), (32, 2048))
_PROBE_GROUPS = (32, 128, None)   # None: one group per row (HPTQ)
_PROBE_CODEBOOK = ((2, 3, 4), (16, 64, 128))   # a codebook layer's code bits and group sizes (whole blocks)
CODEBOOK = "codebook"   # the cost-model part of a family's codebook kernel: ``triton+codebook``


@functools.lru_cache(maxsize=None)
def cost_model_fingerprints() -> dict[str, str]:
    """A digest per cost model — each kernel family's, its coded-scale form's (``cpu+coded``) and its
    codebook kernel's (``cpu+codebook``: which kernel, or none) — of its served bytes on fixed probe
    layers: a served record made under other cost models than the ones it depends on (a kernel's
    layout changed since, a codebook kernel arrived) is stale (:func:`is_stale`)."""
    out = {}
    for fam in families():
        out[_part(fam.name, CODEBOOK)] = _codebook_fingerprint(fam)
        for sb in (None, 4):   # fp16 and coded group scales
            lines = []
            for n, k in _PROBE_SHAPES:
                z = (torch.arange(n * k).reshape(n, k) * 7919 % 61 - 30).to(torch.int32)   # spread over ±30
                stats = GridStats.from_integers(z, torch.ones(n))
                for b in range(2, 9):
                    for g in _PROBE_GROUPS if sb is None else [g for g in _PROBE_GROUPS if g]:
                        try:
                            cost = sorted(fam.layout_bytes(n, k, b, g or k, stats, sb).items())
                        except ValueError:
                            cost = "-"
                        lines.append(f"{n}x{k}:{b}:{g}:{cost}")
            out[_part(fam.name, sb)] = hashlib.sha1("\n".join(lines).encode()).hexdigest()[:12]
    return out


def _codebook_fingerprint(fam) -> str:
    """The digest of ``fam``'s codebook kernel: its name and ``codebook_bytes`` on the probe layers
    (``none``: the family has none, its codebook layers are served by the bf16 fallback)."""
    member = family_member(family_name(fam), CodebookWeight)
    if member is None:
        return "none"
    lines = [member.name]
    for n, k in _PROBE_SHAPES:
        for b in _PROBE_CODEBOOK[0]:
            for g in _PROBE_CODEBOOK[1]:
                for sb in (None, 4):
                    try:
                        cost = sorted(member.codebook_bytes(n, k, b, g, sb).items())
                    except ValueError:
                        cost = "-"
                    lines.append(f"{n}x{k}:{b}:{g}:{sb}:{cost}")
    return hashlib.sha1("\n".join(lines).encode()).hexdigest()[:12]


def _part(family: str, form: int | str | None) -> str:
    """A cost model's name: the family's (``form`` None), its coded-scale form's (scale bits) or its
    codebook kernel's (:data:`CODEBOOK`)."""
    return family if form is None else f"{family}+{CODEBOOK if form == CODEBOOK else 'coded'}"


def is_codebook(r: dict) -> bool:
    """Whether a result's layers are of the codebook kind (method e8)."""
    method = r.get("options", {}).get("method")
    return method in fmt.METHODS and fmt.kind_of(method) == "codebook"


def is_stale(r: dict) -> bool:
    """Whether a result's served record was computed under other cost models than today's, of
    those it depends on (its families; their coded-scale forms if its scales are coded; their
    codebook kernels if it is a codebook result)."""
    if "served" not in r:
        return False
    made, now = r["served"].get("cost_model"), cost_model_fingerprints()
    form = CODEBOOK if is_codebook(r) else r.get("options", {}).get("scale_bits")
    if r.get("options", {}).get("rotate", "none") != "none" and r["served"].get("signs") != "shared":
        return True   # made when every layer counted its own copy of the signs
    return not isinstance(made, dict) or any(made.get(_part(f, form)) != now.get(_part(f, form))
                                             for f in r["served"]["bits_per_weight"])


def _record(totals: dict[str, float], rows: list[dict], source: str) -> dict:
    """The result's ``served`` entry: bits/weight per family, and per family how many layers each
    kernel serves at each inlier width (``"cpu 4b": 122``), under today's cost models."""
    kernels = {f: dict(Counter(f"{r['served'][f]['kernel']} {r['served'][f]['bits']}b" for r in rows))
               for f in totals}
    # "signs": a rotation's signs counted once per block size, as the kernels read them
    return {"bits_per_weight": totals, "kernels": kernels, "source": source, "cost_model": cost_model_fingerprints(),
            "signs": "shared"}


def checkpoint_record(ck: Path) -> dict:
    """A latq checkpoint's served record, over the layers its stats list (those its stored bits count)."""
    rows = [{"name": r["name"], "shape": r["shape"]} for r in Checkpoint(ck).stats()["layers"]]
    return _record(checkpoint_served(ck, rows), rows, "checkpoint")


def linear_shapes(src: Path) -> list[tuple[int, int]]:
    """``(out, in)`` of every linear of the decoder blocks of the HF model at ``src`` (what the
    pipeline quantizes unless the head is quantized too), from its config on the meta device."""
    from vllm_latq import hf_model
    m = hf_model.empty_model(hf_model.hf_config(hf_model.config_dict(Path(src))))
    prefix, layers = hf_model.decoder_layers(m)
    return [(lin.out_features, lin.in_features) for i, block in enumerate(layers)
            for lin in hf_model.block_linears(block, f"{prefix}.{i}").values()]


def _outlier_free_tensors(kind: str, n: int, k: int, bits: int, group: int,
                          scale_bits: int | None) -> dict[str, torch.Tensor]:
    """A ``kind`` layer's checkpoint tensors with no outliers (zero integers or codes: the bytes a
    kernel streams do not depend on their values), its scales coded with ``scale_bits``."""
    scales = torch.ones(n, -(-k // group))
    scale_tensors = ({"scales": scales.half()} if scale_bits is None else
                     fmt.scale_codes.to_tensors(fmt.scale_codes.code_scales(scales, scale_bits)))
    if kind == "codebook":
        return {"codes": torch.zeros(n, k // fmt.codebook.DIM, fmt.codebook.CODEBOOKS[bits].index_bytes,
                                     dtype=torch.uint8), **scale_tensors}
    return {"qweight": fmt.pack(torch.zeros(n, k, dtype=torch.int32), bits), **scale_tensors,
            "outlier_crow": torch.zeros(n + 1, dtype=torch.int32),
            "outlier_col": torch.zeros(0, dtype=torch.int32), "outlier_val": torch.zeros(0, dtype=torch.float16)}


def outlier_free_served(shapes, bits: int, group: int, scale_bits: int | None = None, rotated: bool = False,
                        kind: str = "dense") -> dict:
    """The served record of a layout without outliers — ``kind`` dense (RTN, GPTQ) or codebook (E8,
    ``bits`` its code's) — at ``bits`` and ``group`` (scales coded with ``scale_bits``; ``rotated``:
    ``--rotate hadamard``, whose signs are one vector per block size) over layers of ``shapes`` (each
    ``(out, in)``): exact, as its bytes depend on nothing else."""
    return copy.deepcopy(_outlier_free_served(tuple(map(tuple, shapes)), bits, group, scale_bits, rotated, kind))


@functools.lru_cache(maxsize=None)
def _outlier_free_served(shapes: tuple, bits: int, group: int, scale_bits: int | None, rotated: bool,
                         kind: str) -> dict:
    fams = families()
    per_shape = {s: layer_served(_outlier_free_tensors(kind, *s, bits, group, scale_bits), kind, s, bits, group, fams)
                 for s in set(map(tuple, shapes))}
    rows = [{"shape": s, "served": copy.deepcopy(per_shape[tuple(s)])} for s in shapes]
    if rotated:   # the signs depend on the blocks only, not on the seed
        add_rotation_signs(rows, fams, fmt.Rotation(0))
    weights = sum(n * k for n, k in shapes)
    totals = {f.name: 8 * sum(r["served"][f.name]["bytes"] for r in rows) / weights for f in fams}
    return _record(totals, rows, "layout")


def is_outlier_free(r: dict) -> bool:
    """Whether a result is a layout without outliers over the decoder blocks' linears only (RTN,
    GPTQ, llm-compressor's GPTQ, rotated or not; E8 codebooks; not a variant that quantizes the
    head too)."""
    o = r.get("options", {})
    return (o.get("method") in ("rtn", "gptq") or is_codebook(r)) and not o.get("quantize_lm_head")


def fallback_only(r: dict, family: str) -> bool:
    """Whether ``family`` serves every layer of codebook result ``r`` by the bf16 fallback: it has
    no codebook kernel (when the record was made), so dequantized bf16 is all it streams."""
    kernels = ((r.get("served") or {}).get("kernels") or {}).get(family)
    return is_codebook(r) and bool(kernels) and all(k.split()[0] == "bf16" for k in kernels)


def served_bits(r: dict, family: str) -> float | None:
    """A result's served bits/weight in ``family`` (bf16: its 16 bits, the dequantized kernel's;
    None where it was not computed, or where the family has no kernel for a codebook result
    (:func:`fallback_only`): a stopgap's 16 bits are no operating point of the method)."""
    if r["family"] == "bf16":
        return r["bits"]
    if fallback_only(r, family):
        return None
    return (r.get("served") or {}).get("bits_per_weight", {}).get(family)
