"""Second-level scales (SpQR's idea): group scales as 4-bit codes on a grid per 16 rows of a group;
the one definition of the coded form (docs/FORMAT.md, "Coded scales")."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ROWS = 16            # rows of a group sharing one (min, step): one kernel slab of output rows
CODE_BITS = (4,)     # the code widths the format accepts
FP16_TINY = 2.0 ** -24


@dataclass
class CodedScales:
    """Scales ``[out, G]`` as codes (uint8, unpacked, one per scale) on per-block grids."""
    codes: torch.Tensor   # uint8 [out, G]
    min: torch.Tensor     # fp16 [ceil(out/16), G]
    step: torch.Tensor    # fp16 [ceil(out/16), G]
    bits: int = 4

    def decode(self) -> torch.Tensor:
        """fp32 ``[out, G]`` fp16-exact scales."""
        return decode_scales(self.codes, self.min, self.step)

    def rows(self, r0: int, n: int) -> "CodedScales":
        """Rows ``[r0, r0+n)``; ``r0`` on a block boundary (a cut inside a block has no own grid)."""
        if r0 % ROWS:
            raise ValueError(f"coded scales cut at row {r0}, not a multiple of {ROWS}")
        b0, b1 = r0 // ROWS, -(-(r0 + n) // ROWS)
        return CodedScales(self.codes[r0:r0 + n], self.min[b0:b1], self.step[b0:b1], self.bits)

    def columns(self, g0: int, n: int) -> "CodedScales":
        """Groups ``[g0, g0+n)``."""
        return CodedScales(self.codes[:, g0:g0 + n], self.min[:, g0:g0 + n], self.step[:, g0:g0 + n], self.bits)

    def to(self, device) -> "CodedScales":
        return CodedScales(self.codes.to(device), self.min.to(device), self.step.to(device), self.bits)


def _per_block(S: torch.Tensor, fill: float) -> torch.Tensor:
    """``[out, G]`` → ``[ceil(out/16), 16, G]`` (missing rows ``fill``)."""
    out, G = S.shape
    pad = (-out) % ROWS
    return torch.nn.functional.pad(S, (0, 0, 0, pad), value=fill).reshape(-1, ROWS, G)


def decode_scales(codes: torch.Tensor, smin: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """fp32 ``[out, G]`` fp16-exact scales from codes ``[out, G]`` and their blocks' grids."""
    out = codes.shape[0]
    rows = torch.arange(out, device=codes.device) // ROWS
    return (smin.float()[rows] + codes.float() * step.float()[rows]).half().float()


def code_scales(S: torch.Tensor, bits: int = 4) -> CodedScales:
    """Positive scales ``[out, G]`` → the nearest codes on each block's grid of ``2^bits`` levels."""
    if bits not in CODE_BITS:
        raise ValueError(f"scale code bits {bits} not supported (supported: {CODE_BITS})")
    levels = 2 ** bits - 1
    S = S.float()
    lo = _per_block(S, math.inf).amin(1)
    hi = _per_block(S, -math.inf).amax(1)
    smin = lo.clamp(min=FP16_TINY).half()
    step = ((hi - smin.float()).clamp(min=0) / levels).half()
    rows = torch.arange(S.shape[0], device=S.device) // ROWS
    st = step.float()[rows]
    c = torch.where(st > 0, (S - smin.float()[rows]) / st.clamp(min=FP16_TINY), torch.zeros_like(S))
    codes = c.round().clamp(0, levels).to(torch.uint8)
    return CodedScales(codes, smin, step, bits)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[out, G]`` (< 16) → ``[ceil(out/2), G]``: row 2r low nibble, 2r+1 high."""
    c = codes.to(torch.uint8)
    if c.shape[0] % 2:
        c = torch.cat([c, c.new_zeros(1, c.shape[1])])
    return (c[0::2] | (c[1::2] << 4)).contiguous()


def unpack_codes(packed: torch.Tensor, out: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes` → uint8 ``[out, G]``."""
    p = packed.to(torch.uint8)
    return torch.stack([p & 15, p >> 4], 1).reshape(-1, p.shape[1])[:out].contiguous()


def to_tensors(cs: CodedScales) -> dict[str, torch.Tensor]:
    """The stored tensors (suffixes) of coded scales."""
    return {"scale_codes": pack_codes(cs.codes), "scale_min": cs.min.half().contiguous(),
            "scale_step": cs.step.half().contiguous()}


def from_tensors(t: dict[str, torch.Tensor], out: int, bits: int = 4) -> CodedScales:
    """The :class:`CodedScales` of a layer's stored tensors."""
    return CodedScales(unpack_codes(t["scale_codes"], out), t["scale_min"], t["scale_step"], bits)


def shapes(out: int, ngroups: int) -> dict[str, tuple[tuple[int, int], torch.dtype]]:
    """The stored tensors' shapes and dtypes."""
    blocks = -(-out // ROWS)
    return {"scale_codes": ((-(-out // 2), ngroups), torch.uint8), "scale_min": ((blocks, ngroups), torch.float16),
            "scale_step": ((blocks, ngroups), torch.float16)}


def stored_bits(out: int, ngroups: int) -> int:
    """Bits of the stored tensors of ``[out, ngroups]`` coded scales (from :func:`shapes`)."""
    return sum(8 * math.prod(shp) * dt.itemsize for shp, dt in shapes(out, ngroups).values())


TENSORS = ("scale_codes", "scale_min", "scale_step")
