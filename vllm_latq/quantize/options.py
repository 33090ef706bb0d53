"""The pipeline's options (``latq-quantize``'s flags), each checked where it is parsed and
named as the user wrote it; and what they become: each solver's arguments, the checkpoint's
``quantization_config``."""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

import torch

from .. import cpu_features, data, hf_model
from .. import format as fmt
from ..algorithms import lattice
from ..algorithms.decoders import DECODERS, MAX_BEAM
from ..algorithms.e8 import E8_ORDERS
from ..format.codebook import CODEBOOKS, DIM as CODEBOOK_BLOCK
from ..format.scale_codes import CODE_BITS
from ..format.spec import INLIER_BITS, MAX_GROUP_SIZE

log = logging.getLogger("vllm_latq.quantize")

UNCALIBRATED = ("rtn", "hrtn")  # solvers that ignore H
COMPUTE_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}
# The column orders offered: the format's, without "reverse" — the solvers' frame-literal flip
# of "natural" that states the GPTQ ≡ Babai identity (gptq(order="reverse") ≡ babai(order=
# "natural")), not a column-order heuristic of its own.
ORDERS = tuple(o for o in lattice.ORDERS if o != "reverse")
CODED_SCALE_METHODS = ("gptq", "rtn", "babai", "e8")   # the methods whose group scales may be stored as codes
DECODED_METHODS = ("gptq", "babai", "ssqr", "hptq")   # the nearest-plane solvers another decoder may replace
INT64 = 2 ** 63   # what the checkpoint's JSON records of an option, and torch, hold
MAX_TARGET_BITS = 8.0   # HPTQ's target: past 8 bits/weight a Huffman-coded layer outgrows an 8-bit dense one

# The defaults the study chose (docs/RESULTS.md): GPTQ 4-bit at group 64 serves fewer
# bits than SSQR-1 % at group 128 with a lower perplexity on both reference models and both
# kernel families; the methods with outliers or one scale keep group 128, where a smaller
# group does not pay (docs/KERNELS.md, accuracy levers: e).
DEFAULT_METHOD = "gptq"
DEFAULT_GROUP_SIZE = {"gptq": 64, "babai": 64, "rtn": 64, "e8": 64}   # other methods: 128
# the output head's inlier bits by default (dense methods): free in perplexity on both reference
# models at half the bytes of bf16 (docs/RESULTS.md, the decision rule and its measurements)
DEFAULT_LM_HEAD_BITS = 8


def default_group_size(method: str) -> int:
    return DEFAULT_GROUP_SIZE.get(method, 128)


def default_rotation(method: str) -> str:
    """The codebook methods' balls are shaped for rotated, Gaussian-like blocks: they rotate unless told."""
    return "hadamard" if fmt.kind_of(method) == "codebook" else "none"


