"""The offline pipeline: a Hugging Face causal LM → a latq checkpoint, block by block.

Sequential calibration (the standard GPTQ pipeline), :func:`quantize_model`: the inputs of
decoder block 0 are captured once (:mod:`.capture`); then each block is loaded alone
(:mod:`.source`), its linears' Hessians ``XᵀX`` accumulated over the calibration sequences
(:mod:`.calibrate`), every linear solved and replaced by its dequantized result
(:mod:`.solve_layers`), the *quantized* block run again to give the next block's inputs, and
its shard written with the activations for ``--resume`` (:mod:`.resume`); then the output head,
if asked (:mod:`.head`), and the rest of the checkpoint (:mod:`.finalize`). With
``target_correction`` a second, full-precision stream runs beside the first and Hessians and
solves alternate group by group (:func:`~.calibrate.target_corrected_stages`). RTN and HRTN
ignore activations: no calibration forwards, they quantize at the speed of reading the
weights. Under ``torchrun`` the ranks split the forwards and the solves (:mod:`.ranks`).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
import signal
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import torch

from .. import cpu_features, hf_model
from ..format import writer
from .. import data
from .. import format as fmt
from ..algorithms import lattice
from . import heap, ranks
from .calibrate import block_hessians, drop_stream, full_precision_stream, sum_over_ranks, target_corrected_stages
from .capture import block_inputs, block_outputs
from .column_scales import fold_block
from .finalize import checkpoint_config, finalize
from .head import head_plan, quantize_head
from . import solve_layers as solving
from .output import check_output
from .resume import PROGRESS_FILE, TMP_SUFFIX, fingerprint, run_directory
from .solve_layers import Solve, solve  # noqa: F401  (solve: the default per-layer solver)
from .source import open_source, resolve_model

log = logging.getLogger("vllm_latq.quantize")

UNCALIBRATED = ("rtn", "hrtn")  # solvers that ignore H
STOP_ENV = "LATQ_STOP_AFTER_BLOCK"  # testing: raise SimulatedInterruption after this block
FAULT_ENV = "LATQ_FAULT"  # testing: "RANK:LAYER_SUBSTRING:raise|kill" fails that rank at that layer's solve
COMPUTE_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}
# The column orders offered: the format's, without "reverse" — the solvers' frame-literal flip
# of "natural" that states the GPTQ ≡ Babai identity (gptq(order="reverse") ≡ babai(order=
# "natural")), not a column-order heuristic of its own.
ORDERS = tuple(o for o in lattice.ORDERS if o != "reverse")

__all__ = ["quantize_model", "QuantizeOptions", "DEFAULT_METHOD", "default_group_size", "resolve_model", "solve",
           "SimulatedInterruption", "ORDERS",
           "COMPUTE_DTYPES", "UNCALIBRATED", "STOP_ENV", "TMP_SUFFIX", "PROGRESS_FILE"]


class SimulatedInterruption(RuntimeError):
    """Raised after block k when ``stop_after_block=k`` (or ``$LATQ_STOP_AFTER_BLOCK=k``)."""


# The defaults the study chose (docs/RESULTS.md): GPTQ 4-bit at group 64 serves fewer
# bits than SSQR-1 % at group 128 with a lower perplexity on both reference models and both
# kernel families; the methods with outliers or one scale keep group 128, where a smaller
# group does not pay (docs/KERNELS.md, accuracy levers: e).
DEFAULT_METHOD = "gptq"
DEFAULT_GROUP_SIZE = {"gptq": 64, "babai": 64, "rtn": 64}   # other methods: 128


def default_group_size(method: str) -> int:
    return DEFAULT_GROUP_SIZE.get(method, 128)


# the output head's inlier bits by default (dense methods): free in perplexity on both reference
# models at half the bytes of bf16 (docs/RESULTS.md, the decision rule and its measurements)
DEFAULT_LM_HEAD_BITS = 8

# HPTQ's target: past 8 bits/weight a Huffman-coded layer outgrows an 8-bit dense one
MAX_TARGET_BITS = 8.0


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
    # dtype GPTQ implementations run in, faster than fp32 where bf16 is native) — but fp32 on a
    # CPU that only emulates bf16 — and fp32 for fp16/fp32 sources. Weights are solved in fp32
    # and Hessians summed in fp64 either way.
    compute_dtype: str = "auto"
    # the output head (lm_head): True quantizes it with the same method, False keeps it in the model
    # dtype; None (default): dense methods quantize it with DEFAULT_LM_HEAD_BITS-bit inliers, others
    # keep it, as does a model whose head cannot be quantized. A tied head is untied: the embedding
    # stays in the model dtype, the quantized head is written as ``lm_head.*``
    quantize_lm_head: bool | None = None
    # with quantize_lm_head, a dense method: the head's inlier bits; None: ``bits`` like every other layer
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
    # target correction (after Qronos): solve each block linear against W′ fitting the full-precision
    # outputs (hessian.qronos_target); a second activation stream (its own memory budget), one more forward
    target_correction: bool = False
    # second-level scales (format/scale_codes.py): dense group scales stored and served
    # as codes of this many bits on 16-row grids (6 bits per scale instead of 16); None: fp16 scales
    scale_bits: int | None = None
    # set by __post_init__: the head is quantized by default, not asked for (a head it cannot take is kept)
    lm_head_default: bool = dataclasses.field(default=False, init=False)

    def __post_init__(self):
        """The pipeline's own rules; what the checkpoint's ``quantization_config`` allows (method,
        bits, group size, budgets, lm_head_bits as a layer's bits) is checked by the format, now."""
        if self.group_size is None:
            self.group_size = default_group_size(self.method)
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {self.order!r}")
        if self.damp < 0:
            raise ValueError(f"damp must be >= 0, got {self.damp}")
        if self.max_activation_memory is not None and self.max_activation_memory < 0:
            raise ValueError(f"max_activation_memory must be >= 0 bytes, got {self.max_activation_memory}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute dtype must be one of {sorted(COMPUTE_DTYPES)}, got {self.compute_dtype!r}")
        if self.moe_min_tokens < 1:
            raise ValueError(f"moe_min_tokens must be >= 1, got {self.moe_min_tokens}")
        if self.column_scales not in ("none",) + fmt.COLUMN_SCALE_FOLDS:
            raise ValueError(f"column_scales must be one of none, {', '.join(fmt.COLUMN_SCALE_FOLDS)}, "
                             f"got {self.column_scales!r}")
        if self.target_correction and not self.calibrated:
            raise ValueError(f"target_correction needs a calibrated method (a Hessian), not {self.method}")
        if self.target_correction and self.column_scales != "none":   # folds need the whole block's Hessians at once
            raise ValueError("target_correction and column_scales cannot be combined (yet)")
        if self.scale_bits is not None and self.method not in ("gptq", "rtn", "babai"):
            raise ValueError(f"scale_bits is for gptq, rtn and babai (their group scales), not {self.method}")
        if self.kind == "huffman" and not 1.0 < self.target_bits <= MAX_TARGET_BITS:
            raise ValueError(f"target_bits must be in (1, {MAX_TARGET_BITS:g}] bits/weight for {self.method}, got "
                             f"{self.target_bits:g}")
        if self.quantize_lm_head is None:   # the default, resolved here
            self.lm_head_default = self.lm_head_bits is None and self.kind == "dense"
            self.quantize_lm_head = self.lm_head_bits is not None or self.lm_head_default
            self.lm_head_bits = DEFAULT_LM_HEAD_BITS if self.lm_head_default else self.lm_head_bits
        if self.lm_head_bits is not None and not self.quantize_lm_head:
            raise ValueError("lm_head_bits needs quantize_lm_head (the head is otherwise kept unquantized)")
        try:
            self.quantization_config([], "lm_head" if self.quantize_lm_head else None)
        except fmt.FormatError as e:
            raise ValueError(_in_option_names(str(e))) from None

    @property
    def kind(self) -> str:
        return fmt.kind_of(self.method)

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
        if m == "ssqr":
            return dict(bits=self.bits, group_size=self.group_size, outlier_rate=self.outlier_rate,
                        order=self.order, damp=self.damp)
        if m == "hptq":
            return dict(target_bits=self.target_bits, order=self.order, damp=self.damp)
        if m == "hrtn":
            return dict(target_bits=self.target_bits)
        coded = {} if self.scale_bits is None else {"scale_bits": self.scale_bits}
        if m == "rtn":
            return dict(bits=self.bits, group_size=self.group_size, **coded)
        # gptq and babai: the clipped baselines (babai = clipped Babai ≡ GPTQ in reversed order)
        return dict(bits=self.bits, group_size=self.group_size, order=self.order, damp=self.damp, clip=True, **coded)

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
            scale_bits=self.scale_bits, calibration=calibration, **({"lm_head_quantized": True} if head_name else {}),
            **({"target_correction": True} if self.target_correction else {}))

    def head_options(self) -> "QuantizeOptions":
        """The options the output head is quantized with (``lm_head_bits`` as its ``bits``)."""
        return self if self.lm_head_bits is None else dataclasses.replace(self, bits=self.lm_head_bits)


