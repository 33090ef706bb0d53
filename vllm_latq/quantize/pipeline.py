"""The offline pipeline: a Hugging Face causal LM → a latq checkpoint, one decoder block at a time,
each step a method of :class:`~.steps.Steps` (docs/ARCHITECTURE.md, section 1)."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Callable

from .. import cpu_features
from ..format.output_dir import absolute
from . import faults, heap, ranks, solve_layers
from .faults import STOP_ENV, SimulatedInterruption  # noqa: F401  (public names)
from .options import (COMPUTE_DTYPES, DEFAULT_METHOD, ORDERS, UNCALIBRATED, QuantizeOptions,  # noqa: F401
                      default_group_size)
from .finalize import place_sealed
from .resume import PROGRESS_FILE, TMP_SUFFIX, held_output, run_directory  # noqa: F401
from .solve_layers import Solve, solve
from .source import resolve_model  # noqa: F401
from .steps import Steps, open_checked, run_fingerprint

__all__ = ["quantize_model", "QuantizeOptions", "DEFAULT_METHOD", "default_group_size", "resolve_model", "solve",
           "SimulatedInterruption", "ORDERS", "COMPUTE_DTYPES", "UNCALIBRATED", "STOP_ENV", "TMP_SUFFIX",
           "PROGRESS_FILE"]


def quantize_model(model: str | os.PathLike, out: str | os.PathLike, opts: QuantizeOptions | None = None, *,
                   solve: Solve | None = None, resume: bool = False, overwrite: bool = False,
                   progress: bool = True, on_layer: Callable | None = None, stop_after_block: int | None = None,
                   on_block: Callable[[int, float], None] | None = None, validate: bool = True) -> Path:
    """Quantize ``model`` into the checkpoint directory ``out`` → ``out``; byte-identical run after run.
    ``solve`` replaces the per-layer solver, ``on_layer``/``on_block`` observe (tests, benches);
    ``stop_after_block=k`` raises :class:`SimulatedInterruption` once block k is saved."""
    opts, out = opts or QuantizeOptions(), absolute(out)   # OUT=. is the working directory, by name
    command = {"model": str(model), "out": str(out.absolute()), "options": dataclasses.asdict(opts),
               "resume": resume, "overwrite": overwrite, "validate": validate}
    stop_after_block = faults.stop_after(stop_after_block)
    faults.stage_fault()   # a malformed test hook is refused before any work
    cpu_features.compute_device(opts.device, "device")   # a GPU asked for is there, before the ranks meet on it
    with ranks.joined(opts.device, command) as world:
        progress = progress and world.writes
        heap.return_freed_memory()
        src, head = open_checked(model, out, opts, overwrite, progress, world)
        with held_output(out, src.path, overwrite, world) as claim, \
                run_directory(claim, out, run_fingerprint(opts, src), resume, world, overwrite=overwrite,
                              nblocks=src.nblocks) as run:
            if run.sealed is not None:   # a killed run of this command sealed it: moved, not computed again
                with ranks.together("moving the checkpoint into place", world):
                    if world.writes:
                        place_sealed(run, out, src.path, validate, progress)
                return out
            steps = Steps(src, head, opts, run, solve or solve_layers.solve, on_layer, progress, world)
            steps.capture()
            for i in steps.remaining():
                block = steps.load(i)
                for stage in steps.calibrate(block):
                    steps.solve(block, stage)
                steps.propagate(block)
                steps.save(block)
                if on_block is not None:
                    on_block(i, block.elapsed)
                faults.at("saved-block")
                faults.stop_if_asked(i, stop_after_block)
            steps.finalize(out, steps.head(), validate)
    return out
