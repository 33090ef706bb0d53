"""The latq checkpoint format, version 1: one module shared by the writer (the offline
pipeline), the readers (``latq-eval``, ``latq-inspect``) and the vLLM loader.
``docs/FORMAT.md`` is the prose version of this file.

Per quantized linear ``P`` (an ``[out, in]`` weight), one of two kinds:

dense  (SSQR, GPTQ, RTN, Babai — b-bit integers on the clipped grid + optional outliers)
    P.qweight       int32  [out, ceil(in/32)·b]  packed offset-binary integers, see pack()
    P.scales        fp16   [out, ceil(in/g)]     group scales (static natural groups)
    P.outlier_crow  int32  [out+1]               CSR row pointers (all zero: no outliers)
    P.outlier_col   int16  [nnz]                 column indices (int32 when in > 32767)
    P.outlier_val   fp16   [nnz]                 outlier weights (their dense integer is 0)
    W = unpack(qweight)·scales (per group) + CSR(outliers)

huffman (HPTQ, HRTN — unclipped integers under one scale, one canonical Huffman code)
    P.hscale        fp32   [1]
    P.hsymbols      int32  [nsym]                canonical order (by code length, symbol)
    P.hlengths      uint8  [nsym]                code lengths (≤ 16)
    P.hstream       uint8  [nbytes]              MSB-first bit stream, row-major symbols
    P.hchunk_bits   int16  [ceil(out·in/2048)]   bits of each 2048-symbol chunk (uint16 bits)
    W = decode(stream) · hscale
"""
from __future__ import annotations

import math

import numpy as np
import torch

FORMAT_VERSION = 1
QUANT_METHOD = "latq"
DENSE_METHODS = ("ssqr", "gptq", "rtn", "babai")
HUFFMAN_METHODS = ("hptq", "hrtn")
METHODS = DENSE_METHODS + HUFFMAN_METHODS
DENSE_TENSORS = ("qweight", "scales", "outlier_crow", "outlier_col", "outlier_val")
HUFFMAN_TENSORS = ("hscale", "hsymbols", "hlengths", "hstream", "hchunk_bits")
PACK_TILE = 32  # values per tile; a tile of b-bit values is exactly b int32 words


class FormatError(ValueError):
    """A checkpoint does not follow the format. The message names the file and tensor."""

    def __init__(self, what: str, *, file: str | None = None, tensor: str | None = None):
        where = ", ".join(x for x in (f"file {file}" if file else "", f"tensor {tensor}" if tensor else "") if x)
        super().__init__(f"{where}: {what}" if where else what)


def kind_of(method: str) -> str:
    if method in DENSE_METHODS:
        return "dense"
    if method in HUFFMAN_METHODS:
        return "huffman"
    raise FormatError(f"unknown latq method {method!r}; expected one of {METHODS}")


# ----------------------------------------------------------------------------- packing

def packed_words(in_features: int, bits: int) -> int:
    return math.ceil(in_features / PACK_TILE) * bits