def _in_option_names(msg: str) -> str:
    """The format's complaint about the ``quantization_config`` these options would write, in
    the options' names (``quantization_config.bits`` → ``bits``, its ``layer_bits`` → ``lm_head_bits``)."""
    msg = re.sub(r"^file [^:]*: ", "", msg)
    msg = re.sub(r"quantization_config\.layer_bits(\[[^\]]*\])?", "lm_head_bits", msg)
    return msg.replace("quantization_config.", "")


def quantize_model(model: str | os.PathLike, out: str | os.PathLike, opts: QuantizeOptions | None = None, *,
                   solve: Solve | None = None, resume: bool = False, overwrite: bool = False,
                   progress: bool = True, on_layer: Callable | None = None, stop_after_block: int | None = None,
                   on_block: Callable[[int, float], None] | None = None, validate: bool = True) -> Path:
    """Quantize ``model`` (see :func:`resolve_model`) into the checkpoint directory ``out``.

    ``solve(method, W, H, name, **kw) -> QuantResult`` replaces the per-layer solver call
    (default: :func:`.solve_layers.solve`). ``on_layer(name, W, H, result)`` is called for every
    quantized linear (tests), ``on_block(i, seconds)`` once block i is persisted (benches).
    ``stop_after_block=k`` raises :class:`SimulatedInterruption` once block k is persisted
    (default: ``$LATQ_STOP_AFTER_BLOCK``), to test ``resume``. Returns ``out``.

    Started by ``torchrun`` with several ranks (:mod:`.ranks`), every rank runs this with the
    same arguments: each forwards its share of the calibration sequences, the statistics are
    summed over ranks, each solve runs on one rank and is shared, rank 0 writes.

    Everything is deterministic: the same source, options and seed give a byte-identical
    checkpoint, with or without an interruption, at the same torch thread count and number of
    ranks (the last bits of activations and sums depend on both). The calibration forwards run in
    the model's dtype (bf16 for a bf16 model, as GPTQ runs), or fp32 on a CPU that only emulates
    bf16; the solvers work in fp32 on the exact weights, the Hessians are summed in fp64."""
    opts, out = opts or QuantizeOptions(), Path(out)
    world = ranks.init(opts.device)
    try:
        ranks.check_same_command({"model": str(model), "out": str(out.absolute()), "options": dataclasses.asdict(opts),
                                  "resume": resume, "overwrite": overwrite, "validate": validate}, world)
        ranks.announce(world)
        return _quantize(model, out, opts, solve or solving.solve, resume, overwrite, progress and world.writes,
                         on_layer, stop_after_block, on_block, validate, world)
    except Exception as e:
        lost = ranks.lost_rank(e) if world.distributed else None
        if lost is not None:
            raise lost from e
        raise
    finally:
        ranks.shutdown(world)


