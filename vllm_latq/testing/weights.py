"""Random layers in the runtime form, for tests and kernel benches."""
from __future__ import annotations

import torch

from .. import format as fmt
from ..kernels.weight import CodebookWeight, LatqWeight


def random_weight(out: int, cin: int, bits: int, rate: float, *, group: int = 128, seed: int = 0,
                  scale_lo: float = 0.001, scale_span: float = 0.05, val_std: float = 0.3,
                  rows: tuple[tuple[int, float], ...] = (), cells: tuple[tuple[int, int], ...] = (),
                  fp16_values: bool = False, scale_bits: int | None = None) -> LatqWeight:
    """A random layer in the runtime form: uniform b-bit inliers, fp16 group scales, random outliers.
    ``rows`` / ``cells`` force outliers on some rows or cells; ``scale_bits`` codes the scales."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randint(-2 ** (bits - 1), 2 ** (bits - 1), (out, cin), generator=g, dtype=torch.int32)
    mask = torch.rand(out, cin, generator=g) < rate
    for r, p in rows:
        mask[r] = torch.rand(cin, generator=g) < p
    for r, c in cells:
        mask[r, c] = True
    z[mask] = 0
    scales = (torch.rand(out, -(-cin // group), generator=g) * scale_span + scale_lo).half()
    nz_rows, cols = mask.nonzero(as_tuple=True)
    crow = torch.zeros(out + 1, dtype=torch.int32)
    crow[1:] = torch.cumsum(mask.sum(1), 0)
    val = torch.randn(nz_rows.numel(), generator=g) * val_std
    if fp16_values:
        val = val.half()
    coded = None if scale_bits is None else fmt.scale_codes.code_scales(scales, scale_bits)
    if coded is not None:
        scales = coded.decode().half()
    return LatqWeight(fmt.pack(z, bits), scales, crow, cols.int(), val.float(), bits, group, cin, coded)


def random_codebook_weight(out: int, cin: int, bits: int, *, group: int | None = 64, seed: int = 0,
                           scale_bits: int | None = None) -> CodebookWeight:
    """A random codebook layer (method e8) in the runtime form: uniform codes of ``bits``' codebook,
    scales in [0.002, 0.022) per ``group`` columns (None: one a row), coded to ``scale_bits`` if given."""
    g = torch.Generator().manual_seed(seed)
    book = fmt.codebook.CODEBOOKS[bits]
    codes = torch.randint(0, 256, (out, cin // fmt.codebook.DIM, book.index_bytes), generator=g, dtype=torch.uint8)
    scales = (0.002 + 0.02 * torch.rand(out, -(-cin // group) if group else 1, generator=g)).half()
    coded = None if scale_bits is None else fmt.scale_codes.code_scales(scales.float(), scale_bits)
    if coded is not None:
        scales = coded.decode().half()
    return CodebookWeight(codes, scales, bits, group or cin, cin, coded)
