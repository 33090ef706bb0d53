"""One TP rank's runtime form of a dense- or codebook-kind layer, cut from its checkpoint tensors (no vLLM here).

Which rows and columns a rank holds is :mod:`~vllm_latq.plugin.geometry`; how they are cut is
in docs/ARCHITECTURE.md, "Loading"."""
from __future__ import annotations

import math

import torch

from .. import format as fmt
from ..format.scale_codes import CodedScales
from ..kernels.weight import CodebookWeight, LatqWeight, RuntimeWeight


def _rows_csr(crow, col, val, r0, n):
    a, b = int(crow[r0]), int(crow[r0 + n])
    return crow[r0:r0 + n + 1] - a, col[a:b], val[a:b]


def _cols_csr(crow, col, val, c0, n):
    rows = fmt.csr_rows(crow, col.numel())
    keep = (col >= c0) & (col < c0 + n)
    new = torch.zeros_like(crow)
    new[1:] = torch.cumsum(torch.bincount(rows[keep], minlength=crow.numel() - 1), 0)
    return new, col[keep] - c0, val[keep]


def slice_dense(t: dict, bits: int, g: int, cin: int, blocks, c0: int, n: int, coded: bool = False) -> LatqWeight:
    """Rows ``blocks`` and columns ``[c0, c0+n)`` of a dense-kind layer → runtime form."""
    rows = t["qweight"].shape[0]
    qw, cr, co, va = [], [], [], []
    crow_all = t["outlier_crow"].to(torch.int64)
    col_all, val_all = t["outlier_col"].to(torch.int64), t["outlier_val"].float()
    for r0, nr in blocks:
        q = t["qweight"][r0:r0 + nr]
        crow, col, val = _rows_csr(crow_all, col_all, val_all, r0, nr)
        if (c0, n) != (0, cin):
            crow, col, val = _cols_csr(crow, col, val, c0, n)
            t0, t1 = c0 // fmt.PACK_TILE, -(-(c0 + n) // fmt.PACK_TILE)
            q = q[:, t0 * bits:t1 * bits]
            if c0 % fmt.PACK_TILE or (n % fmt.PACK_TILE and c0 + n != cin):  # not on tiles: repack
                z = fmt.unpack(q, bits, (t1 - t0) * fmt.PACK_TILE)[:, c0 - t0 * fmt.PACK_TILE:][:, :n]
                q = fmt.pack(z, bits)
        qw.append(q), cr.append(crow), co.append(col), va.append(val)
    s, coded_scales, g_eff = _cut_scales(t, rows, coded, blocks, g, c0, n)
    return LatqWeight(torch.cat(qw).contiguous(), s, _stack_crows(cr).to(torch.int32),
                      torch.cat(co).to(torch.int32), torch.cat(va), bits, g_eff, n, coded_scales)


def slice_codebook(t: dict, bits: int, g: int, blocks, c0: int, n: int, coded: bool = False) -> CodebookWeight:
    """Rows ``blocks`` and columns ``[c0, c0+n)`` of a codebook-kind layer → runtime form (a cut on its
    8-column blocks, as a rotated layer's always is)."""
    if c0 % fmt.codebook.DIM or n % fmt.codebook.DIM:
        raise ValueError(f"latq: this rank's input columns [{c0}, {c0 + n}) cut the codebook's "
                         f"{fmt.codebook.DIM}-column blocks")
    b0, b1 = c0 // fmt.codebook.DIM, (c0 + n) // fmt.codebook.DIM
    codes = torch.cat([t["codes"][r0:r0 + nr, b0:b1] for r0, nr in blocks]).contiguous()
    s, coded_scales, g_eff = _cut_scales(t, t["codes"].shape[0], coded, blocks, g, c0, n)
    return CodebookWeight(codes, s, bits, g_eff, n, coded_scales)


def _cut_scales(t: dict, rows: int, coded: bool, blocks, g: int, c0: int, n: int):
    """Rows ``blocks`` and columns ``[c0, c0+n)`` of a layer's group scales → (fp16 scales, their codes
    or None, the group size of the cut): a cut off a group boundary splits groups to gcd(g, c0), each
    part keeping its group's scale."""
    scales = fmt.dense_scales(t, rows)
    codes = fmt.scale_codes.from_tensors(t, rows) if coded else None
    g_eff = math.gcd(g, c0) if c0 % g else g
    k, g0, g1 = g // g_eff, c0 // g_eff, -(-(c0 + n) // g_eff)
    s = torch.cat([scales[r0:r0 + nr] for r0, nr in blocks]).repeat_interleave(k, dim=1)[:, g0:g1]
    if codes is not None:
        codes = _split_groups(_stack_codes([codes.rows(r0, nr) for r0, nr in blocks]), k).columns(g0, g1 - g0)
    return s.contiguous(), codes, g_eff