def _quantize(model, out: Path, opts: QuantizeOptions, solve: Solve, resume: bool, overwrite: bool, progress: bool,
              on_layer, stop_after_block, on_block, validate: bool, world: ranks.World) -> Path:
    from tqdm.auto import tqdm

    t_start = time.time()
    heap.return_freed_memory()
    if stop_after_block is None and os.environ.get(STOP_ENV):
        stop_after_block = int(os.environ[STOP_ENV])
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists (pass overwrite=True / --overwrite to replace it)")
    if opts.calibrated and opts.nsamples < world.size:
        raise ValueError(f"nsamples ({opts.nsamples}) is below the number of ranks ({world.size}): each rank "
                         "forwards at least one calibration sequence")
    with data.hf_progress_bars(progress):   # a GGUF source is converted here, with transformers' bars
        src = open_source(model, opts.torch_compute_dtype)
    head = _head_plan(src, opts)
    head_name = head.name if head else None
    not_converted = src.modules_not_converted(head_name)
    with ranks.together("checking the output directory", world):
        if world.writes:
            check_output(out, src.path, overwrite)
    run_key = _fingerprint(opts, src.path, list(src.weights.handles), src.raw_config, src.dtype)
    with run_directory(out, run_key, resume, world) as run:
        device = torch.device(opts.device)
        calib = _calibration_text(src.path, opts)
        if calib is not None and calib.numel() < src.config.hidden_size and world.writes:
            log.warning("calibration: %d tokens, fewer than the %d columns of the linears that read the hidden "
                        "state: their H is singular but for the damping and the integers follow its last bits "
                        "(another thread or rank count gives others); raise --nsamples or --seqlen",
                        calib.numel(), src.config.hidden_size)
        if calib is not None:   # the capture pass runs the embeddings (block_inputs drops them)
            src.load(src.outside_tensors(), device)
        acts, kwargs = block_inputs(src.net, src.layers, src.config.hidden_size, src.dtype, calib, run, device,
                                    opts.max_activation_memory, progress,
                                    ranks.own_rows(len(calib), world) if calib is not None else None, world)
        targets = full_precision_stream(acts, opts.max_activation_memory) if opts.target_correction else None
        per_layer = dict(method=opts.method, solve=_with_fault(solve, world), stats=run.stats, on_layer=on_layer)
        quantize = partial(solving.quantize_linear, solver_kwargs=opts.solver_kwargs(), **per_layer)
        solve_block = partial(solving.solve_block, weight=src.linear_weight, expert_weight=src.expert_weight,
                              names=src.names, dtype=src.dtype, device=device, progress=progress, stats=run.stats,
                              moe_min_tokens=opts.moe_min_tokens, moe_route_all=opts.moe_route_all, world=world)

        bar = tqdm(range(run.blocks_done, src.nblocks), desc=f"{opts.method} blocks", unit="block",
                   disable=not progress, initial=run.blocks_done, total=src.nblocks)
        for i in bar:
            layer, block_name, desc = src.layers[i], f"{src.prefix}.{i}", f"block {i}"
            if opts.calibrated:   # the forwards need the block; an uncalibrated solve reads each weight alone
                src.load(src.block_tensors(i), device)
            linears = src.block_linears(i)
            kw = _to_device(kwargs[i], device) if opts.calibrated else None
            t0 = time.time()
            folding = None
            if targets is not None:   # Hessians and solves interleaved, group by group (calibrate.py)
                shard = {}
                for names, hessians, last in target_corrected_stages(layer, linears, acts, targets, kw, desc, progress):
                    sum_over_ranks(hessians, world)
                    quantize_group = solving.target_corrected(quantize, {src.names.module(n): c for n, c in
                                                                         hessians.cross_of.items()}, opts.damp)
                    shard.update(solve_block(layer, block_name, desc, {n: linears[n] for n in names},
                                             src.block_experts(i) if last else {}, hessians, quantize_group))
                t1 = t0
            else:
                hessians = None
                if opts.calibrated:
                    with ranks.together(f"{desc}: Hessians", world):
                        hessians = block_hessians(layer, linears, acts, kw, desc, progress)
                    sum_over_ranks(hessians, world)
                t1 = time.time()
                if opts.column_scales != "none":
                    folding = fold_block(layer, block_name, linears, hessians.of, acts[:1], kw,
                                         power=opts.column_scale_power, order=opts.order, damp=opts.damp,
                                         stored=src.weights.get)
                quantize_block = quantize if folding is None else folding.wrap(quantize)
                shard = solve_block(layer, block_name, desc, linears, src.block_experts(i), hessians, quantize_block,
                                    write_back=opts.calibrated)
            hessians = None
            t2 = time.time()
            if opts.calibrated:
                with ranks.together(f"{desc}: outputs", world):
                    block_outputs(layer, acts, kw, desc, progress)
            log.info("block %d/%d: Hessians %.1fs, quantization %.1fs, outputs %.1fs", i, src.nblocks, t1 - t0,
                     t2 - t1, time.time() - t2)
            shard.update(src.kept_block_tensors(i, linears))
            shard.update(folding.norm_tensors if folding else {})
            run.save_block(i, writer.shard_name(i, src.nblocks + 1), shard, acts, targets)
            shard = None   # written: the next block's tensors replace it
            hf_model.to_meta(layer)
            heap.trim()
            if on_block is not None:
                on_block(i, time.time() - t0)
            if stop_after_block is not None and i == stop_after_block:
                raise SimulatedInterruption(f"simulated interruption after block {i}")
        bar.close()

        if targets is not None:
            drop_stream(targets)
            if head is not None:
                log.info("target correction: the output head is solved against its own weight")
        head_tensors = {} if head is None else quantize_head(src.net, src.weights, head, acts, partial(
            solving.quantize_linear, solver_kwargs=opts.head_options().solver_kwargs(), **per_layer), device, progress,
            world)
        del acts
        qc = opts.quantization_config(not_converted, head_name, src.dtype, moe=bool(src.names.experts))
        with ranks.together("writing the checkpoint", world):
            if world.writes:
                config = checkpoint_config(src.raw_config, qc, untie_head=head is not None and src.tied)
                rest = {**src.outside_kept_tensors(head_name), **head_tensors}
                tot = finalize(run, out, src.path, src.nblocks, rest, config, opts.method, validate)
                log.info("wrote %s: %d layers, %.4f bits/weight, outliers %.3f%%, in %.0fs%s", out, tot["layers"],
                         tot["bits_per_weight"], 100 * tot["outlier_rate"], time.time() - t_start,
                         f" ({world.size} ranks)" if world.distributed else "")
    return out


