"""Incoherence processing (QuIP#, QuaRot): a linear's problem solved in a rotated frame. With R
orthogonal on the input dimension (``format/rotation.py``: a seeded random-sign block Hadamard),
``x·Wᵀ = (x·R)·(W·R)ᵀ``, so the solvers quantize ``W·R`` against the Hessian of the rotated
inputs, ``Rᵀ·H·R``; outlier columns spread over their block and the integers fit the grid. The
error ``(q − w·R)ᵀ RᵀHR (q − w·R)`` is the served layer's ``(q·Rᵀ − w)ᵀ H (q·Rᵀ − w)``, so the
certificate and every error statistic carry over unchanged; the integers live in the rotated
frame and the layer serves ``Q·Rᵀ``."""
from __future__ import annotations

import torch

from ..format.rotation import rotate, unrotate


def rotate_weight(W: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """``W·R`` (``[out, in]``) in fp32 (fp64 for an fp64 W)."""
    return rotate(W if W.dtype == torch.float64 else W.float(), signs)


def rotate_hessian(H: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """``Rᵀ·H·R`` in fp64: R on the rows, then on the columns, symmetrised (H is, and the
    solvers' factorisations read one triangle)."""
    HR = rotate(H.double(), signs)                 # H·R
    out = rotate(HR.T.contiguous(), signs)         # (H·R)ᵀ·R = Rᵀ·H·R, H symmetric
    del HR
    return out.add_(out.T.clone()).mul_(0.5)


def served_weight(Q: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """The weight a rotated layer serves, ``Q·Rᵀ``, from its solution ``Q`` in the rotated frame."""
    return unrotate(Q, signs)
