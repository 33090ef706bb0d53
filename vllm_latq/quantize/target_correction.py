"""Target correction (after Qronos): each block linear solved against the ``W′`` mapping X̃ to XWᵀ,
its groups of linears calibrated true-sequentially (docs/KERNELS.md, "Accuracy levers")."""
from __future__ import annotations

import copy
import shutil
from typing import Callable, Iterator

from .. import hf_model
from ..progress import bar
from . import capture, ranks
from .activations import Activations
from .calibrate import SharedHessians, chunks_of, sum_over_ranks
from .hessian import CrossCovariance, qronos_target
from .ranks import World
from .solve_layers import Stage

TARGET_STREAM_DIR = "latq_target_stream"  # in the run directory, when the stream spills to disk


def target_corrected(quantize: Callable, cross: dict[str, CrossCovariance], damp: float) -> Callable:
    """``quantize(name, W, hessian)`` solving each linear named in ``cross`` against ``W′``."""
    def corrected(name, W, hessian, **kw):
        if name not in cross:
            return quantize(name, W, hessian, **kw)
        return quantize(name, qronos_target(W, hessian.H, cross[name].C, damp), hessian, **kw)
    return corrected


def corrected_stages(layer, linears: dict, experts: dict, inps: Activations, targets: Activations, kw: dict,
                     module_name: Callable[[str], str], quantize: Callable, damp: float, desc: str, progress: bool,
                     world: World) -> Iterator[Stage]:
    """The block's solves, one :class:`~.solve_layers.Stage` per group of ``linears``, solved in turn."""
    for names, hessians, last in target_corrected_stages(layer, linears, inps, targets, kw, desc, progress):
        sum_over_ranks(hessians, world)
        cross = {module_name(n): c for n, c in hessians.cross_of.items()}
        yield Stage({n: linears[n] for n in names}, experts if last else {}, hessians,
                    target_corrected(quantize, cross, damp))
        hessians = None


def target_corrected_stages(layer, linears: dict, inps: Activations, targets: Activations, kw: dict, desc: str,
                            progress: bool) -> Iterator[tuple[list[str], SharedHessians, bool]]:
    """Yield ``(names, hessians, last)`` per group of linears sharing an input, in forward order.
    X̃ comes from ``layer`` as quantized so far, X from an unquantized copy (the next block's X)."""
    original = copy.deepcopy(layer)
    name_in_layer = {id(m): n for n, m in layer.named_modules()}
    in_original = dict(original.named_modules())
    twins = {name: in_original[name_in_layer[id(m)]] for name, m in linears.items()}
    has_experts = bool(hf_model.expert_modules(layer))
    groups: list[list[str]] | None = None
    stage = 0
    while groups is None or stage < len(groups) + has_experts:
        names = list(linears) if groups is None else groups[stage] if stage < len(groups) else []
        last = groups is not None and stage == len(groups) + has_experts - 1
        hs = SharedHessians({n: linears[n] for n in names}, layer if last and has_experts else None,
                            {n: twins[n] for n in names}, chunks_of(inps))
        try:
            for j in bar(range(len(inps)), f"{desc}: Hessians {stage + 1}", progress, unit="seq"):
                if groups is not None or j > 0:   # the first forward of the block finds the groups
                    hs.stop_after = frozenset(hs.groups()[0] if groups is None else names)
                y = hs.record_targets(original, targets[j:j + 1], kw, stop=not last)
                hs.forward(layer, inps[j:j + 1], kw)
                hs.end_forward()
                if last:
                    targets.write(j, y[0])   # the sequence's X is not read again in this block
        finally:
            hs.remove()
        if groups is None:   # the first pass found the groups (the order their inputs were seen)
            groups = hs.groups()
            for g in groups[1:]:   # their statistics come from later stages: one block's worth less held
                hs.release(g[0])
            last = len(groups) == 1 and not has_experts
            if last:   # a single group: its outputs were not written; nothing is quantized yet
                for j in range(len(inps)):
                    targets.write(j, capture.run_block(original, targets[j:j + 1], kw)[0])
            yield groups[0], hs, last
        else:
            yield names, hs, last
        stage += 1
    targets.advance()   # its older inputs go once the block is saved (RunDir.save_block), as the first stream's


TARGET_STREAM_DIR = "latq_target_stream"  # in the run directory, when the stream spills to disk


def full_precision_stream(acts: Activations, budget: int | None) -> Activations:
    """Target correction's full-precision stream: a copy of block 0's inputs, or the saved one on resume."""
    run_dir = acts.run_dir / TARGET_STREAM_DIR
    if acts.block > 0:
        return Activations.resume(run_dir, acts.shape, acts.dtype, acts.device, budget, acts.block, acts.rows,
                                  acts.world)
    run_dir.mkdir(exist_ok=True)
    targets = Activations.create(run_dir, acts.shape, acts.dtype, acts.device, budget, acts.block - 1, acts.rows,
                                 acts.world)
    for j in range(len(acts)):
        targets.write(j, acts[j:j + 1][0])
    targets.advance()
    return targets


def drop_stream(targets: Activations) -> None:
    ranks.barrier(targets.world)
    if targets.world.writes:
        shutil.rmtree(targets.run_dir, ignore_errors=True)

