"""The CPU kernel's native layouts, as pure torch: torch's int4pack (and its unpacker and layout
probe), the C++ GEMV's packed layout, the outlier tiles the C++ op sums and the coded scales its
GEMV decodes."""
from __future__ import annotations

import torch

from ...format import scale_codes
from ...format.csr import csr_rows

_PACK = None
_MM = None


def int4_ops():
    """torch's int4pack ops (pack, GEMM), looked up on first use."""
    global _PACK, _MM
    if _MM is None:
        _PACK = torch.ops.aten._convert_weight_to_int4pack_for_cpu.default
        _MM = torch.ops.aten._weight_int4pack_mm_for_cpu.default
    return _PACK, _MM


def has_int4_op() -> bool:
    try:
        int4_ops()
        return True
    except (AttributeError, RuntimeError):
        return False


_LAYOUT: tuple[int, bool] | None = None
# the C++ GEMV's packed layout, on every CPU: torch's AVX-512 int4pack (64-row blocks, byte j of a
# (block, k) holds rows j and j + 32); torch's AVX2 kernel packs 32-row blocks instead
GEMV_LAYOUT = (64, True)


def pack_gemv(u: torch.Tensor) -> torch.Tensor:
    """int32 ``[N, K]`` of u in 0..15 → uint8 ``[N, K/2]`` in :data:`GEMV_LAYOUT` (the bytes torch's
    packer gives on AVX-512, whatever it does here): 64-row blocks K-major, rows j and j + 32 in one
    byte, a tail block as row pairs; the inverse of :func:`unpack_int4pack`."""
    N, K = u.shape
    B = GEMV_LAYOUT[0]
    v = u.to(torch.uint8)
    nb = N // B
    full = v[: nb * B].view(nb, B, K)
    full = (full[:, : B // 2] | (full[:, B // 2:] << 4)).transpose(1, 2).reshape(-1)     # [nb, K, 32]
    tail = v[nb * B:]
    tail = (tail[0::2] | (tail[1::2] << 4)).T.reshape(-1)                                # [K, R/2]
    return torch.cat([full, tail]).view(N, K // 2)


def unpack_int4pack(packed: torch.Tensor, n_rows: int, k: int, layout: tuple[int, bool],
                     r0: int = 0, r1: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows [r0, r1) (block boundaries) of the op's packed weight → int8 ``[K, r1 - r0]`` of u − 8.
    ``layout = (B, halves)``: byte j of a (block, k) holds rows j and j + B/2, or 2j and 2j + 1;
    ``out``: a tensor of any dtype to write into in the same pass."""
    B, halves = layout
    r1 = n_rows if r1 is None else r1
    flat = packed.view(-1)
    q = (flat[r0 * k // 2: r1 * k // 2] ^ 0x88).view(torch.int8)   # nibble u ^ 8 = two's complement of u-8
    if out is None:
        out = torch.empty(k, r1 - r0, dtype=torch.int8)
    full_end = min(r1, n_rows // B * B)
    if full_end > r0:
        nblk = (full_end - r0) // B
        qb = q[: nblk * k * B // 2].view(nblk, k, B // 2)
        ob = out[:, : nblk * B].view(k, nblk, B).permute(1, 0, 2)
        lo, hi = (ob[..., : B // 2], ob[..., B // 2:]) if halves else (ob[..., 0::2], ob[..., 1::2])
        lo.copy_(torch.bitwise_left_shift(qb, 4).bitwise_right_shift_(4))
        hi.copy_(torch.bitwise_right_shift(qb, 4))
    if r1 > full_end:
        t0 = max(r0, full_end)
        qt = q[(t0 - r0) * k // 2:].view(k, (r1 - t0) // 2)
        ot = out[:, t0 - r0:]
        ot[:, 0::2].copy_(torch.bitwise_left_shift(qt, 4).bitwise_right_shift_(4))
        ot[:, 1::2].copy_(torch.bitwise_right_shift(qt, 4))
    return out


def detect_layout() -> tuple[int, bool] | None:
    """Which of the op's known packed layouts this torch build uses (probe once)."""
    global _LAYOUT
    if _LAYOUT is None:
        pack, _ = int4_ops()
        g = torch.Generator().manual_seed(0)
        u = torch.randint(0, 16, (64 + 64 + 16, 6), generator=g, dtype=torch.int32)
        p = pack(u, 1)
        _LAYOUT = (0, False)
        for cand in ((64, True), (32, True), (32, False), (64, False), (16, False)):
            if torch.equal(unpack_int4pack(p, u.shape[0], u.shape[1], cand).T.int() + 8, u):
                _LAYOUT = cand
                break
    return _LAYOUT if _LAYOUT[0] else None


# ----------------------------------------------------------------------------- outlier tiles

TILE = 16        # rows per tile: one 16-lane fp32 vector
TILE_BLOCK = 64  # the GEMV's row block; tiles never cross one


def tiles_from_csr(crow: torch.Tensor, col: torch.Tensor, val: torch.Tensor):
    """CSR → (off int32 [T+1], rows int32 [T, 16], col int16 [S, 16], val [S, 16]): the outlier tiles
    the C++ op sums — each 64-row block's rows sorted by count and cut into tiles of 16, one row per
    lane, padded to the longest (col −1, val 0); values coded by :func:`code_values`."""
    N = crow.numel() - 1
    cnt = (crow[1:] - crow[:-1]).long()
    block, order, slots = _tile_order(cnt)
    T = -(-N // TILE)
    rows = (TILE_BLOCK + torch.arange(TILE)).repeat(T)                         # lanes without a row
    rows[:N] = order - block[order] * TILE_BLOCK
    off = torch.zeros(T + 1, dtype=torch.long)
    off[1:] = torch.cumsum(slots, 0)
    pos = torch.empty(N, dtype=torch.long)
    pos[order] = torch.arange(N)                                               # row → tile · 16 + lane
    r = csr_rows(crow, col.numel())                                            # row of each outlier
    rank = torch.arange(col.numel()) - crow.long()[r]                          # its index within the row
    dest = (off[pos[r] // TILE] + rank) * TILE + pos[r] % TILE
    S = int(off[-1])
    tcol = torch.full((S * TILE,), -1, dtype=torch.int16)
    tval = torch.zeros(S * TILE, dtype=val.dtype)
    tcol[dest] = col.to(torch.int16)
    tval[dest] = val
    return off.int(), rows.view(T, TILE).int(), tcol.view(S, TILE), tval.view(S, TILE)


def _tile_order(cnt: torch.Tensor):
    """Outliers per row → (each row's 64-row block, the rows in tile order, each tile's slots)."""
    N = cnt.numel()
    block = torch.arange(N, device=cnt.device) // TILE_BLOCK
    order = torch.argsort(block * (int(cnt.max()) + 1) - cnt, stable=True)   # per block, longest first
    slots = cnt[order][torch.arange(-(-N // TILE), device=cnt.device) * TILE]  # longest row of each tile
    return block, order, slots


def coo_to_csr(rows, cols, vals, N: int, K: int, sort: bool):
    """(row, col, val) entries → the state's CSR (int32 crow/col, fp32 val); ``sort``: the
    entries are not yet row-major sorted."""
    if sort:
        order = torch.argsort(rows * K + cols)
        rows, cols, vals = rows[order], cols[order], vals[order]
    crow = torch.zeros(N + 1, dtype=torch.int32)
    crow[1:] = torch.cumsum(torch.bincount(rows, minlength=N), 0).int()
    return crow, cols.int().contiguous(), vals.float().contiguous()


Z_BITS = 16                  # an int16 multiple of the row scale: z on the signed 16-bit grid
Z_MAX = 2 ** (Z_BITS - 1)


def code_values(val: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """fp32 outlier values → their exact coding: fp16 when all are fp16-exact; else, given each
    value's row ``scale``, int16 z with fp32(z)·s == value for all; else fp32."""
    v = val.float()
    if torch.equal(v.half().float(), v):
        return v.half()
    if scale is not None:
        z = torch.round(v / scale)
        if bool(((z >= -Z_MAX) & (z < Z_MAX)).all()) and torch.equal(z * scale, v):
            return z.to(torch.int16)
    return v


def value_bytes(stats, width: int, one_scale: bool) -> tuple[int, bool]:
    """:func:`code_values`' choice from a layer's ``GridStats`` at inlier ``width`` → (bytes per
    value, int16 multiples of the row scale?); a runtime form's stats see stored outliers, counted
    fp32 (an upper bound)."""
    if stats.fp16_values(width):
        return 2, False
    if one_scale and stats.off_grid(Z_BITS) == 0:
        return 2, True
    return 4, False


def tile_bytes(cnt: torch.Tensor, value_bytes: int) -> int:
    """Bytes of :func:`tiles_from_csr`'s four arrays for a layer with ``cnt[r]`` outliers in
    row r (the padding slots included) and ``value_bytes`` per value (2: fp16, 4: fp32)."""
    T = -(-cnt.numel() // TILE)
    return 4 * (T + 1) + 4 * T * TILE + (2 + value_bytes) * tile_slots(cnt) * TILE


def tile_slots(cnt: torch.Tensor) -> int:
    """Slots S of :func:`tiles_from_csr`'s tiles (each 16 lanes) for ``cnt[r]`` outliers in row r."""
    return int(_tile_order(cnt.long())[2].sum())


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def state_bytes(n: int, k: int, planes: int, go: int, counts: torch.Tensor, tiles: bool,
                coding: tuple[int, bool], pairs: bool, coded: bool = False) -> dict[str, int]:
    """Bytes of a prepared CPU layer: int4pack, bf16 scales (``pairs``: with zeros; ``coded``: words),
    and the outliers (``counts`` per row) as tiles of ``coding`` or as an fp32 CSR."""
    nnz = int(counts.sum())
    vb, scaled = coding
    outl = (0 if not nnz else tile_bytes(counts, vb) + 4 * n * scaled if tiles
            else 4 * (n + 1) + 8 * nnz)
    scales = k * planes // go * (n // scale_codes.ROWS * 12 if coded else n * (4 if pairs else 2))
    return {"inliers": n * k * planes // 2, "scales": scales, "outliers": outl}


def coded_scale_words(cs: "scale_codes.CodedScales") -> torch.Tensor:
    """Coded scales ``[N, G]`` (N a multiple of 16) → the C++ GEMV's int32 ``[G, N/16, 3]``: per
    group and 16-row block, fp16 min | fp16 step << 16, then the 16 codes as the format packs
    them (row 2j in the low nibble of byte j): the stored 6 bits per scale."""
    N, G = cs.codes.shape
    T = N // scale_codes.ROWS
    codes = scale_codes.pack_codes(cs.codes).T.reshape(G, T, 8)                     # uint8
    grid = torch.stack([cs.min.half().T, cs.step.half().T], -1).contiguous()        # fp16 [G, T, 2]
    return torch.cat([grid.view(torch.uint8).reshape(G, T, 4), codes], -1).contiguous().view(torch.int32)


def decode_scale_words(words: torch.Tensor) -> torch.Tensor:
    """:func:`coded_scale_words` → the fp32 scales ``[G, N]`` (``scale_codes.decode_scales``)."""
    G, T, _ = words.shape
    b = words.contiguous().view(torch.uint8).reshape(G, T, 12)
    grid = b[..., :4].contiguous().view(torch.float16)                              # [G, T, 2]
    codes = scale_codes.unpack_codes(b[..., 4:].reshape(G, T * 8).T, T * scale_codes.ROWS)
    return scale_codes.decode_scales(codes, grid[..., 0].T, grid[..., 1].T).T


def op_scales_zeros(scales: torch.Tensor, g: int, planes: int, Kp: int, op_groups) -> tuple[torch.Tensor, int]:
    """Scales alone (bf16 [Kp/g, N]) → torch's op's (s, z) pairs [Kp/go, N, 2] and go, the largest
    of ``op_groups`` dividing Kp and g; z = 8·s on a two-plane layer's low plane, else 0."""
    go = next(c for c in op_groups if Kp % c == 0 and g % c == 0)
    s = scales.repeat_interleave(g // go, 0)
    z = torch.zeros_like(s)
    if planes == 2:
        z[: s.shape[0] // 2] = s[: s.shape[0] // 2] * 8
    return torch.stack([s, z], -1).contiguous(), go


def tile_entries(tile_off: torch.Tensor, tile_rows: torch.Tensor, tile_col: torch.Tensor, tile_val: torch.Tensor,
                 n_rows: int, n_cols: int, r0: int, r1: int, padding: bool = False):
    """The outliers of rows [r0, r1) from the tiles: (row − r0, col, val) in slot order;
    ``padding``: every slot, padding as col = n_cols, val 0 (a scatter beats a mask)."""
    T = tile_rows.shape[0]
    t0, t1 = r0 // TILE, min(T, -(-r1 // TILE))
    off = tile_off.long()
    s0, s1 = int(off[t0]), int(off[t1])
    tile = csr_rows(off[t0:t1 + 1], s1 - s0) + t0                             # [S']
    rows = (tile // (TILE_BLOCK // TILE) * TILE_BLOCK - r0)[:, None] + tile_rows[tile].long()
    cols = tile_col[s0:s1].long()
    if padding:   # lanes without a row (tail block) hold only padding: any in-range row will do
        return (rows.view(-1).clamp_(max=min(r1, n_rows) - r0 - 1),
                cols.view(-1) % (n_cols + 1), tile_val[s0:s1].reshape(-1))
    keep = cols >= 0
    return rows[keep], cols[keep], tile_val[s0:s1][keep]
