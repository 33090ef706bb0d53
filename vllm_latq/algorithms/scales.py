"""Quantization scales, fixed before any sweep (static groups, as in the paper): ``[out, ngroups]``
per group or 0-d per matrix, rounded to fp16 once, as checkpoints store them."""
from __future__ import annotations

import math

import torch

from .. import native
from ..format.packing import row_chunks

FP16_MAX = 65504.0
FP16_TINY = 2.0**-14  # smallest normal fp16; a zero group gets this scale


def grid(bits: int) -> tuple[int, int]:
    """The signed b-bit grid ``[-2^(b-1), 2^(b-1)-1]``."""
    if not 2 <= bits <= 8:
        raise ValueError(f"bits must be in 2..8, got {bits}")
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


def num_groups(columns: int, group_size: int) -> int:
    if group_size <= 0:
        raise ValueError(f"group_size must be positive, got {group_size}")
    return math.ceil(columns / group_size)


def _grouped(W: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[out, in]`` → ``[out, ngroups, group_size]``, the ragged tail padded with zeros
    (a zero rounds to zero, so padding never changes a scale or an error)."""
    r, c = W.shape
    G = num_groups(c, group_size)
    group_size = min(group_size, c)   # a group past the row is the row: nothing allocated for the rest
    pad = G * group_size - c
    if pad:
        W = torch.nn.functional.pad(W, (0, pad))
    return W.reshape(r, G, group_size)


def to_fp16_grid(s: torch.Tensor, what: str = "scale") -> torch.Tensor:
    """Round scales to fp16 (kept as fp32 tensors); refuse scales fp16 cannot hold."""
    if not torch.isfinite(s).all() or (s.abs() > FP16_MAX).any():
        raise ValueError(f"{what} exceeds the fp16 range (|s| > {FP16_MAX}): weights too large to store")
    return s.clamp(min=FP16_TINY).half().float()


def _absmax(Wg: torch.Tensor, qmin: float, qmax: float) -> torch.Tensor:
    """``[..., group_size]`` groups → the smallest scale putting each on the clipped grid
    ``[qmin, qmax]`` (grid points ``(z + offset)`` are passed already shifted)."""
    return torch.maximum(Wg.amax(-1) / qmax, Wg.amin(-1) / qmin)


def absmax_scales(W: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """Smallest per-group scale that puts every weight of the group on the clipped grid."""
    return _absmax(_grouped(W.float(), group_size), *grid(bits))


def mse_scales(W: torch.Tensor, bits: int, group_size: int, *, coarse: int = 10, fine: int = 8,
               min_shrink: float = 0.2, row_chunk: int = 128, offset: float = 0.0) -> torch.Tensor:
    """Per-group scales minimising the clipped-RTN squared error: absmax shrunk by the best factor in
    ``[min_shrink, 1]``, searched coarse-to-fine; fp16-exact ``[out, ngroups]`` fp32. This code is
    the definition; on CPU ``latq_cpu::mse_scales`` runs the same arithmetic (a near-tie may pick the
    other scale). ``offset``: the grid ``s·(z + offset)``."""
    qmin, qmax = grid(bits)
    step = (1.0 - min_shrink) / (coarse - 1)
    if not offset and W.device.type == "cpu" and W.dim() == 2 and group_size > 0 and native.usable():
        # rows are independent: a few MiB of fp32 at a time, never a copy of a bf16 matrix
        g = min(group_size, W.shape[1])
        S = torch.cat([torch.ops.latq_cpu.mse_scales(W[rows].float().contiguous(), bits, g, coarse, fine, min_shrink)
                       for rows in list(row_chunks(*W.shape)) or [slice(0, 0)]])
        return to_fp16_grid(S)  # a group fp16 cannot hold comes back NaN: the same ValueError
    out = []
    for Wc in W.split(row_chunk):  # small chunks: the temporaries stay in cache
        Wg = _grouped(Wc.float(), group_size)
        base = to_fp16_grid(_absmax(Wg, qmin + offset, qmax + offset))
        buf = torch.empty_like(Wg)
        best = None                          # (factor, scale, error) per group

        def consider(f, best):
            s = to_fp16_grid(base * f)
            torch.div(Wg, s[..., None], out=buf).sub_(offset).round_().clamp_(qmin, qmax).add_(offset)
            buf.mul_(s[..., None]).sub_(Wg)
            err = torch.linalg.vecdot(buf, buf)
            f = torch.as_tensor(f, device=s.device).expand_as(s)   # a float (coarse) or a tensor (fine)
            if best is None:
                return f, s, err
            better = err < best[2]
            return torch.where(better, f, best[0]), torch.where(better, s, best[1]), torch.minimum(err, best[2])

        for k in range(coarse):
            best = consider(1.0 - k * step, best)
        f0 = best[0]
        for k in range(1, fine + 1):
            off = step * (2 * k / (fine + 1) - 1)          # strictly between the neighbours
            if abs(off) > 1e-12:
                best = consider((f0 + off).clamp(min_shrink, 1.0), best)
        out.append(best[1])
    return torch.cat(out)


def matrix_scale(W: torch.Tensor, bits: float) -> torch.Tensor:
    """One scalar per matrix: ``max|W| / 2^(b-1)`` (a b-bit grid over the full range), the
    starting point of the HPTQ/HRTN scale search."""
    return to_fp16_grid(W.float().abs().max() / 2 ** (bits - 1)).reshape(())


def expand(scales: torch.Tensor, group_size: int | None, shape: tuple[int, int]) -> torch.Tensor:
    """Per-weight scales ``[out, in]`` from group scales ``[out, ngroups]`` (or a scalar)."""
    if scales.dim() == 0:
        return scales.expand(shape)
    return scales.repeat_interleave(min(group_size, shape[1]), dim=1)[:, : shape[1]]
