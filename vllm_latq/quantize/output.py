"""``latq-quantize``'s output directory: :mod:`vllm_latq.format.output_dir` under the quantizer's name."""
from __future__ import annotations

from pathlib import Path

from ..format import output_dir
from . import faults

COMMAND = "latq-quantize"
TMP_SUFFIX = ".tmp-latq"


def run_dir_of(out: Path) -> Path:
    """The run directory of ``out``: ``OUT.tmp-latq``."""
    return out.with_name(out.name + TMP_SUFFIX)


def replace_output(claim: output_dir.Claim, source: Path) -> None:
    """The sealed run directory becomes OUT, if still allowed (each stage a test hook, :func:`.faults.at`)."""
    claim.replace([source], faults.at)


def exclusive(out: Path, source: Path, overwrite: bool):
    """``out`` held while the run writes it, an interrupted replace recovered first (:func:`output_dir.exclusive`)."""
    return output_dir.exclusive(out, COMMAND, run_dir_of(out), [source], overwrite)
