"""Bit-packing of the dense kinds' b-bit integers (``P.qweight``): the one definition of the layout
(docs/FORMAT.md, "Packing"). Tensors are made on the input's device, so CUDA and ``meta`` work."""
from __future__ import annotations

import math

import torch

PACK_TILE = 32  # values per tile; a tile of b-bit values is exactly b int32 words

# rows per packing step: the bit-plane temporaries are int64 [rows, in, b], which over a whole
# embedding-sized matrix would be tens of GB; 8 MiB steps keep them in cache and off a run's peak
PACK_CHUNK_ELEMS = 1 << 20


def packed_words(in_features: int, bits: int) -> int:
    """int32 words per row of ``qweight``."""
    return math.ceil(in_features / PACK_TILE) * bits


def row_chunks(rows: int, per_row: int, elems: int = PACK_CHUNK_ELEMS):
    """Row slices of ``rows`` whose temporaries (``per_row`` elements a row) hold about ``elems``."""
    step = max(1, elems // max(1, per_row))
    return (slice(r, min(rows, r + step)) for r in range(0, rows, step))


def pack(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed b-bit integers ``[out, in]`` → int32 ``[out, ceil(in/32)·b]``: offset binary, 32-column tiles."""
    out, cin = z.shape
    # compared as int: 2^7 does not fit an int8 tensor's dtype (RTN's clipped integers are int8)
    if z.numel() and (int(z.min()) < -2 ** (bits - 1) or int(z.max()) >= 2 ** (bits - 1)):
        raise ValueError(f"integers outside the {bits}-bit grid cannot be packed")
    tiles = math.ceil(cin / PACK_TILE)
    dev = z.device
    res = torch.empty(out, tiles * bits, dtype=torch.int32, device=dev)
    words = _whole_value_words if 32 % bits == 0 else _bit_plane_words
    for rows in row_chunks(out, tiles * PACK_TILE * bits):
        u = torch.nn.functional.pad(z[rows].to(torch.int64) + 2 ** (bits - 1), (0, tiles * PACK_TILE - cin))
        w = words(u.reshape(-1, tiles, PACK_TILE), bits)                                    # [R, T, b] < 2^32
        res[rows] = torch.where(w >= 2**31, w - 2**32, w).to(torch.int32).reshape(-1, tiles * bits)
    return res


def _bit_plane_words(u: torch.Tensor, bits: int) -> torch.Tensor:
    """Tiles ``[R, T, 32]`` of offset values → their ``[R, T, b]`` words, for any b."""
    dev = u.device
    bitplanes = (u[..., None] >> torch.arange(bits, device=dev)) & 1                     # [R, T, 32, b]
    return (bitplanes.reshape(*u.shape[:2], bits, 32) << torch.arange(32, device=dev)).sum(-1)


def _whole_value_words(u: torch.Tensor, bits: int) -> torch.Tensor:
    """:func:`_bit_plane_words` where b divides 32 (no value straddles two words): 1/b of the work."""
    per = 32 // bits
    return (u.reshape(*u.shape[:2], bits, per) << (bits * torch.arange(per, device=u.device))).sum(-1)


def unpack(qweight: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    """Inverse of :func:`pack` → int32 ``[out, in]``; reads bytes, so assumes a little-endian device."""
    out = qweight.shape[0]
    dev = qweight.device
    res = torch.empty(out, in_features, dtype=torch.int32, device=dev)
    if out == 0:
        return res
    mask = 2 ** bits - 1
    for rows in row_chunks(out, qweight.shape[1] * PACK_TILE):
        q = qweight[rows].contiguous().view(torch.uint8)                       # [R, 4·words]
        R = q.shape[0]
        if 8 % bits == 0:
            u = (q.unsqueeze(-1) >> torch.arange(0, 8, bits, dtype=torch.uint8, device=dev)) & mask
        else:
            v = (q.view(R, -1, bits).long() << (8 * torch.arange(bits, device=dev))).sum(-1)   # 8 values each
            u = (v.unsqueeze(-1) >> (bits * torch.arange(8, device=dev))) & mask
        res[rows] = u.reshape(R, -1)[:, :in_features].int() - 2 ** (bits - 1)
    return res


def unpack_at(qweight: torch.Tensor, bits: int, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """The signed integers at ``(rows[k], cols[k])`` only, without unpacking the whole matrix."""
    rows, cols = rows.long(), cols.long()
    bit = (cols % PACK_TILE)[:, None] * bits + torch.arange(bits, device=qweight.device)   # [k, b]
    word = (cols // PACK_TILE)[:, None] * bits + bit // 32
    w = qweight[rows[:, None], word].to(torch.int64) & 0xFFFFFFFF
    u = (((w >> (bit % 32)) & 1) << torch.arange(bits, device=qweight.device)).sum(-1)
    return (u - 2 ** (bits - 1)).to(torch.int32)