def pack(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed b-bit integers ``[out, in]`` → int32 ``[out, ceil(in/32)·b]``.

    Offset binary: ``u = z + 2^(b-1)`` in ``[0, 2^b)``. Each tile of 32 consecutive input
    columns is one 32·b-bit little-endian integer, value k at bits ``[k·b, k·b + b)``, split
    into b int32 words. For b = 2 and 4 this is plain little-endian packing (16 / 8 values per
    word); for b = 3 no value is wasted (32 values in 3 words) — a kernel loads b words per
    32 columns for any b. Padding columns hold u = 0."""
    out, cin = z.shape
    u = (z.to(torch.int64) + 2 ** (bits - 1))
    if u.numel() and (u.min() < 0 or u.max() >= 2**bits):
        raise ValueError(f"integers outside the {bits}-bit grid cannot be packed")
    tiles = math.ceil(cin / PACK_TILE)
    u = torch.nn.functional.pad(u, (0, tiles * PACK_TILE - cin)).reshape(out, tiles, PACK_TILE)
    bitplanes = (u[..., None] >> torch.arange(bits)) & 1                    # [out, T, 32, b]
    words = bitplanes.reshape(out, tiles, bits, 32) << torch.arange(32)      # bit i of word w
    w = words.sum(-1)                                                        # [out, T, b] < 2^32
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32).reshape(out, tiles * bits)


def unpack(qweight: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    """Inverse of :func:`pack` → int32 ``[out, in]`` signed integers."""
    out = qweight.shape[0]
    tiles = qweight.shape[1] // bits
    w = qweight.to(torch.int64).reshape(out, tiles, bits, 1) & 0xFFFFFFFF
    bitplanes = ((w >> torch.arange(32)) & 1).reshape(out, tiles, PACK_TILE, bits)
    u = (bitplanes << torch.arange(bits)).sum(-1).reshape(out, tiles * PACK_TILE)[:, :in_features]
    return (u - 2 ** (bits - 1)).to(torch.int32)


# ----------------------------------------------------------------------------- one layer

def encode_layer(result, kind: str) -> dict[str, torch.Tensor]:
    """A solver's :class:`~vllm_latq.quantize.result.QuantResult` → the layer's tensors
    (suffixes only, e.g. ``"qweight"``)."""
    if kind == "dense":
        out, cin = result.z.shape
        o = result.outliers
        crow = torch.zeros(out + 1, dtype=torch.int32) if o is None else o.crow
        col = torch.zeros(0, dtype=torch.int32) if o is None else o.col
        val = torch.zeros(0, dtype=torch.float16) if o is None else o.val
        return {"qweight": pack(result.z, result.bits),
                "scales": result.scales.half().contiguous(),
                "outlier_crow": crow.to(torch.int32).contiguous(),
                "outlier_col": col.to(col_dtype(cin)).contiguous(),
                "outlier_val": val.half().contiguous()}
    from .quantize import huffman
    s = huffman.encode(result.z.numpy())
    return {"hscale": result.scales.float().reshape(1),
            "hsymbols": torch.from_numpy(np.asarray(s.code.symbols, np.int32).copy()),
            "hlengths": torch.from_numpy(np.asarray(s.code.lengths, np.uint8).copy()),
            "hstream": torch.from_numpy(np.asarray(s.data, np.uint8).copy()),
            "hchunk_bits": torch.from_numpy(np.asarray(s.chunk_bits, np.uint16).view(np.int16).copy())}


def col_dtype(in_features: int) -> torch.dtype:
    return torch.int16 if in_features <= 32767 else torch.int32


def huffman_stream(t: dict[str, torch.Tensor], numel: int):
    from .quantize import huffman
    code = huffman.HuffmanCode(t["hsymbols"].numpy().astype(np.int32), t["hlengths"].numpy().astype(np.uint8))
    return huffman.HuffmanStream(code, t["hstream"].numpy(), t["hchunk_bits"].numpy().view(np.uint16), numel)


def decode_integers(t: dict[str, torch.Tensor], kind: str, shape: tuple[int, int], bits: int | None) -> torch.Tensor:
    """int32 ``[out, in]`` integers of a layer (dense: 0 at outliers)."""
    if kind == "dense":
        return unpack(t["qweight"], bits, shape[1])
    from .quantize import huffman
    return torch.from_numpy(huffman.decode(huffman_stream(t, shape[0] * shape[1])).astype(np.int32)).reshape(shape)


def dequantize_layer(t: dict[str, torch.Tensor], kind: str, shape: tuple[int, int], bits: int | None,
                     group_size: int | None) -> torch.Tensor:
    """fp32 ``[out, in]`` weights, exactly the solver's ``QuantResult.q``."""
    z = decode_integers(t, kind, shape, bits).float()
    if kind == "huffman":
        return z * t["hscale"].float()
    W = z * t["scales"].float().repeat_interleave(group_size, dim=1)[:, : shape[1]]
    crow = t["outlier_crow"].long()
    rows = torch.repeat_interleave(torch.arange(shape[0]), crow[1:] - crow[:-1])
    W[rows, t["outlier_col"].long()] = t["outlier_val"].float()
    return W


def expected_shapes(kind: str, shape: tuple[int, int], bits: int | None, group_size: int | None):
    """Fixed tensor shapes and dtypes of a layer (variable-length ones as ``None``)."""
    out, cin = shape
    if kind == "dense":
        return {"qweight": ((out, packed_words(cin, bits)), torch.int32),
                "scales": ((out, math.ceil(cin / group_size)), torch.float16),
                "outlier_crow": ((out + 1,), torch.int32),
                "outlier_col": (None, col_dtype(cin)),
                "outlier_val": (None, torch.float16)}
    from .quantize.huffman import CHUNK
    return {"hscale": ((1,), torch.float32), "hsymbols": (None, torch.int32),
            "hlengths": (None, torch.uint8), "hstream": (None, torch.uint8),
            "hchunk_bits": ((math.ceil(out * cin / CHUNK),), torch.int16)}


def validate_layer(t: dict[str, torch.Tensor], kind: str, shape: tuple[int, int], bits: int | None,
                   group_size: int | None, *, layer: str, file: str | None = None, decode: bool = True) -> None:
    """Raise :class:`FormatError` naming the tensor on any inconsistency (names, shapes,
    dtypes, CSR structure, Huffman code and chunk table; ``decode`` also decodes)."""
    spec = expected_shapes(kind, shape, bits, group_size)
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
    if kind == "dense":
        _validate_csr(t, shape, layer, file)
    else:
        _validate_huffman(t, shape, layer, file, decode)


def _validate_csr(t, shape, layer, file):
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
    rows = torch.repeat_interleave(torch.arange(shape[0]), crow[1:] - crow[:-1])
    key = rows * shape[1] + col
    if nnz > 1 and (key[1:] <= key[:-1]).any():
        raise FormatError("column indices not strictly increasing within a row", file=file,
                          tensor=f"{layer}.outlier_col")


def _validate_huffman(t, shape, layer, file, decode):
    from .quantize import huffman
    lengths = t["hlengths"]
    if t["hsymbols"].numel() != lengths.numel() or lengths.numel() == 0:
        raise FormatError(f"{t['hsymbols'].numel()} symbols for {lengths.numel()} code lengths",
                          file=file, tensor=f"{layer}.hlengths")
    if lengths.min() < 1 or lengths.max() > huffman.MAX_CODE_LEN:
        raise FormatError(f"code lengths must be in 1..{huffman.MAX_CODE_LEN}", file=file, tensor=f"{layer}.hlengths")
    if float((2.0 ** -lengths.double()).sum()) > 1 + 1e-12:
        raise FormatError("code lengths violate the Kraft inequality", file=file, tensor=f"{layer}.hlengths")
    bits = int(t["hchunk_bits"].numpy().view(np.uint16).astype(np.int64).sum())
    if bits > 8 * t["hstream"].numel():
        raise FormatError(f"chunk table needs {bits} bits, stream has {8 * t['hstream'].numel()}",
                          file=file, tensor=f"{layer}.hstream")
    if decode:
        try:
            huffman.decode(huffman_stream(t, shape[0] * shape[1]))
        except ValueError as e:
            raise FormatError(f"stream does not decode: {e}", file=file, tensor=f"{layer}.hstream") from e


def layer_bits(t: dict[str, torch.Tensor], numel: int) -> float:
    """Stored bits/weight of one layer: the sum of its tensors' sizes."""
    return sum(x.numel() * x.element_size() * 8 for x in t.values()) / numel
