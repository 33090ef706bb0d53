"""The ``quantization_config`` of a latq checkpoint (the object in ``config.json``): method
names, the schema writer and the one validating parser (:class:`QuantSpec`), and the bit
budget it promises. ``docs/FORMAT.md`` ("config.json") is the prose version."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from . import scale_codes
from .codebook import CODEBOOKS, DIM as BLOCK
from ..errors import FormatError
from .layer import layer_stats
from .rotation import Rotation, parse_rotation

# The newest version this package reads and writes; a checkpoint is written at the oldest
# version that expresses it (1 without rotation, so older readers keep reading those) and
# version 2 marks a rotated one, which a version-1 reader must refuse: it has no new tensors
# to trip over and would serve W·R as W. Version 3 marks the codebook kind (method e8), whose
# method name and tensors a version-2 reader does not know: it refuses the version by name first.
FORMAT_VERSION = 3
FORMAT_VERSIONS = (1, 2, 3)
ROTATION_VERSION = 2
CODEBOOK_VERSION = 3
QUANT_METHOD = "latq"
DENSE_METHODS = ("ssqr", "gptq", "rtn", "babai")
HUFFMAN_METHODS = ("hptq", "hrtn")
CODEBOOK_METHODS = ("e8",)
METHODS = DENSE_METHODS + HUFFMAN_METHODS + CODEBOOK_METHODS
ORDERS = ("act", "min-pivot", "natural", "reverse")
INLIER_BITS = range(2, 9)   # the inlier widths a dense layer may store
# the widest scale group: wider than any layer a config may declare (model_config.SIZE_LIMITS), so
# a group of a row or more (one scale per row) is expressible; what a group's arithmetic allocates
# is bounded by the row, never by g (a group is min(g, in_features) wide)
MAX_GROUP_SIZE = 1 << 20
# where per-input-column scales were folded (quantize/column_scales.py): "norm" = into the norm
# feeding q/k/v and gate/up; the checkpoint's tensors already carry them, readers need nothing
COLUMN_SCALE_FOLDS = ("norm",)


def kind_of(method: str) -> str:
    """The layer kind (``"dense"``, ``"huffman"`` or ``"codebook"``) a method writes."""
    if method in DENSE_METHODS:
        return "dense"
    if method in HUFFMAN_METHODS:
        return "huffman"
    if method in CODEBOOK_METHODS:
        return "codebook"
    raise FormatError(f"unknown latq method {method!r}; expected one of {METHODS}")


@dataclass(frozen=True)
class QuantSpec:
    """The parsed ``quantization_config`` of a latq checkpoint."""
    method: str
    kind: str
    bits: int | None                 # dense: inlier bits; codebook: bits of the code a weight; huffman: None
    group_size: int | None           # dense, codebook: group size; huffman: None
    outlier_rate: float | None       # ssqr: the requested outlier-rate budget
    target_bits: float | None        # hptq/hrtn: the requested bits/weight budget
    order: str | None
    damp: float | None
    modules_not_converted: tuple[str, ...] = ()
    extra: dict = field(default_factory=dict, compare=False)
    layer_bits: tuple[tuple[str, int], ...] = ()   # dense: (module, inlier bits) overriding ``bits``
    column_scale_fold: str | None = None          # "norm": column scales folded into norms; None: none
    column_scale_power: float | None = None       # their exponent p in c ∝ D^p
    scale_bits: int | None = None                 # dense, codebook: group scales coded in this many bits (scale_codes.py)
    rotation: Rotation | None = None              # every quantized linear's input rotated (rotation.py)

    @property
    def version(self) -> int:
        return version_of(self.kind, self.rotation)

    def is_converted(self, module: str) -> bool:
        """False for a module listed in ``modules_not_converted`` (or below one)."""
        return not any(module == m or module.startswith(m + ".") for m in self.modules_not_converted)

    def bits_of(self, module: str) -> int | None:
        """The inlier bits of ``module``: its ``layer_bits`` entry, else ``bits``."""
        return dict(self.layer_bits).get(module, self.bits)


def version_of(kind: str, rotation: Rotation | None) -> int:
    """The oldest format version that expresses a checkpoint of ``kind``, rotated or not."""
    if kind == "codebook":
        return CODEBOOK_VERSION
    return ROTATION_VERSION if rotation is not None else 1


def quantization_config(method: str, *, bits: int | None = None, group_size: int | None = None,
                        outlier_rate: float | None = None, target_bits: float | None = None,
                        order: str | None = None, damp: float | None = None,
                        modules_not_converted=(), layer_bits: dict | None = None,
                        column_scales: dict | None = None, scale_bits: int | None = None,
                        rotation: Rotation | None = None, **extra) -> dict:
    """The ``quantization_config`` dict written to ``config.json`` (keys as in docs/FORMAT.md).
    Only the keys that apply to ``method`` are set (``column_scales`` ``{"fold", "power"}``
    only when used, so checkpoints without it are unchanged; ``scale_bits`` and ``rotation`` likewise, the
    latter at format version 2); ``extra`` (e.g. ``calibration``) is informational and ignored by readers."""
    kind = kind_of(method)
    grouped = kind != "huffman"
    qc = {"quant_method": QUANT_METHOD, "format_version": version_of(kind, rotation), "method": method,
          "bits": int(bits) if grouped else None, "group_size": int(group_size) if grouped else None}
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
    if column_scales:
        qc["column_scales"] = dict(column_scales)
    if scale_bits is not None:
        qc["scale_bits"] = int(scale_bits)
    if rotation is not None:
        qc["rotation"] = rotation.config()
    qc.update(extra)
    parse_quantization_config(qc)  # never write what we cannot read
    return qc


def _num(x, what, file, kinds=(int, float)) -> float:
    if isinstance(x, bool) or not isinstance(x, kinds) or not math.isfinite(x):
        raise FormatError(f"quantization_config.{what} must be a finite number, got {x!r}", file=file)
    return x


def parse_quantization_config(qc, *, file: str | None = "config.json") -> QuantSpec:
    """Check a ``quantization_config`` dict and return its :class:`QuantSpec`.

    Raises :class:`FormatError` for anything but a well-formed latq config of a known version: wrong
    ``quant_method``, unknown ``format_version`` (newer writers bump it on incompatible
    changes), unknown method, bits outside 2..8, non-positive group size, budgets out of range."""
    if not isinstance(qc, dict):
        raise FormatError(f"quantization_config must be an object, got {type(qc).__name__}", file=file)
    if qc.get("quant_method") != QUANT_METHOD:
        raise FormatError(f"quantization_config.quant_method is {qc.get('quant_method')!r}, expected "
                          f"{QUANT_METHOD!r}", file=file)
    version = qc.get("format_version")
    if isinstance(version, float):   # 3.0 == 3 in Python: the format's integers are JSON integers
        raise FormatError(f"quantization_config.format_version must be an integer, got {version!r}", file=file)
    if version not in FORMAT_VERSIONS or isinstance(version, bool):
        raise FormatError(f"unsupported latq format_version {version!r}: this reader knows versions "
                          f"{', '.join(map(str, FORMAT_VERSIONS))} (upgrade vllm-latq to read newer checkpoints)",
                          file=file)
    method = qc.get("method")
    if method not in METHODS:
        raise FormatError(f"quantization_config.method is {method!r}, expected one of {METHODS}", file=file)
    kind = kind_of(method)
    if kind == "codebook" and version < CODEBOOK_VERSION:
        raise FormatError(f"quantization_config.method {method} needs format_version {CODEBOOK_VERSION}, got "
                          f"{version}", file=file)
    bits = group_size = outlier_rate = target_bits = None
    if kind != "huffman":
        bits, group_size = _bits_and_group(qc, kind, file)
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
        if isinstance(b, bool) or not isinstance(b, int) or b not in INLIER_BITS:
            raise FormatError(f"quantization_config.layer_bits[{m!r}] must be an integer in 2..8, got {b!r}",
                              file=file)
    fold, power = _column_scales(qc.get("column_scales"), method, file)
    if qc.get("lm_head_quantized", True) is not True:   # the plugin reads `is True`: 1 or false would be ignored
        raise FormatError(f"quantization_config.lm_head_quantized must be true or absent, got "
                          f"{qc['lm_head_quantized']!r}", file=file)
    tc = qc.get("target_correction")
    if tc is not None and tc is not True:
        raise FormatError(f"quantization_config.target_correction must be true or absent, got {tc!r}", file=file)
    if tc and method in ("rtn", "hrtn"):
        raise FormatError(f"quantization_config.target_correction needs a calibrated method, not {method}", file=file)
    scale_bits = qc.get("scale_bits")
    if scale_bits is not None and (kind == "huffman" or scale_bits not in scale_codes.CODE_BITS
                                   or type(scale_bits) is not int):   # 4.0 == 4 in Python: a JSON integer
        raise FormatError(f"quantization_config.scale_bits must be absent or one of {scale_codes.CODE_BITS} "
                          f"for a method with group scales, got {scale_bits!r} ({method})", file=file)
    rotation = parse_rotation(qc.get("rotation"), file)
    if rotation is not None and version < ROTATION_VERSION:
        raise FormatError(f"quantization_config.rotation needs format_version {ROTATION_VERSION}, got {version}",
                          file=file)
    _check_version_meaning(version, method, kind, rotation, file)
    _check_method_keys(qc, method, kind, file)
    known = {"quant_method", "format_version", "method", "bits", "group_size", "outlier_rate", "target_bits",
             "order", "damp", "modules_not_converted", "layer_bits", "column_scales", "scale_bits", "rotation"}
    return QuantSpec(method, kind, bits, group_size, outlier_rate, target_bits, order, damp, tuple(mnc),
                     {k: v for k, v in qc.items() if k not in known}, tuple(sorted(lb.items())), fold, power,
                     scale_bits, rotation)


def _check_version_meaning(version: int, method: str, kind: str, rotation, file) -> None:
    """Each version names what it marks (docs/FORMAT.md, "Versioning"): 3 exactly the codebook
    kind, always rotated (its codes quantize W·R: served unrotated they are garbage), 2 exactly a
    rotated checkpoint of the other kinds."""
    if kind == "codebook" and rotation is None:
        raise FormatError(f"quantization_config.rotation is missing: the codebook kind (method {method}) is "
                          "written only with a rotation", file=file)
    if kind != "codebook" and version == CODEBOOK_VERSION:
        raise FormatError(f"quantization_config.format_version {version} marks the codebook kind (method e8), "
                          f"not {method}", file=file)
    if kind != "codebook" and version == ROTATION_VERSION and rotation is None:
        raise FormatError(f"quantization_config.format_version {version} marks a rotated checkpoint, but it has "
                          "no rotation", file=file)


def _check_method_keys(qc: dict, method: str, kind: str, file) -> None:
    """``outlier_rate`` is ssqr's, ``target_bits`` hptq's and hrtn's: elsewhere an edit, unread by the budget check."""
    if qc.get("outlier_rate") is not None and method != "ssqr":   # null is absent
        raise FormatError(f"quantization_config.outlier_rate is ssqr's only, not {method}'s", file=file)
    if qc.get("target_bits") is not None and kind != "huffman":
        raise FormatError(f"quantization_config.target_bits is hptq's and hrtn's only, not {method}'s", file=file)