def _with_fault(solve: Solve, world: ranks.World) -> Solve:
    """``solve``, failing as ``$LATQ_FAULT`` asks (tests of what the other ranks do then)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return solve
    rank, where, how = spec.split(":")

    def faulty(method, W, H, name, **kw):
        if int(rank) == world.rank and where in name:
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"fault injected by ${FAULT_ENV}")
        return solve(method, W, H, name, **kw)
    return faulty


def _head_plan(src, opts: QuantizeOptions):
    """Where the output head is, if it is quantized: asked for (a head it cannot quantize is an
    error) or by default (such a head is kept in the model dtype, said in the log)."""
    if not opts.quantize_lm_head:
        return None
    try:
        return head_plan(src.net, src.prefix, src.tied, src.weights)
    except hf_model.UnsupportedModelError as e:
        if not opts.lm_head_default:
            raise
        log.info("the output head stays in the model dtype: %s", e)
        return None


def _fingerprint(opts: QuantizeOptions, source: Path, files: list[str], config: dict, forward_dtype) -> str:
    """The resume fingerprint: the source (its directory, weight ``files`` and ``config``), the
    forwards' dtype and every option but where the run happens (the device, the activations'
    memory budget)."""
    options = {k: v for k, v in dataclasses.asdict(opts).items() if k not in ("device", "max_activation_memory")}
    options["forward_dtype"] = str(forward_dtype)   # "auto" resolves per machine: a resume must not mix them
    return fingerprint(source, options, files, config)


def _calibration_text(tokenizer_dir: Path, opts: QuantizeOptions) -> torch.Tensor | None:
    """The calibration token ids ``[nsamples, seqlen]`` (the tokenizer of ``tokenizer_dir``);
    None for a method that uses none."""
    if not opts.calibrated:
        if str(opts.calib) != "wiki":
            log.warning("%s uses no calibration data: ignoring --calib %s", opts.method, opts.calib)
        return None
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    return data.calibration_batches(tok, nsamples=opts.nsamples, seqlen=opts.seqlen, seed=opts.seed,
                                    source=opts.calib)


def _to_device(kwargs: dict, device) -> dict:
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
