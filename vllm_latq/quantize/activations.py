"""Calibration activations: the current block's inputs, one row per sequence, in memory or in files.

The pipeline's largest buffer, so the one budgeted (``--max-activation-memory``); after each
block the next block's inputs are on disk for ``--resume``."""
from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import torch

from .. import cpu_features
from ..errors import writing
from . import ranks
from .ranks import SINGLE, World

log = logging.getLogger("vllm_latq.quantize")

FILE_PREFIX = "latq_activations."
PART = ".part"  # a file being written: renamed once complete


def inputs_file(run_dir: Path, block: int) -> Path:
    """The saved inputs of decoder block ``block``."""
    return run_dir / f"{FILE_PREFIX}{block}.bin"


def remove_all(run_dir: Path) -> None:
    for p in run_dir.glob(FILE_PREFIX + "*"):
        p.unlink()


def default_budget(device: torch.device) -> int:
    """Half the memory available now (host RAM or a CUDA ``device``'s): the rest is the block's."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] // 2
    return cpu_features.available_memory() // 2


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


class Activations:
    """The inputs of block :attr:`block` for this rank's :attr:`rows`; ``x[j:j+1]`` is sequence ``j``."""

    def __init__(self, run_dir: Path, shape: tuple[int, int, int], dtype: torch.dtype, device, block: int,
                 on_disk: bool, rows: range | None = None, world: World = SINGLE):
        self.run_dir, self.shape, self.dtype, self.device = run_dir, tuple(shape), dtype, torch.device(device)
        self.block, self.on_disk, self.world = block, on_disk, world
        self.rows = range(self.shape[0]) if rows is None else rows
        self.row_bytes = _nbytes(self.shape[1:], dtype)
        self.nbytes = self.shape[0] * self.row_bytes   # the file: every rank's rows
        self.ram = None if on_disk else torch.empty((len(self.rows), *self.shape[1:]), dtype=dtype, device=self.device)
        self._out = None   # on disk: the next block's file being written (a file descriptor)

    @classmethod
    def create(cls, run_dir: Path, shape, dtype, device, budget: int | None, block: int = -1,
               rows: range | None = None, world: World = SINGLE) -> "Activations":
        """Empty activations of ``rows`` (default all), on disk when they exceed ``budget`` bytes."""
        device = torch.device(device)
        budget = default_budget(device) if budget is None else budget
        held = (shape[0] if rows is None else len(rows)) * _nbytes(shape[1:], dtype)
        acts = cls(run_dir, shape, dtype, device, block, on_disk=held > budget, rows=rows, world=world)
        if acts.on_disk:
            log.info("calibration activations %s (%d x %d x %d %s) exceed the memory budget %s: spilling them to "
                     "%s, read and written one sequence at a time", _gib(acts.nbytes), *acts.shape,
                     str(dtype).removeprefix("torch."), _gib(budget), run_dir)
        else:
            log.info("calibration activations: %s in memory (budget %s)", _gib(acts.nbytes), _gib(budget))
        return acts

    @classmethod
    def resume(cls, run_dir: Path, shape, dtype, device, budget: int | None, block: int,
               rows: range | None = None, world: World = SINGLE) -> "Activations":
        """The inputs of ``block`` saved by an interrupted run (see :meth:`save`), at any world size."""
        acts = cls.create(run_dir, shape, dtype, device, budget, block, rows, world)
        path = inputs_file(run_dir, block)
        size = path.stat().st_size if path.is_file() else None
        if size != acts.nbytes:
            raise ValueError(f"{path}: {'missing' if size is None else f'{size} bytes'}, expected the {acts.nbytes} "
                             f"bytes of block {block}'s inputs; rerun with --overwrite (without --resume) to start over")
        if acts.ram is not None:
            for j in range(len(acts)):
                acts.ram[j] = acts._read(path, j)
        return acts

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, rows: slice) -> torch.Tensor:
        j, stop, step = rows.indices(len(self))
        if stop - j != 1 or step != 1:
            raise IndexError(f"activations are read one sequence at a time (x[j:j+1]), got {rows}")
        if self.ram is not None:
            return self.ram[j:j + 1]
        return self._read(inputs_file(self.run_dir, self.block), j)[None].to(self.device)

    def write(self, j: int, y: torch.Tensor) -> None:
        """Sequence ``j``'s output of block :attr:`block`; in memory it replaces the input, not read again."""
        if tuple(y.shape) != self.shape[1:]:
            raise ValueError(f"activation row of shape {tuple(y.shape)}, expected {self.shape[1:]}")
        if self.ram is not None:
            self.ram[j] = y
            return
        with writing(self._part(self.block + 1)):
            if self._out is None:   # every rank writes its rows into the one file: none truncates it
                self._out = os.open(self._part(self.block + 1), os.O_WRONLY | os.O_CREAT, 0o644)
            _write_at(self._out, y, self._offset(j))

    def advance(self) -> None:
        """Every sequence's output is written: they are the inputs of the next block."""
        self.block += 1
        if self.on_disk:
            if self._out is None and len(self):
                raise RuntimeError(f"no outputs were written for block {self.block}")
            if self._out is not None:
                os.close(self._out)
            self._out = None
            self._publish()

    def save(self) -> None:
        """Make sure the current inputs are in :func:`inputs_file` (on disk they already are)."""
        if self.on_disk:
            return
        with writing(self._part(self.block)):
            fd = os.open(self._part(self.block), os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                for j in range(len(self)):
                    _write_at(fd, self.ram[j], self._offset(j))
            finally:
                os.close(fd)
        self._publish()

    def _publish(self) -> None:
        """Once every rank has written its rows, the part file, cut to size, becomes the block's inputs."""
        ranks.barrier(self.world)
        if self.world.writes:
            part = self._part(self.block)
            with writing(part):
                part.touch()
                os.truncate(part, self.nbytes)
                os.replace(part, inputs_file(self.run_dir, self.block))
        ranks.barrier(self.world)

    def _offset(self, j: int) -> int:
        return (self.rows.start + j) * self.row_bytes

    def remove_older(self) -> None:
        """Drop the saved inputs of earlier blocks (after the progress record moved past them)."""
        if not self.world.writes:
            return
        for p in self.run_dir.glob(FILE_PREFIX + "*.bin"):
            b = p.name[len(FILE_PREFIX):-len(".bin")]
            if b.isdigit() and int(b) < self.block:
                p.unlink()

    def _part(self, block: int) -> Path:
        return inputs_file(self.run_dir, block).with_suffix(".bin" + PART)

    def _read(self, path: Path, j: int) -> torch.Tensor:
        buf = torch.empty(self.row_bytes, dtype=torch.uint8, device="cpu")  # a file read lands on the host
        with open(path, "rb", buffering=0) as f:
            f.seek(self._offset(j))
            got = f.readinto(buf.numpy())
        if got != self.row_bytes:
            raise ValueError(f"{path}: truncated at sequence {j}")
        return buf.view(self.dtype).reshape(self.shape[1:])


def _nbytes(shape, dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _write_at(fd: int, t: torch.Tensor, offset: int) -> None:
    data = memoryview(t.detach().cpu().contiguous().view(torch.uint8).numpy()).cast("B")
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n