def _bits_and_group(qc: dict, kind: str, file) -> tuple[int, int]:
    """``bits`` and ``group_size`` of a dense or codebook method."""
    bits, group_size = qc.get("bits"), qc.get("group_size")
    allowed = INLIER_BITS if kind == "dense" else tuple(CODEBOOKS)
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in allowed:
        rule = "an integer in 2..8" if kind == "dense" else f"one of {', '.join(map(str, allowed))}"
        raise FormatError(f"quantization_config.bits must be {rule}, got {bits!r}", file=file)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or not 1 <= group_size <= MAX_GROUP_SIZE:
        raise FormatError(f"quantization_config.group_size must be an integer in 1..{MAX_GROUP_SIZE}, got "
                          f"{group_size!r}", file=file)
    if kind == "codebook" and group_size % BLOCK:
        raise FormatError(f"quantization_config.group_size must be a multiple of {BLOCK} (whole codebook blocks), "
                          f"got {group_size}", file=file)
    return bits, group_size


def _column_scales(cs, method: str, file) -> tuple[str | None, float | None]:
    """``quantization_config.column_scales``: absent/null, or ``{"fold": "norm", "power": p ≥ 0}``
    for a method that has a Hessian (the scales are computed from it)."""
    if cs is None:
        return None, None
    if not isinstance(cs, dict) or set(cs) != {"fold", "power"}:
        raise FormatError(f"quantization_config.column_scales must be null or {{\"fold\", \"power\"}}, got {cs!r}",
                          file=file)
    if cs["fold"] not in COLUMN_SCALE_FOLDS:
        raise FormatError(f"quantization_config.column_scales.fold is {cs['fold']!r}, expected one of "
                          f"{COLUMN_SCALE_FOLDS}", file=file)
    power = _num(cs["power"], "column_scales.power", file)
    if power < 0:
        raise FormatError(f"quantization_config.column_scales.power must be >= 0, got {power}", file=file)
    if method in ("rtn", "hrtn"):
        raise FormatError(f"quantization_config.column_scales needs a calibrated method (computed from the Hessian), "
                          f"not {method}", file=file)
    return cs["fold"], float(power)


BUDGET_SLACK = 1e-9


def check_budget(t: dict[str, torch.Tensor], spec: QuantSpec, shape: tuple[int, int], *, layer: str,
                 file: str | None = None) -> dict:
    """The bit budget promised by ``quantization_config``: SSQR stores at most ``outlier_rate``
    outliers, the other dense methods none; HPTQ/HRTN store at most ``target_bits`` bits/weight
    (everything counted, as :func:`layer_bits`). Returns :func:`layer_stats`."""
    st = layer_stats(t, spec.kind, shape)
    if spec.kind == "codebook":
        return st   # a fixed-size code: its shapes are its budget
    if spec.kind == "dense":
        limit = spec.outlier_rate if spec.method == "ssqr" else 0.0
        if st["outlier_rate"] > limit + BUDGET_SLACK:
            raise FormatError(f"outlier rate {st['outlier_rate']:.6f} exceeds the budget {limit} of method "
                              f"{spec.method}", file=file, tensor=f"{layer}.outlier_col")
    elif st["bits"] > spec.target_bits + BUDGET_SLACK:
        raise FormatError(f"{st['bits']:.4f} bits/weight exceed target_bits {spec.target_bits}", file=file,
                          tensor=f"{layer}.hstream")
    return st
