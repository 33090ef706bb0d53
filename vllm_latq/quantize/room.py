"""What a run's options ask of the model and of this machine, refused before any work: a sequence
longer than the model's positions, a decoder beam whose buffers outgrow the memory, calibration
activations (saved for ``--resume``) that outgrow the disk holding OUT."""
from __future__ import annotations

import errno
import shutil
from pathlib import Path

import torch

from .. import cpu_features
from ..algorithms.decoders import decoder_bytes
from ..errors import ResourceLimit, in_units
from ..model_config import CONFIG_FILE, check_positions
from .head import HeadPlan
from .options import QuantizeOptions
from .source import Source

SAVED_STREAMS = 2   # a block's inputs and the next block's, both on disk while a block is saved


def check_room(src: Source, head: HeadPlan | None, opts: QuantizeOptions, out: Path) -> None:
    """Refuse ``opts`` the model ``src`` or this machine cannot hold, naming the option and the limit."""
    if opts.calibrated:
        check_positions(src.config, opts.seqlen, "seqlen", str(src.path / CONFIG_FILE))
    if opts.decoder != "babai":
        _check_decoder(src, head, opts)
    if opts.calibrated:
        _check_disk(src, opts, out)


def linear_shapes(src: Source, head: HeadPlan | None) -> dict[str, tuple[int, int]]:
    """``[out, in]`` of every matrix the run solves: block linears, experts, the head if quantized."""
    shapes = {name: tuple(m.weight.shape) for i in range(src.nblocks) for name, m in src.block_linears(i).items()}
    for name, x in src.names.experts.items():
        shapes[name] = (x.rows.stop - x.rows.start, src.net.get_parameter(x.param).shape[-1])
    if head is not None:
        shapes[head.name] = tuple(src.head.weight.shape)
    return shapes


def _check_decoder(src: Source, head: HeadPlan | None, opts: QuantizeOptions) -> None:
    name, (rows, columns) = max(linear_shapes(src, head).items(), key=lambda kv: kv[1][0] * kv[1][1])
    need = decoder_bytes(rows, columns, opts.beam)
    device = torch.device(opts.device)
    room = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else cpu_features.available_memory()
    if need > room:
        raise ResourceLimit(f"beam {opts.beam}: the {opts.decoder} decoder holds {in_units(need)} for {name} "
                            f"[{rows}, {columns}], more than the {in_units(room)} of {device.type} memory available "
                            f"(beam {max(1, room // decoder_bytes(rows, columns, 1))} at most)")


def _check_disk(src: Source, opts: QuantizeOptions, out: Path) -> None:
    streams = 2 if opts.target_correction else 1
    row = opts.seqlen * src.config.hidden_size * src.dtype.itemsize
    need = SAVED_STREAMS * streams * opts.nsamples * row
    folder = next(p for p in out.parents if p.exists())   # OUT's folder may be made later
    free = shutil.disk_usage(folder).free
    if need > free:
        raise ResourceLimit(f"nsamples {opts.nsamples} x seqlen {opts.seqlen}: the calibration activations saved in "
                            f"{out.name}.tmp-latq for --resume need {in_units(need)}, more than the {in_units(free)} free in "
                            f"{folder}", errno.ENOSPC)
