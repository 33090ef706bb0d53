"""The tensors of one quantized linear ``P`` (an ``[out, in]`` weight) of either kind, dense or
huffman: encode a solver's result, decode, dequantize, expected shapes, validation, stored
size. The tensors, their dtypes and shapes: docs/FORMAT.md."""
from __future__ import annotations

import math

import numpy as np
import torch

from . import codebook, huffman, scale_codes
from .csr import csr_rows
from ..errors import FormatError
from .packing import pack, packed_words, unpack, unpack_at

DENSE_TENSORS = ("qweight", "scales", "outlier_crow", "outlier_col", "outlier_val")
HUFFMAN_TENSORS = ("hscale", "hsymbols", "hlengths", "hstream", "hchunk_bits")
CODEBOOK_TENSORS = ("codes", "scales")
LAYER_TENSORS = {"dense": DENSE_TENSORS, "huffman": HUFFMAN_TENSORS, "codebook": CODEBOOK_TENSORS}
ALL_TENSORS = DENSE_TENSORS + scale_codes.TENSORS + HUFFMAN_TENSORS + CODEBOOK_TENSORS[:1]


def layer_tensors(kind: str, coded: bool) -> tuple[str, ...]:
    """A layer's tensor suffixes: its kind's, a dense or codebook layer's fp16 scales replaced by their
    codes where ``coded`` (scale_codes.py)."""
    names = LAYER_TENSORS[kind]
    if not coded or "scales" not in names:
        return names
    at = names.index("scales")
    return names[:at] + scale_codes.TENSORS + names[at + 1:]


def dense_tensors(coded: bool) -> tuple[str, ...]:
    """A dense layer's tensor suffixes: with fp16 scales or with coded ones (scale_codes.py)."""
    return layer_tensors("dense", coded)


def has_coded_scales(t: dict) -> bool:
    return "scale_codes" in t


def dense_scales(t: dict[str, torch.Tensor], out: int) -> torch.Tensor:
    """fp16 ``[out, G]`` group scales of a dense or codebook layer, stored or decoded from their codes."""
    if has_coded_scales(t):
        return scale_codes.from_tensors(t, out).decode().half()
    return t["scales"]


def col_dtype(in_features: int) -> torch.dtype:
    """The stored dtype of ``outlier_col``."""
    return torch.int16 if in_features <= 32767 else torch.int32


_TENSOR_DTYPES = {"qweight": torch.int32, "scales": torch.float16, "scale_codes": torch.uint8,
                  "scale_min": torch.float16, "scale_step": torch.float16, "outlier_crow": torch.int32,
                  "outlier_val": torch.float16, "hscale": torch.float32, "hsymbols": torch.int32,
                  "hlengths": torch.uint8, "hstream": torch.uint8, "hchunk_bits": torch.int16, "codes": torch.uint8}


def tensor_dtype(suffix: str, in_features: int) -> torch.dtype:
    """The stored dtype of a layer tensor (``"qweight"``, ``"hstream"``, ...)."""
    return col_dtype(in_features) if suffix == "outlier_col" else _TENSOR_DTYPES[suffix]


# ----------------------------------------------------------------------------- encode / decode

def encode_layer(result, kind: str) -> dict[str, torch.Tensor]:
    """A solver's :class:`~vllm_latq.algorithms.result.QuantResult` → the layer's tensors
    (suffixes only, e.g. ``"qweight"``), on the device of ``result.z`` (the Huffman codec is
    numpy: its tensors are made on the CPU and moved there; a codebook layer's: of ``result.codes``)."""
    if kind == "codebook":
        return {"codes": result.codes.contiguous(), **_scale_tensors(result)}
    dev = result.z.device
    if kind == "dense":
        out, cin = result.z.shape
        o = result.outliers
        crow = torch.zeros(out + 1, dtype=torch.int32, device=dev) if o is None else o.crow
        col = torch.zeros(0, dtype=torch.int32, device=dev) if o is None else o.col
        val = torch.zeros(0, dtype=torch.float16, device=dev) if o is None else o.val
        return {"qweight": pack(result.z, result.bits), **_scale_tensors(result),
                "outlier_crow": crow.to(torch.int32).contiguous(),
                "outlier_col": col.to(col_dtype(cin)).contiguous(),
                "outlier_val": val.half().contiguous()}
    s = huffman.encode(result.z)
    return {"hscale": result.scales.float().reshape(1).to(dev),
            "hsymbols": torch.from_numpy(np.asarray(s.code.symbols, np.int32).copy()).to(dev),
            "hlengths": torch.from_numpy(np.asarray(s.code.lengths, np.uint8).copy()).to(dev),
            "hstream": torch.from_numpy(np.asarray(s.data, np.uint8).copy()).to(dev),
            "hchunk_bits": torch.from_numpy(np.asarray(s.chunk_bits, np.uint16).view(np.int16).copy()).to(dev)}


