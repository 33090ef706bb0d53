"""The pipeline's steps, as methods of :class:`Steps` on the state they share.

:func:`~.pipeline.quantize_model` calls them in order; each meets the other ranks where :mod:`.ranks` says."""
from __future__ import annotations

import dataclasses
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

from .. import data, hf_model
from ..progress import bar
from ..format import writer
from . import heap, ranks
from .calibrate import block_hessians, sum_over_ranks
from .capture import block_inputs, block_outputs
from .column_scales import fold_block
from .faults import with_fault
from .finalize import checkpoint_config, finalize
from .head import HeadPlan, head_plan, quantize_head
from .head_size import keep_tied
from .hessian import sequences_per_product
from .options import QuantizeOptions
from .resume import RunDir, fingerprint
from .room import check_room
from .solve_layers import LayerSolver, Solve, Solved, SolveSetup, Stage, solve_block
from .source import Source, open_source
from .target_correction import corrected_stages, drop_stream, full_precision_stream

log = logging.getLogger("vllm_latq.quantize")


def open_checked(model, out: Path, opts: QuantizeOptions, overwrite: bool, progress: bool,
                 world: ranks.World) -> tuple[Source, HeadPlan | None]:
    """The source ``model`` opened, its head located; what cannot be quantized is refused first (OUT's
    rules: under its lock, :func:`.resume.held_output`)."""
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists (pass overwrite=True / --overwrite to replace it)")
    per = sequences_per_product(opts.nsamples, opts.seqlen)
    if opts.calibrated and -(-opts.nsamples // per) < world.size:
        raise ValueError(f"--nsamples {opts.nsamples} at --seqlen {opts.seqlen} makes {-(-opts.nsamples // per)} "
                         f"Hessian products of {per} sequence{'s' * (per > 1)}, the unit ranks split, fewer than "
                         f"the {world.size} ranks: raise --nsamples or run fewer ranks")
    with data.hf_progress_bars(progress):   # a GGUF source is converted here, with transformers' bars
        src = open_source(model, opts.torch_compute_dtype, progress)
    head = _head_plan(src, opts)
    check_room(src, head, opts, out)
    return src, head


def _head_plan(src: Source, opts: QuantizeOptions) -> HeadPlan | None:
    """Where the output head is, if it is quantized: asked for (a head it cannot quantize is an
    error) or by default (such a head, or a tied one whose copy would outgrow the source, is kept in
    the model dtype, said in the log)."""
    if not opts.quantize_lm_head:
        return None
    try:
        plan = head_plan(src.net, src.prefix, src.tied, src.weights)
    except hf_model.UnsupportedModelError as e:
        if not opts.lm_head_default:
            raise
        log.info("the output head stays in the model dtype: %s", e)
        return None
    # asked for, a tied head is untied whatever it costs; by default only where the checkpoint stays smaller
    return None if src.tied and opts.lm_head_default and keep_tied(src, plan, opts) else plan


def run_fingerprint(opts: QuantizeOptions, src: Source) -> str:
    """The resume fingerprint: the source (the bytes of its weight and tokenizer files, its config), the
    calibration text's bytes, the options."""
    texts = {"calib": data.text_file(opts.calib)} if opts.calibrated else {}
    return fingerprint(src.path, opts.fingerprinted(src.dtype), [*src.weights.handles, *writer.aux_files(src.path)],
                       src.raw_config, texts)


@dataclass
class Block:
    """Decoder block ``i`` on its way through the steps: module, linears, experts, forward kwargs, results."""
    i: int
    layer: torch.nn.Module
    name: str
    linears: dict[str, torch.nn.Linear]
    experts: dict[str, dict[str, hf_model.ExpertLinear]]
    kw: dict | None
    solved: Solved = field(default_factory=Solved)
    norm_tensors: dict = field(default_factory=dict)   # norm weights with column scales folded in
    seconds: dict = field(default_factory=dict)        # per step, for the log
    started: float = field(default_factory=time.time)

    @property
    def desc(self) -> str:
        return f"block {self.i}"

    @property
    def elapsed(self) -> float:
        return time.time() - self.started


@contextmanager
def _timed(block: Block, step: str):
    t0 = time.time()
    try:
        yield
    finally:
        block.seconds[step] = block.seconds.get(step, 0.0) + time.time() - t0


class Steps:
    """One run's steps on ``src`` into ``run``, with ``solve`` the per-layer solver."""

    def __init__(self, src: Source, head: HeadPlan | None, opts: QuantizeOptions, run: RunDir, solve: Solve,
                 on_layer: Callable | None, progress: bool, world: ranks.World):
        self.src, self.head_plan, self.opts, self.run, self.progress, self.world = src, head, opts, run, progress, world
        self.device = torch.device(opts.device)
        self.solver = LayerSolver(opts.method, opts.solver_kwargs(), with_fault(solve, world), on_layer,
                                  opts.rotation)
        self.setup = SolveSetup(src.linear_weight, src.expert_weight, src.names, src.dtype, self.device,
                                opts.calibrated, opts.moe_min_tokens, opts.moe_route_all,
                                ranks.Scheduler(world, Solved.portable), progress)
        self.acts = self.kwargs = self.targets = None
        self.started = time.time()

    def capture(self) -> None:
        """Block 0's inputs (resuming: the first block to do's) and every block's forward kwargs."""
        calib = calibration_text(self.src.tokenizer, self.opts, self.src.net.get_input_embeddings().num_embeddings)
        if calib is not None and calib.numel() < self.src.config.hidden_size and self.world.writes:
            log.warning("calibration: %d tokens, fewer than the %d columns of the linears that read the hidden "
                        "state: their H is singular but for the damping and the integers follow its last bits "
                        "(another thread count gives others); raise --nsamples or --seqlen",
                        calib.numel(), self.src.config.hidden_size)
        if calib is not None:   # the capture pass runs the embeddings (block_inputs drops them)
            self.src.load(self.src.outside_tensors(), self.device)
        rows = ranks.own_rows(len(calib), self.world, sequences_per_product(*calib.shape)) \
            if calib is not None else None
        self.acts, self.kwargs = block_inputs(self.src.net, self.src.layers, self.src.config.hidden_size,
                                              self.src.dtype, calib, self.run, self.device,
                                              self.opts.max_activation_memory, self.progress, rows, self.world)
        if self.opts.target_correction:
            self.targets = full_precision_stream(self.acts, self.opts.max_activation_memory)

    def remaining(self) -> Iterable[int]:
        """The blocks still to quantize, with a progress bar."""
        return bar(range(self.run.blocks_done, self.src.nblocks), f"{self.opts.method} blocks", self.progress,
                   unit="block", leave=True, initial=self.run.blocks_done, total=self.src.nblocks)

    def load(self, i: int) -> Block:
        """Block ``i``, its weights loaded when forwards run through it."""
        if self.opts.calibrated:
            self.src.load(self.src.block_tensors(i), self.device)
        kw = _to_device(self.kwargs[i], self.device) if self.opts.calibrated else None
        return Block(i, self.src.layers[i], f"{self.src.prefix}.{i}", self.src.block_linears(i),
                     self.src.block_experts(i), kw)

    def calibrate(self, block: Block) -> Iterator[Stage]:
        """The block's solve stages: one, or with target correction one per group of linears."""
        stages = self._whole_block(block) if self.targets is None else corrected_stages(
            block.layer, block.linears, block.experts, self.acts, self.targets, block.kw, self.src.names.module,
            self.solver, self.opts.damp, block.desc, self.progress, self.world)
        while True:
            with _timed(block, "Hessians"):
                stage = next(stages, None)
            if stage is None:
                return
            yield stage
            stage = None

    def _whole_block(self, block: Block) -> Iterator[Stage]:
        hessians = None
        if self.opts.calibrated:
            with ranks.together(f"{block.desc}: Hessians", self.world):
                hessians = block_hessians(block.layer, block.linears, self.acts, block.kw, block.desc, self.progress)
            sum_over_ranks(hessians, self.world)
        quantize = self.solver
        if self.opts.column_scales != "none":
            folding = fold_block(block.layer, block.name, block.linears, hessians.of, self.acts[:1], block.kw,
                                 power=self.opts.column_scale_power, order=self.opts.order, damp=self.opts.damp,
                                 stored=self.src.weights.get)
            block.norm_tensors, quantize = folding.norm_tensors, folding.wrap(quantize)
        yield Stage(block.linears, block.experts, hessians, quantize)

    def solve(self, block: Block, stage: Stage) -> None:
        """Every linear and expert of ``stage`` solved and put into the block; its Hessians dropped after."""
        with _timed(block, "quantization"):
            solved = solve_block(block.layer, block.name, block.desc, stage, self.setup)
        stage.hessians = stage.quantize = None
        block.solved.tensors.update(solved.tensors)
        block.solved.records += solved.records

    def propagate(self, block: Block) -> None:
        """The quantized block run on every sequence: its outputs are the next block's inputs."""
        if self.opts.calibrated:
            with _timed(block, "outputs"), ranks.together(f"{block.desc}: outputs", self.world):
                block_outputs(block.layer, self.acts, block.kw, block.desc, self.progress)

    def save(self, block: Block) -> None:
        """The block's shard, its records and the next block's inputs; its weights back to the meta device."""
        log.info("block %d/%d: Hessians %.1fs, quantization %.1fs, outputs %.1fs", block.i, self.src.nblocks,
                 *(block.seconds.get(s, 0.0) for s in ("Hessians", "quantization", "outputs")))
        shard = {**block.solved.tensors, **self.src.kept_block_tensors(block.i, block.linears), **block.norm_tensors}
        self.run.stats.extend(block.solved.records)
        block.solved, block.norm_tensors = None, None   # written: the next block's tensors replace them
        self.run.save_block(block.i, writer.shard_name(block.i, self.src.nblocks + 1), shard, self.acts, self.targets)
        hf_model.to_meta(block.layer)
        heap.trim()

    def head(self) -> dict:
        """The output head's checkpoint tensors ({} unless quantized), solved on the last block's outputs."""
        if self.targets is not None:
            drop_stream(self.targets)
            self.targets = None
            if self.head_plan is not None:
                log.info("target correction: the output head is solved against its own weight")
        tensors = {}
        if self.head_plan is not None:
            solver = dataclasses.replace(self.solver, solver_kwargs=self.opts.head_options().solver_kwargs())
            tensors, records = quantize_head(self.src.net, self.src.weights, self.head_plan, self.acts, solver,
                                             self.device, self.progress, self.world)
            self.run.stats.extend(records)
        self.acts = None
        return tensors

    def finalize(self, out: Path, head_tensors: dict, validate: bool) -> None:
        """The rest of the checkpoint, written by rank 0, moved to ``out``."""
        head_name = self.head_plan.name if self.head_plan is not None else None
        quantization_config = self.opts.quantization_config(self.src.modules_not_converted(head_name), head_name,
                                                            self.src.dtype, moe=bool(self.src.names.experts))
        with ranks.together("writing the checkpoint", self.world):
            if self.world.writes:
                config_json = checkpoint_config(self.src.raw_config, quantization_config,
                                                untie_head=head_name is not None and self.src.tied)
                rest = {**self.src.outside_kept_tensors(head_name), **head_tensors}
                tot = finalize(self.run, out, self.src.path, self.src.nblocks, rest, config_json, self.opts.method,
                               validate, self.progress)
                log.info("wrote %s: %d layers, %.4f bits/weight, outliers %.3f%%, in %.0fs%s", out, tot["layers"],
                         tot["bits_per_weight"], 100 * tot["outlier_rate"], time.time() - self.started,
                         f" ({self.world.size} ranks)" if self.world.distributed else "")


def calibration_text(tokenizer, opts: QuantizeOptions, vocabulary: int) -> torch.Tensor | None:
    """The calibration token ids ``[nsamples, seqlen]`` by ``tokenizer``, each below ``vocabulary`` (the
    embedding's rows); None for a method that uses none."""
    if not opts.calibrated:
        if str(opts.calib) != "wiki":
            log.warning("%s uses no calibration data: ignoring --calib %s", opts.method, opts.calib)
        return None
    ids = data.calibration_batches(tokenizer, nsamples=opts.nsamples, seqlen=opts.seqlen, seed=opts.seed,
                                   source=opts.calib)
    data.check_vocabulary(ids, vocabulary, tokenizer)
    return ids


def _to_device(kwargs: dict, device) -> dict:
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
