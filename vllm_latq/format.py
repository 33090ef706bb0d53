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

Directory level (shards, index, ``config.json``'s ``quantization_config``, checksums,
stats) lives in :mod:`vllm_latq.checkpoint`; this module defines the per-layer tensors and
the ``quantization_config`` schema (:func:`quantization_config`, :func:`parse_quantization_config`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

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
LAYER_TENSORS = {"dense": DENSE_TENSORS, "huffman": HUFFMAN_TENSORS}
ORDERS = ("act", "min-pivot", "natural", "reverse")


class FormatError(ValueError):
    """A checkpoint does not follow the format. The message names the file and tensor."""

    def __init__(self, what: str, *, file: str | None = None, tensor: str | None = None):
        what = " ".join(line.strip() for line in str(what).splitlines())  # always one line
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


# rows per packing step: the bit-plane temporaries are int64 [rows, in, b]; whole-matrix steps
# took 21 GB for Gemma3's 262144×640 head at 8 bits
PACK_CHUNK_ELEMS = 1 << 22


def _row_chunks(rows: int, per_row: int):
    step = max(1, PACK_CHUNK_ELEMS // max(1, per_row))
    return (slice(r, min(rows, r + step)) for r in range(0, rows, step))


def pack(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed b-bit integers ``[out, in]`` → int32 ``[out, ceil(in/32)·b]``.

    Offset binary: ``u = z + 2^(b-1)`` in ``[0, 2^b)``. Each tile of 32 consecutive input
    columns is one 32·b-bit little-endian integer, value k at bits ``[k·b, k·b + b)``, split
    into b int32 words. For b = 2 and 4 this is plain little-endian packing (16 / 8 values per
    word); for b = 3 no value is wasted (32 values in 3 words) — a kernel loads b words per
    32 columns for any b. Padding columns hold u = 0."""
    out, cin = z.shape
    if z.numel() and (z.min() < -2 ** (bits - 1) or z.max() >= 2 ** (bits - 1)):
        raise ValueError(f"integers outside the {bits}-bit grid cannot be packed")
    tiles = math.ceil(cin / PACK_TILE)
    res = torch.empty(out, tiles * bits, dtype=torch.int32)
    for rows in _row_chunks(out, tiles * PACK_TILE * bits):
        u = torch.nn.functional.pad(z[rows].to(torch.int64) + 2 ** (bits - 1), (0, tiles * PACK_TILE - cin))
        bitplanes = (u.reshape(-1, tiles, PACK_TILE)[..., None] >> torch.arange(bits)) & 1   # [R, T, 32, b]
        words = bitplanes.reshape(-1, tiles, bits, 32) << torch.arange(32)                 # bit i of word w
        w = words.sum(-1)                                                                   # [R, T, b] < 2^32
        res[rows] = torch.where(w >= 2**31, w - 2**32, w).to(torch.int32).reshape(-1, tiles * bits)
    return res


def unpack(qweight: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    """Inverse of :func:`pack` → int32 ``[out, in]`` signed integers."""
    out = qweight.shape[0]
    tiles = qweight.shape[1] // bits
    res = torch.empty(out, in_features, dtype=torch.int32)
    for rows in _row_chunks(out, tiles * PACK_TILE * bits):
        w = qweight[rows].to(torch.int64).reshape(-1, tiles, bits, 1) & 0xFFFFFFFF
        bitplanes = ((w >> torch.arange(32)) & 1).reshape(-1, tiles, PACK_TILE, bits)
        u = (bitplanes << torch.arange(bits)).sum(-1).reshape(-1, tiles * PACK_TILE)[:, :in_features]
        res[rows] = (u - 2 ** (bits - 1)).to(torch.int32)
    return res


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
    sym, ln = t["hsymbols"].long(), lengths.long()
    key = ln * 2**33 + sym  # canonical order: by (length, symbol), symbols distinct
    if key.numel() > 1 and (key[1:] <= key[:-1]).any():
        raise FormatError("symbols not in canonical order (by code length, then symbol) or not distinct",
                          file=file, tensor=f"{layer}.hsymbols")
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


def split_name(name: str) -> tuple[str, str] | None:
    """``"model.layers.0.mlp.up_proj.qweight"`` → ``("model.layers.0.mlp.up_proj", "qweight")``;
    ``None`` if the name is not a latq layer tensor."""
    module, _, suffix = name.rpartition(".")
    if module and suffix in DENSE_TENSORS + HUFFMAN_TENSORS:
        return module, suffix
    return None


def layer_stats(t: dict[str, torch.Tensor], kind: str, shape: tuple[int, int]) -> dict:
    """Stored bits/weight and outlier rate of one layer, from its tensors alone."""
    numel = shape[0] * shape[1]
    nnz = t["outlier_col"].numel() if kind == "dense" else 0
    return {"bits": layer_bits(t, numel), "outlier_rate": nnz / numel if numel else 0.0}


# ----------------------------------------------------------------------------- config.json

@dataclass(frozen=True)
class QuantSpec:
    """The parsed ``quantization_config`` of a latq checkpoint (format version 1)."""
    method: str
    kind: str
    bits: int | None                 # dense: inlier bits; huffman: None
    group_size: int | None           # dense: group size; huffman: None
    outlier_rate: float | None       # ssqr: the requested outlier-rate budget
    target_bits: float | None        # hptq/hrtn: the requested bits/weight budget
    order: str | None
    damp: float | None
    modules_not_converted: tuple[str, ...] = ()
    extra: dict = field(default_factory=dict, compare=False)
    layer_bits: tuple[tuple[str, int], ...] = ()   # dense: (module, inlier bits) overriding ``bits``

    def is_converted(self, module: str) -> bool:
        """False for a module listed in ``modules_not_converted`` (or below one)."""
        return not any(module == m or module.startswith(m + ".") for m in self.modules_not_converted)

    def bits_of(self, module: str) -> int | None:
        """The inlier bits of ``module``: its ``layer_bits`` entry, else ``bits``."""
        return dict(self.layer_bits).get(module, self.bits)


def quantization_config(method: str, *, bits: int | None = None, group_size: int | None = None,
                        outlier_rate: float | None = None, target_bits: float | None = None,
                        order: str | None = None, damp: float | None = None,
                        modules_not_converted=(), layer_bits: dict | None = None, **extra) -> dict:
    """The ``quantization_config`` dict written to ``config.json`` (keys as in docs/FORMAT.md).
    Only the keys that apply to ``method`` are set; ``extra`` (e.g. ``calibration``) is
    informational and ignored by readers."""
    kind = kind_of(method)
    qc = {"quant_method": QUANT_METHOD, "format_version": FORMAT_VERSION, "method": method,
          "bits": int(bits) if kind == "dense" else None,
          "group_size": int(group_size) if kind == "dense" else None}
    if method == "ssqr":
        qc["outlier_rate"] = float(outlier_rate)
    if kind == "huffman":
        qc["target_bits"] = float(target_bits)
    uses_h = method not in ("rtn", "hrtn")
    qc["order"] = order if uses_h else None
    qc["damp"] = float(damp) if uses_h else None
    qc["modules_not_converted"] = sorted(modules_not_converted)
    if layer_bits:
        qc["layer_bits"] = {k: int(v) for k, v in sorted(layer_bits.items())}
    qc.update(extra)
    parse_quantization_config(qc)  # never write what we cannot read
    return qc


def _num(x, what, file, kinds=(int, float)) -> float:
    if isinstance(x, bool) or not isinstance(x, kinds) or not math.isfinite(x):
        raise FormatError(f"quantization_config.{what} must be a finite number, got {x!r}", file=file)
    return x


def parse_quantization_config(qc, *, file: str | None = "config.json") -> QuantSpec:
    """Check a ``quantization_config`` dict and return its :class:`QuantSpec`.

    Raises :class:`FormatError` for anything but a well-formed latq version-1 config: wrong
    ``quant_method``, unknown ``format_version`` (newer writers bump it on incompatible
    changes), unknown method, bits outside 2..8, non-positive group size, budgets out of range."""
    if not isinstance(qc, dict):
        raise FormatError(f"quantization_config must be an object, got {type(qc).__name__}", file=file)
    if qc.get("quant_method") != QUANT_METHOD:
        raise FormatError(f"quantization_config.quant_method is {qc.get('quant_method')!r}, expected "
                          f"{QUANT_METHOD!r}", file=file)
    version = qc.get("format_version")
    if version != FORMAT_VERSION or isinstance(version, bool):
        raise FormatError(f"unsupported latq format_version {version!r}: this reader knows version "
                          f"{FORMAT_VERSION} (upgrade vllm-latq to read newer checkpoints)", file=file)
    method = qc.get("method")
    if method not in METHODS:
        raise FormatError(f"quantization_config.method is {method!r}, expected one of {METHODS}", file=file)
    kind = kind_of(method)
    bits = group_size = outlier_rate = target_bits = None
    if kind == "dense":
        bits = qc.get("bits")
        if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 8:
            raise FormatError(f"quantization_config.bits must be an integer in 2..8, got {bits!r}", file=file)
        group_size = qc.get("group_size")
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise FormatError(f"quantization_config.group_size must be a positive integer, got {group_size!r}",
                              file=file)
    if method == "ssqr":
        outlier_rate = _num(qc.get("outlier_rate"), "outlier_rate", file)
        if not 0 <= outlier_rate < 1:
            raise FormatError(f"quantization_config.outlier_rate must be in [0, 1), got {outlier_rate}", file=file)
    if kind == "huffman":
        target_bits = _num(qc.get("target_bits"), "target_bits", file)
        if target_bits <= 1:
            raise FormatError(f"quantization_config.target_bits must exceed 1, got {target_bits}", file=file)
    order, damp = qc.get("order"), qc.get("damp")
    if order is not None and order not in ORDERS:
        raise FormatError(f"quantization_config.order is {order!r}, expected one of {ORDERS} or null", file=file)
    if damp is not None:
        damp = _num(damp, "damp", file)
    mnc = qc.get("modules_not_converted", [])
    if not isinstance(mnc, list) or not all(isinstance(m, str) for m in mnc):
        raise FormatError("quantization_config.modules_not_converted must be a list of module names", file=file)
    lb = qc.get("layer_bits", {})
    if not isinstance(lb, dict) or not all(isinstance(k, str) for k in lb):
        raise FormatError("quantization_config.layer_bits must be an object {module: bits}", file=file)
    if lb and kind != "dense":
        raise FormatError(f"quantization_config.layer_bits is for the dense methods, not {method}", file=file)
    for m, b in lb.items():
        if isinstance(b, bool) or not isinstance(b, int) or not 2 <= b <= 8:
            raise FormatError(f"quantization_config.layer_bits[{m!r}] must be an integer in 2..8, got {b!r}",
                              file=file)
    known = {"quant_method", "format_version", "method", "bits", "group_size", "outlier_rate", "target_bits",
             "order", "damp", "modules_not_converted", "layer_bits"}
    return QuantSpec(method, kind, bits, group_size, outlier_rate, target_bits, order, damp, tuple(mnc),
                     {k: v for k, v in qc.items() if k not in known}, tuple(sorted(lb.items())))


BUDGET_SLACK = 1e-9


def check_budget(t: dict[str, torch.Tensor], spec: QuantSpec, shape: tuple[int, int], *, layer: str,
                 file: str | None = None) -> dict:
    """The bit budget promised by ``quantization_config``: SSQR stores at most ``outlier_rate``
    outliers, the other dense methods none; HPTQ/HRTN store at most ``target_bits`` bits/weight
    (everything counted, as :func:`layer_bits`). Returns :func:`layer_stats`."""
    st = layer_stats(t, spec.kind, shape)
    if spec.kind == "dense":
        limit = spec.outlier_rate if spec.method == "ssqr" else 0.0
        if st["outlier_rate"] > limit + BUDGET_SLACK:
            raise FormatError(f"outlier rate {st['outlier_rate']:.6f} exceeds the budget {limit} of method "
                              f"{spec.method}", file=file, tensor=f"{layer}.outlier_col")
    elif st["bits"] > spec.target_bits + BUDGET_SLACK:
        raise FormatError(f"{st['bits']:.4f} bits/weight exceed target_bits {spec.target_bits}", file=file,
                          tensor=f"{layer}.hstream")
    return st


def inspect_main(argv=None) -> int:
    """``latq-inspect`` (kept here for older installed entry points): see
    :func:`vllm_latq.checkpoint.inspect_main`."""
    from .checkpoint import inspect_main as _main
    return _main(argv)