def _scale_tensors(result) -> dict[str, torch.Tensor]:
    """A result's group scales as stored: fp16, or their codes (scale_codes.py)."""
    coded = getattr(result, "coded_scales", None)
    return {"scales": result.scales.half().contiguous()} if coded is None else scale_codes.to_tensors(coded)


def huffman_stream(t: dict[str, torch.Tensor], numel: int) -> huffman.HuffmanStream:
    """The :class:`~vllm_latq.format.huffman.HuffmanStream` of a huffman-kind layer."""
    code = huffman.HuffmanCode(t["hsymbols"].cpu().numpy().astype(np.int32),
                               t["hlengths"].cpu().numpy().astype(np.uint8))
    return huffman.HuffmanStream(code, t["hstream"].cpu().numpy(), t["hchunk_bits"].cpu().numpy().view(np.uint16),
                                 numel)


def decode_integers(t: dict[str, torch.Tensor], kind: str, shape: tuple[int, int], bits: int | None) -> torch.Tensor:
    """int32 ``[out, in]`` integers of a layer (dense: 0 at outliers), on the tensors' device
    (a Huffman stream is decoded on the CPU)."""
    if kind == "dense":
        return unpack(t["qweight"], bits, shape[1])
    z = huffman.decode(huffman_stream(t, shape[0] * shape[1])).astype(np.int32)
    return torch.from_numpy(z).reshape(shape).to(t["hstream"].device)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, crow: torch.Tensor, col: torch.Tensor,
               val: torch.Tensor, bits: int, group_size: int, in_features: int) -> torch.Tensor:
    """fp32 ``[out, in]`` weights of the dense form: ``unpack(qweight) · scales`` plus the CSR
    outliers; the one definition of the dense math (reader, ``latq-eval``, kernels' reference)."""
    z = unpack(qweight, bits, in_features).float()
    W = z * scales.float().repeat_interleave(min(group_size, in_features), dim=1)[:, :in_features]
    W[csr_rows(crow, col.numel()), col.long()] += val.float()
    return W


def dequantize_layer(t: dict[str, torch.Tensor], kind: str, shape: tuple[int, int], bits: int | None,
                     group_size: int | None) -> torch.Tensor:
    """fp32 ``[out, in]`` weights of a layer's tensors, exactly the solver's ``QuantResult.q``."""
    if kind == "huffman":
        return decode_integers(t, kind, shape, bits).float() * t["hscale"].float()
    if kind == "codebook":
        return codebook.dequantize(t["codes"], dense_scales(t, shape[0]), bits, group_size)
    return dequantize(t["qweight"], dense_scales(t, shape[0]), t["outlier_crow"], t["outlier_col"], t["outlier_val"],
                      bits, group_size, shape[1])


# ----------------------------------------------------------------------------- validation

def expected_shapes(kind: str, shape: tuple[int, int], bits: int | None, group_size: int | None,
                    coded: bool = False):
    """Fixed tensor shapes and dtypes of a layer (variable-length ones as ``None``); ``coded``:
    a dense layer with coded scales (scale_codes.py)."""
    out, cin = shape
    if kind == "codebook":
        return codebook.shapes(shape, bits, group_size, coded)
    if kind == "dense":
        ng = math.ceil(cin / group_size)
        scales = {"scales": (out, ng)} if not coded else {k: s for k, (s, _) in scale_codes.shapes(out, ng).items()}
        shapes = {"qweight": (out, packed_words(cin, bits)), **scales,
                  "outlier_crow": (out + 1,), "outlier_col": None, "outlier_val": None}
    else:
        shapes = {"hscale": (1,), "hsymbols": None, "hlengths": None, "hstream": None,
                  "hchunk_bits": (math.ceil(out * cin / huffman.CHUNK),)}
    return {k: (shp, tensor_dtype(k, cin)) for k, shp in shapes.items()}