def _require(ok: bool, option: str, rule: str, value) -> None:
    """Refuse ``option`` = ``value`` unless ``ok``, in the option's own name."""
    if not ok:
        raise ValueError(f"{option} must be {rule}, got {value!r}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class QuantizeOptions:
    method: str = DEFAULT_METHOD
    bits: int = 4
    group_size: int | None = None   # None: the method's default (default_group_size)
    outlier_rate: float = 0.01
    target_bits: float = 3.125
    order: str = "act"
    damp: float = 0.01
    calib: str = "wiki"
    nsamples: int = 128
    seqlen: int = 512
    seed: int = 0
    device: str = "cpu"
    # dtype of the calibration forwards: "auto" = the source model's (bf16 for a bf16 model, the
    # dtype GPTQ implementations run in) — but fp32 on a CPU that only emulates bf16 — and fp32
    # for fp16/fp32 sources. Weights are solved in fp32 and Hessians summed in fp64 either way.
    compute_dtype: str = "auto"
    # the output head (lm_head): True quantizes it with the same method, False keeps it in the model
    # dtype; None (default): dense methods quantize it with DEFAULT_LM_HEAD_BITS-bit inliers, others
    # keep it, as does a model whose head cannot be quantized, and a tied head whose copy would make the
    # checkpoint bigger than the source (head_size.py). A quantized tied head is untied: the embedding
    # stays in the model dtype, the quantized head is written as ``lm_head.*``
    quantize_lm_head: bool | None = None
    # with quantize_lm_head, a dense method: the head's inlier bits; None: ``bits``
    lm_head_bits: int | None = None
    # mixture-of-experts: an expert routed fewer calibration tokens than this gets its Hessians
    # blended with all the block's tokens (quantize/moe.py); route_all: every token through every expert
    moe_min_tokens: int = 128
    moe_route_all: bool = False
    # per-input-column scales c ∝ D^power folded into the norms feeding q/k/v and gate/up
    # ("norm", quantize/column_scales.py; free at serving time) or "none"
    column_scales: str = "none"
    column_scale_power: float = 0.5
    # bytes of calibration activations kept in memory; more are spilled to the run directory
    # (None: half the memory available at the start). Does not change the checkpoint.
    max_activation_memory: int | None = None
    # target correction (after Qronos, quantize/target_correction.py): each block linear solved
    # against W′ fitting the full-precision outputs; a second activation stream, one more forward
    target_correction: bool = False
    # second-level scales (format/scale_codes.py): dense group scales stored and served as codes
    # of this many bits on 16-row grids; None: fp16 scales
    scale_bits: int | None = None
    # incoherence processing: every quantized linear's input rotated by a seeded random-sign block
    # Hadamard ("hadamard", format/rotation.py), the integers solved in that frame; "none": no rotation;
    # None: the method's default (default_rotation)
    rotate: str | None = None
    rotate_seed: int = 0
    # the lattice decoder (algorithms/decoders.py) of gptq/babai/ssqr/hptq: "babai" (the nearest plane
    # GPTQ is), "kbest" (a beam of `beam` paths) or "klein" (`beam` random draws); never farther than babai
    decoder: str = "babai"
    beam: int = 4
    # set by __post_init__: the head is quantized by default, not asked for (a head it cannot take is kept)
    lm_head_default: bool = dataclasses.field(default=False, init=False)

    def __post_init__(self):
        _require(self.method in fmt.METHODS, "method", f"one of {', '.join(fmt.METHODS)}", self.method)
        if self.group_size is None:
            self.group_size = default_group_size(self.method)
        if self.rotate is None:
            self.rotate = default_rotation(self.method)
        self._check_method_options()
        self._check_calibration_options()
        self._check_head_options()
        # the format's own rules last: a quantization_config these options cannot write is refused now
        self.quantization_config([], "lm_head" if self.quantize_lm_head else None)

    def _check_method_options(self) -> None:
        if self.kind == "dense":
            _require(_is_int(self.bits) and self.bits in INLIER_BITS, "bits", "an integer in 2..8", self.bits)
            _require(_is_int(self.group_size) and 1 <= self.group_size <= MAX_GROUP_SIZE, "group_size",
                     f"an integer in 1..{MAX_GROUP_SIZE} (the format's widest group; one at least a row wide is one "
                     "scale per row)", self.group_size)
        if self.method == "ssqr":
            _require(_is_number(self.outlier_rate) and 0 <= self.outlier_rate < 1, "outlier_rate", "in [0, 1)",
                     self.outlier_rate)
        if self.kind == "codebook":
            _require(_is_int(self.bits) and self.bits in CODEBOOKS, "bits",
                     f"one of {', '.join(map(str, CODEBOOKS))} for {self.method}", self.bits)
            _require(_is_int(self.group_size) and self.group_size >= 1 and self.group_size % CODEBOOK_BLOCK == 0,
                     "group_size", f"a positive multiple of {CODEBOOK_BLOCK} for {self.method} (whole blocks)",
                     self.group_size)
        if self.kind == "huffman":
            _require(_is_number(self.target_bits) and 1 < self.target_bits <= MAX_TARGET_BITS, "target_bits",
                     f"in (1, {MAX_TARGET_BITS:g}] bits/weight for {self.method}", self.target_bits)
        _require(self.order in ORDERS, "order", f"one of {', '.join(ORDERS)}", self.order)
        _require(_is_number(self.damp) and self.damp >= 0, "damp", ">= 0", self.damp)
        if self.scale_bits is not None:
            if self.method not in CODED_SCALE_METHODS:
                raise ValueError(f"scale_bits is for {', '.join(CODED_SCALE_METHODS[:-1])} and "
                                 f"{CODED_SCALE_METHODS[-1]} (their group scales), not {self.method}")
            _require(self.scale_bits in CODE_BITS, "scale_bits", f"one of {CODE_BITS}", self.scale_bits)
        self._check_lattice_options()
        if self.kind == "codebook":
            _require(self.order in E8_ORDERS, "order", f"one of {', '.join(E8_ORDERS)} for {self.method} (blocks of "
                     "eight neighbouring columns)", self.order)
            if self.rotate == "none":   # the codebooks are balls shaped for rotated, Gaussian-like blocks
                raise ValueError(f"method {self.method} needs a rotation: leave --rotate out or give --rotate "
                                 "hadamard")

    def _check_lattice_options(self) -> None:
        kinds = ("none",) + fmt.rotation.KINDS
        _require(self.rotate in kinds, "rotate", f"one of {', '.join(kinds)}", self.rotate)
        _require(_is_int(self.rotate_seed) and 0 <= self.rotate_seed < INT64, "rotate_seed", "an integer in "
                 "[0, 2^63)", self.rotate_seed)
        _require(self.decoder in DECODERS, "decoder", f"one of {', '.join(DECODERS)}", self.decoder)
        _require(_is_int(self.beam) and 1 <= self.beam <= MAX_BEAM, "beam", f"an integer in 1..{MAX_BEAM}", self.beam)
        if self.decoder != "babai" and self.method not in DECODED_METHODS:
            methods = f"{', '.join(DECODED_METHODS[:-1])} and {DECODED_METHODS[-1]}"
            raise ValueError(f"decoder {self.decoder} is for {methods}, not {self.method}")

    def _check_calibration_options(self) -> None:
        _require(_is_int(self.nsamples) and self.nsamples >= 1, "nsamples", "a positive integer", self.nsamples)
        _require(_is_int(self.seqlen) and self.seqlen >= 1, "seqlen", "a positive integer", self.seqlen)
        cpu_features.compute_device(self.device, "device", here=False)   # whether it is there: at the run
        _require(self.compute_dtype in COMPUTE_DTYPES, "compute_dtype", f"one of {', '.join(COMPUTE_DTYPES)}",
                 self.compute_dtype)
        _require(self.max_activation_memory is None or self.max_activation_memory >= 0, "max_activation_memory",
                 ">= 0 bytes", self.max_activation_memory)
        _require(_is_int(self.moe_min_tokens) and 1 <= self.moe_min_tokens < INT64, "moe_min_tokens",
                 "an integer in [1, 2^63)", self.moe_min_tokens)
        _require(_is_int(self.seed) and -INT64 <= self.seed < INT64, "seed", "an integer in [-2^63, 2^63)", self.seed)
        folds = ("none",) + fmt.COLUMN_SCALE_FOLDS
        _require(self.column_scales in folds, "column_scales", f"one of {', '.join(folds)}", self.column_scales)
        _require(_is_number(self.column_scale_power) and self.column_scale_power >= 0, "column_scale_power",
                 ">= 0", self.column_scale_power)
        if self.column_scales != "none" and not self.calibrated:
            raise ValueError(f"column_scales needs a calibrated method (computed from the Hessian), not {self.method}")
        if self.target_correction and not self.calibrated:
            raise ValueError(f"target_correction needs a calibrated method (a Hessian), not {self.method}")
        if self.target_correction and self.column_scales != "none":   # folds need the whole block's Hessians at once
            raise ValueError("target_correction and column_scales cannot be combined (yet)")

    def _check_head_options(self) -> None:
        if self.quantize_lm_head is None:   # the default, resolved here
            self.lm_head_default = self.lm_head_bits is None and self.kind == "dense"
            self.quantize_lm_head = self.lm_head_bits is not None or self.lm_head_default
            self.lm_head_bits = DEFAULT_LM_HEAD_BITS if self.lm_head_default else self.lm_head_bits
        if self.lm_head_bits is None:
            return
        if not self.quantize_lm_head:
            raise ValueError("lm_head_bits needs quantize_lm_head (the head is otherwise kept unquantized)")
        if self.kind != "dense":
            raise ValueError(f"lm_head_bits is for the dense methods, not {self.method}")
        _require(_is_int(self.lm_head_bits) and self.lm_head_bits in INLIER_BITS, "lm_head_bits",
                 "an integer in 2..8", self.lm_head_bits)

    @property
    def kind(self) -> str:
        return fmt.kind_of(self.method)

    @property
    def rotation(self) -> fmt.Rotation | None:
        return None if self.rotate == "none" else fmt.Rotation(self.rotate_seed)

    @property
    def calibrated(self) -> bool:
        """RTN and HRTN never look at activations: their pipeline runs no calibration forwards."""
        return self.method not in UNCALIBRATED

    def torch_compute_dtype(self, source_config: dict) -> torch.dtype:
        """The calibration forwards' dtype for a source with config.json ``source_config``."""
        if self.compute_dtype != "auto":
            return COMPUTE_DTYPES[self.compute_dtype]
        model = torch.bfloat16 if hf_model.model_dtype(source_config) == "bfloat16" else torch.float32
        chosen = model if torch.device(self.device).type != "cpu" else cpu_features.fastest_float(model)
        if chosen != model:
            log.info("calibration forwards in fp32: this CPU (%s) emulates bf16 (--compute-dtype bfloat16 "
                     "to force it)", cpu_features.capability())
        return chosen

    def solver_kwargs(self) -> dict:
        m = self.method
        decoded = {} if self.decoder == "babai" else {"decoder": self.decoder, "beam": self.beam}
        if m == "ssqr":
            return dict(bits=self.bits, group_size=self.group_size, outlier_rate=self.outlier_rate,
                        order=self.order, damp=self.damp, **decoded)
        if m == "hptq":
            return dict(target_bits=self.target_bits, order=self.order, damp=self.damp, **decoded)
        if m == "hrtn":
            return dict(target_bits=self.target_bits)
        if m == "e8":
            return dict(bits=self.bits, group_size=self.group_size, order=self.order, damp=self.damp,
                        scale_bits=self.scale_bits)
        coded = {} if self.scale_bits is None else {"scale_bits": self.scale_bits}
        if m == "rtn":
            return dict(bits=self.bits, group_size=self.group_size, **coded)
        # gptq and babai: the clipped baselines (babai = clipped Babai ≡ GPTQ in reversed order)
        return dict(bits=self.bits, group_size=self.group_size, order=self.order, damp=self.damp, clip=True, **coded,
                    **decoded)

    def quantization_config(self, modules_not_converted, head_name: str | None = None,
                            compute_dtype: torch.dtype | None = None, moe: bool = False) -> dict:
        """The checkpoint's ``quantization_config`` (``compute_dtype``: the forwards' dtype, recorded
        with the calibration, as the experts' calibration options for a mixture-of-experts model)."""
        calibration = None
        if self.calibrated:
            calibration = {**data.source_record(self.calib, "calibration"), "nsamples": self.nsamples,
                           "seqlen": self.seqlen, "seed": self.seed}
            if compute_dtype is not None:
                calibration["compute_dtype"] = str(compute_dtype).removeprefix("torch.")
            if moe:
                calibration.update(moe_min_tokens=self.moe_min_tokens, moe_route_all=self.moe_route_all)
        return fmt.quantization_config(
            self.method, bits=self.bits, group_size=self.group_size, outlier_rate=self.outlier_rate,
            target_bits=self.target_bits, order=self.order, damp=self.damp,
            modules_not_converted=modules_not_converted,
            layer_bits={head_name: self.lm_head_bits} if head_name and self.lm_head_bits else None,
            column_scales=None if self.column_scales == "none" else {"fold": self.column_scales,
                                                                     "power": self.column_scale_power},
            scale_bits=self.scale_bits, rotation=self.rotation, calibration=calibration,
            **({"lm_head_quantized": True} if head_name else {}),
            **({"target_correction": True} if self.target_correction else {}),
            **({"decoder": {"name": self.decoder, "beam": self.beam}} if self.decoder != "babai" else {}))

    def head_options(self) -> "QuantizeOptions":
        """The options the output head is quantized with (``lm_head_bits`` as its ``bits``)."""
        return self if self.lm_head_bits is None else dataclasses.replace(self, bits=self.lm_head_bits)

    def fingerprinted(self, forward_dtype: torch.dtype) -> dict:
        """What of these options a resume must find unchanged: all but where the run happens (the
        device, the activations' memory budget), plus the forwards' dtype "auto" resolved to."""
        options = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("device", "max_activation_memory")}
        options["forward_dtype"] = str(forward_dtype)   # "auto" resolves per machine: a resume must not mix them
        return options