def codes_refusal(runs: list[tuple[str, int, int]], pad_to: int | None = None) -> str | None:
    """Why stored scale codes cannot follow the row ``runs`` this rank stacks, or None.
    Each run must start on a 16-row boundary and all but the last span whole 16-row blocks."""
    block = fmt.scale_codes.ROWS
    for i, (name, r0, nr) in enumerate(runs):
        if r0 % block:
            return f"this rank's rows of {name} start at row {r0}, inside a block of {block} rows sharing a grid"
        if nr % block and i < len(runs) - 1:
            return f"{nr} rows of {name} (not a multiple of {block}) are followed by more rows"
    total = sum(nr for _, _, nr in runs)
    if pad_to is not None and pad_to > total and total % block:
        return f"the vocabulary padding after {total} rows (not a multiple of {block}) would share their last grid"
    return None


def _stack_codes(parts: list[CodedScales]) -> CodedScales:
    """Coded scales of row blocks stacked (every part but the last whole 16-row blocks)."""
    if any(c.codes.shape[0] % fmt.scale_codes.ROWS for c in parts[:-1]):
        raise ValueError("latq: coded scales stacked off their 16-row grids")
    return CodedScales(torch.cat([c.codes for c in parts]), torch.cat([c.min for c in parts]),
                       torch.cat([c.step for c in parts]), parts[0].bits)


def _split_groups(c: CodedScales, k: int) -> CodedScales:
    """``c`` with each group split into ``k`` (a row-parallel cut off a group boundary)."""
    if k == 1:
        return c
    return CodedScales(*(x.repeat_interleave(k, dim=1) for x in (c.codes, c.min, c.step)), c.bits)


def _stack_crows(crows: list[torch.Tensor]) -> torch.Tensor:
    """Row pointers of CSR blocks stacked row-wise → the row pointers of the stacked matrix."""
    out, off = [crows[0]], int(crows[0][-1])
    for c in crows[1:]:
        out.append(c[1:] + off)
        off += int(c[-1])
    return torch.cat(out)


def pad_rows(w: RuntimeWeight, rows: int | None) -> RuntimeWeight:
    """``w`` with zero rows appended up to ``rows`` (an lm_head rank's padded vocabulary slice): logits 0."""
    if rows is None or rows == w.out_features:
        return w
    extra = rows - w.out_features
    if extra < 0:
        raise ValueError(f"latq: {w.out_features} rows do not fit a padded slice of {rows}")
    coded = w.coded
    if coded is not None:
        grid = coded.min.new_zeros(-(-extra // fmt.scale_codes.ROWS), coded.min.shape[1])
        coded = _stack_codes([coded, CodedScales(coded.codes.new_zeros(extra, coded.codes.shape[1]), grid, grid,
                                                 coded.bits)])
    scales = torch.cat([w.scales, w.scales.new_zeros(extra, w.scales.shape[1])])
    if isinstance(w, CodebookWeight):   # zero scales: whatever the codes, the rows are zero
        return CodebookWeight(torch.cat([w.codes, w.codes.new_zeros(extra, *w.codes.shape[1:])]), scales, w.bits,
                              w.group_size, w.in_features, coded)
    q = fmt.pack(torch.zeros(extra, w.in_features, dtype=torch.int32, device=w.qweight.device), w.bits)
    return LatqWeight(torch.cat([w.qweight, q.to(w.qweight.dtype)]), scales,
                      torch.cat([w.crow, w.crow[-1:].expand(extra)]), w.col, w.val, w.bits, w.group_size,
                      w.in_features, coded)


def merge(parts: list[RuntimeWeight]) -> RuntimeWeight:
    """The parts of a fused layer (q/k/v, gate/up) stacked row-wise into one runtime form."""
    if len(parts) == 1:
        return parts[0]
    p0 = parts[0]
    if any((p.bits, p.group_size, p.in_features) != (p0.bits, p0.group_size, p0.in_features) for p in parts):
        raise ValueError("latq: parts of a fused layer differ in bits/group size")
    coded = None if any(p.coded is None for p in parts) else _stack_codes([p.coded for p in parts])
    if isinstance(p0, CodebookWeight):
        return CodebookWeight(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]), p0.bits,
                              p0.group_size, p0.in_features, coded)
    return LatqWeight(torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]),
                      _stack_crows([p.crow for p in parts]), torch.cat([p.col for p in parts]),
                      torch.cat([p.val for p in parts]),
                      p0.bits, p0.group_size, p0.in_features, coded)