def validate_layer(t: dict[str, torch.Tensor], kind: str, shape: tuple[int, int], bits: int | None,
                   group_size: int | None, *, layer: str, file: str | None = None, decode: bool = True) -> None:
    """Raise :class:`FormatError` naming the tensor on any inconsistency (names, shapes,
    dtypes, CSR structure and zero integers under the outliers, Huffman code and chunk
    table; ``decode`` also decodes the Huffman stream)."""
    if kind == "codebook":
        codebook.check_layer_shape(shape, layer=layer, file=file)
    spec = expected_shapes(kind, shape, bits, group_size, coded=kind != "huffman" and has_coded_scales(t))
    for suffix, (shp, dt) in spec.items():
        name = f"{layer}.{suffix}"
        if suffix not in t:
            raise FormatError("missing", file=file, tensor=name)
        x = t[suffix]
        if x.dtype != dt:
            raise FormatError(f"dtype {x.dtype}, expected {dt}", file=file, tensor=name)
        if shp is not None and tuple(x.shape) != shp:
            raise FormatError(f"shape {tuple(x.shape)}, expected {shp}", file=file, tensor=name)
        if shp is None and x.dim() != 1:
            raise FormatError(f"must be 1-D, got shape {tuple(x.shape)}", file=file, tensor=name)
        if x.is_floating_point() and not torch.isfinite(x.float()).all():
            raise FormatError("has NaN/Inf values", file=file, tensor=name)
    extra = set(t) - set(spec)
    if extra:
        raise FormatError(f"unexpected tensors {sorted(extra)}", file=file, tensor=layer)
    if kind != "huffman":
        if kind == "dense":
            _validate_csr(t, shape, bits, layer, file)
        top = 2 ** (bits - 1) if kind == "dense" else codebook.CODEBOOKS[bits].max_abs
        if has_coded_scales(t):
            _validate_scale_codes(t, shape, layer, file)
            if kind == "codebook":
                _validate_scale_range(dense_scales(t, shape[0]).float(), top, layer, "scale_step", file)
        else:
            _validate_scale_range(t["scales"].float(), top, layer, "scales", file)
    else:
        _validate_scale_range(t["hscale"].float(), None, layer, "hscale", file)
        s = t["hscale"].float()
        if not torch.equal(s.half().float(), s):   # the runtime form keeps it as its fp16 group scale
            raise FormatError(f"{float(s.max())!r} is not fp16-exact", file=file, tensor=f"{layer}.hscale")
        _validate_huffman(t, shape, layer, file, decode)


# the largest weight a layer may dequantize to: fp16's largest value (every kernel computes
# weights in fp16 or bf16, and no real model comes near it)
MAX_WEIGHT = 65504.0
# the largest Huffman symbol magnitude: the readers (dequantize, the runtime transcode, the
# kernels' grid statistics) turn symbols into fp32, exact for integers up to 2^24
MAX_SYMBOL = 2 ** 24


def _validate_scale_range(s: torch.Tensor, top: float | None, layer: str, sfx: str, file) -> None:
    """Scales > 0, and — for groups — small enough that ``top``, the grid's or the code's largest
    magnitude, times the scale stays a finite fp16 weight."""
    if (s <= 0).any():
        raise FormatError(f"must be > 0 (found {float(s.min()):g})", file=file, tensor=f"{layer}.{sfx}")
    if top is not None and float(s.max()) * top > MAX_WEIGHT:
        raise FormatError(f"scale {float(s.max()):g} times the grid's largest magnitude {top:g} exceeds "
                          f"{MAX_WEIGHT:g}", file=file, tensor=f"{layer}.{sfx}")


def _validate_csr(t, shape, bits, layer, file):
    crow, col = t["outlier_crow"].long(), t["outlier_col"].long()
    nnz = col.numel()
    name = f"{layer}.outlier_crow"
    if crow[0] != 0 or crow[-1] != nnz:
        raise FormatError(f"must start at 0 and end at nnz={nnz} (got {crow[0]}..{crow[-1]})", file=file, tensor=name)
    if (crow[1:] < crow[:-1]).any():
        raise FormatError("row pointers are not monotone", file=file, tensor=name)
    if t["outlier_val"].numel() != nnz:
        raise FormatError(f"{t['outlier_val'].numel()} values for {nnz} column indices", file=file,
                          tensor=f"{layer}.outlier_val")
    if nnz and (col.min() < 0 or col.max() >= shape[1]):
        raise FormatError(f"column index out of range [0, {shape[1]})", file=file, tensor=f"{layer}.outlier_col")
    rows = csr_rows(crow, nnz)
    key = rows * shape[1] + col
    if nnz > 1 and (key[1:] <= key[:-1]).any():
        raise FormatError("column indices not strictly increasing within a row", file=file,
                          tensor=f"{layer}.outlier_col")
    z = unpack_at(t["qweight"], bits, rows, col)
    if nnz and (z != 0).any():
        k = int((z != 0).nonzero()[0, 0])
        raise FormatError(f"integer {int(z[k])} under the outlier at row {int(rows[k])}, column {int(col[k])} "
                          "(must be 0)", file=file, tensor=f"{layer}.qweight")


