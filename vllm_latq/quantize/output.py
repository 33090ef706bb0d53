"""``latq-quantize``'s output directory: :mod:`vllm_latq.format.output_dir` under the quantizer's name."""
from __future__ import annotations

from pathlib import Path

from ..format import output_dir

COMMAND = "latq-quantize"


def check_output(out: Path, source: Path, overwrite: bool) -> None:
    """Refuse an ``out`` this run must not write or replace (``FileExistsError`` / ``ValueError``)."""
    output_dir.check_out(out, [source], overwrite, COMMAND)


def replace_output(run_dir: Path, out: Path, source: Path) -> None:
    """The sealed run directory becomes ``out`` (replacing it only if still allowed)."""
    output_dir.replace_with(run_dir, out, [source], COMMAND)


def exclusive(out: Path):
    """``out``'s lock, held while the run writes it."""
    return output_dir.exclusive(out, COMMAND)
