"""HPTQ/HRTN layers (unclipped integers under one scale) → the dense + CSR runtime form, at the
inlier width that minimises what the serving kernel family streams."""
from __future__ import annotations

import torch

from .. import format as fmt
from .served_bytes import GridStats, choose_width
from .weight import LatqWeight


def transcode(z: torch.Tensor, scale, *, family=None, stats: GridStats | None = None) -> LatqWeight:
    """Unclipped integers under one scale per matrix (or per row, for fused parts) → the dense+CSR
    runtime form at the inlier width that minimises ``family``'s served bytes (None: the form's
    own, :func:`choose_width`); integers off the grid become exact fp32 outliers, on z's device."""
    out, cin = z.shape
    dev = z.device
    s = torch.as_tensor(scale, dtype=torch.float32, device=dev).reshape(-1).expand(out).contiguous()
    s16 = s.half()
    if not torch.equal(s16.float(), s):
        raise ValueError("a per-tensor scale (hscale) is not fp16-exact")
    stats = GridStats.from_integers(z, s) if stats is None else stats
    b = choose_width(out, cin, stats, family)
    lo, hi = -(2 ** (b - 1)), 2 ** (b - 1) - 1
    mask = (z < lo) | (z > hi)
    rows, cols = mask.nonzero(as_tuple=True)
    crow = torch.zeros(out + 1, dtype=torch.int32, device=dev)
    crow[1:] = torch.cumsum(mask.sum(1), 0)
    val = z[rows, cols].float() * s[rows]
    inl = torch.where(mask, torch.zeros_like(z), z)
    return LatqWeight(fmt.pack(inl, b), s16.reshape(out, 1).contiguous(), crow, cols.int(), val, b, cin, cin)