def _validate_scale_codes(t, shape, layer, file):
    if (t["scale_min"].float() <= 0).any():
        raise FormatError("must be > 0 (the smallest decoded scale)", file=file, tensor=f"{layer}.scale_min")
    if (t["scale_step"].float() < 0).any():
        raise FormatError("must be >= 0", file=file, tensor=f"{layer}.scale_step")
    if shape[0] % 2 and (t["scale_codes"][-1] >> 4).any():
        raise FormatError(f"the high nibbles of the last byte row must be 0 ({shape[0]} rows: no row {shape[0]})",
                          file=file, tensor=f"{layer}.scale_codes")
    if not torch.isfinite(dense_scales(t, shape[0]).float()).all():
        raise FormatError("decoded scales exceed the fp16 range", file=file, tensor=f"{layer}.scale_step")


def _validate_huffman(t, shape, layer, file, decode):
    lengths = t["hlengths"]
    if t["hsymbols"].numel() != lengths.numel() or lengths.numel() == 0:
        raise FormatError(f"{t['hsymbols'].numel()} symbols for {lengths.numel()} code lengths",
                          file=file, tensor=f"{layer}.hlengths")
    if lengths.min() < 1 or lengths.max() > huffman.MAX_CODE_LEN:
        raise FormatError(f"code lengths must be in 1..{huffman.MAX_CODE_LEN}", file=file, tensor=f"{layer}.hlengths")
    if float((2.0 ** -lengths.double()).sum()) > 1 + 1e-12:
        raise FormatError("code lengths violate the Kraft inequality", file=file, tensor=f"{layer}.hlengths")
    sym, ln = t["hsymbols"].long(), lengths.long()
    key = ln * 2**33 + sym  # canonical order: by (length, symbol), symbols distinct
    if key.numel() > 1 and (key[1:] <= key[:-1]).any():
        raise FormatError("symbols not in canonical order (by code length, then symbol) or not distinct",
                          file=file, tensor=f"{layer}.hsymbols")
    big = int(sym.abs().max())   # in int64: |-2^31| does not fit int32
    if big > MAX_SYMBOL:
        raise FormatError(f"a symbol of magnitude {big} exceeds 2^24, the largest integer fp32 holds exactly "
                          "(every reader computes symbol x hscale in fp32)", file=file, tensor=f"{layer}.hsymbols")
    top = big * float(t["hscale"].float().max())
    if top > MAX_WEIGHT:
        raise FormatError(f"a symbol of magnitude {big} under the scale gives a weight of {top:g}, "
                          f"beyond {MAX_WEIGHT:g}", file=file, tensor=f"{layer}.hsymbols")
    bits = int(t["hchunk_bits"].cpu().numpy().view(np.uint16).astype(np.int64).sum())
    if bits > 8 * t["hstream"].numel():
        raise FormatError(f"chunk table needs {bits} bits, stream has {8 * t['hstream'].numel()}",
                          file=file, tensor=f"{layer}.hstream")
    if decode:
        try:
            huffman.decode(huffman_stream(t, shape[0] * shape[1]))
        except ValueError as e:
            raise FormatError(f"stream does not decode: {e}", file=file, tensor=f"{layer}.hstream") from e


# ----------------------------------------------------------------------------- size

def layer_bits(t: dict[str, torch.Tensor], numel: int) -> float:
    """Stored bits/weight of one layer: the sum of its tensors' sizes."""
    return sum(x.numel() * x.element_size() * 8 for x in t.values()) / numel


def split_name(name: str) -> tuple[str, str] | None:
    """``"model.layers.0.mlp.up_proj.qweight"`` → ``("model.layers.0.mlp.up_proj", "qweight")``;
    ``None`` if the name is not a latq layer tensor."""
    module, _, suffix = name.rpartition(".")
    if module and suffix in ALL_TENSORS:
        return module, suffix
    return None


def layer_stats(t: dict[str, torch.Tensor], kind: str, shape: tuple[int, int]) -> dict:
    """Stored bits/weight and outlier rate of one layer, from its tensors alone."""
    numel = shape[0] * shape[1]
    nnz = t["outlier_col"].numel() if kind == "dense" else 0
    return {"bits": layer_bits(t, numel), "outlier_rate": nnz / numel if numel else 0.0}
