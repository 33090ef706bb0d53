"""Compressed-sparse-row helpers for the outlier matrices, so no reader re-derives a nonzero's row."""
from __future__ import annotations

import torch


def csr_rows(crow: torch.Tensor, nnz: int | None = None) -> torch.Tensor:
    """The row index of every nonzero, int64 ``[nnz]``, from the row pointers ``[rows+1]``.
    Passing ``nnz`` spares a device sync on CUDA and makes it work on ``meta``."""
    crow = crow.long()
    return torch.repeat_interleave(torch.arange(crow.numel() - 1, device=crow.device), crow[1:] - crow[:-1],
                                   output_size=nnz)


def csr_from_mask(mask: torch.Tensor, values: torch.Tensor):
    """``(crow int32, col int64, val)`` of ``values`` where ``mask`` is set, in row-major order."""
    if mask.shape != values.shape or mask.dim() != 2:
        raise ValueError(f"mask {tuple(mask.shape)} and values {tuple(values.shape)} must be the same 2-D shape")
    crow = torch.zeros(mask.shape[0] + 1, dtype=torch.int32, device=mask.device)
    crow[1:] = torch.cumsum(mask.sum(1), 0)
    col = mask.nonzero()[:, 1]
    return crow, col, values[mask]
