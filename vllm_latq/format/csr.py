"""Compressed-sparse-row helpers for the outlier matrices (``outlier_crow`` / ``outlier_col``
/ ``outlier_val``), so that no reader or writer re-derives the row of a nonzero itself.

Every tensor is created on the device of the inputs (they run on CUDA and on ``meta`` too).
"""
from __future__ import annotations

import torch


def csr_rows(crow: torch.Tensor, nnz: int | None = None) -> torch.Tensor:
    """The row index of every nonzero, int64 ``[nnz]``, from the row pointers ``[rows+1]``:
    ``rows[k] = r`` for ``crow[r] <= k < crow[r+1]``. Passing ``nnz`` (e.g. ``col.numel()``)
    spares a device sync on CUDA and makes it work on ``meta``."""
    crow = crow.long()
    return torch.repeat_interleave(torch.arange(crow.numel() - 1, device=crow.device), crow[1:] - crow[:-1],
                                   output_size=nnz)


def csr_from_mask(mask: torch.Tensor, values: torch.Tensor):
    """``(crow int32 [rows+1], col int64 [nnz], val [nnz])`` of the entries of ``values``
    (same ``[rows, cols]`` shape as the boolean ``mask``) where ``mask`` is set, in row-major
    order, i.e. by increasing column within a row; ``val`` keeps ``values``' dtype."""
    if mask.shape != values.shape or mask.dim() != 2:
        raise ValueError(f"mask {tuple(mask.shape)} and values {tuple(values.shape)} must be the same 2-D shape")
    crow = torch.zeros(mask.shape[0] + 1, dtype=torch.int32, device=mask.device)
    crow[1:] = torch.cumsum(mask.sum(1), 0)
    col = mask.nonzero()[:, 1]
    return crow, col, values[mask]
