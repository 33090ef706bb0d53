"""``--rotate hadamard``: a linear's problem in its rotated frame, for ``solve_layers.solve_linear``
(docs/ARCHITECTURE.md, the solve step)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..algorithms.rotation import rotate_hessian, rotate_weight, served_weight
from ..format.rotation import Rotation


@dataclass
class RotatedHessian:
    """``Rᵀ·H·R``, read as a ``Hessian``."""
    H: torch.Tensor
    n: int


def rotated_problem(W: torch.Tensor, hessian, rotation: Rotation) -> tuple[torch.Tensor, RotatedHessian | None,
                                                                            torch.Tensor]:
    """``(W·R, Rᵀ·H·R, signs)`` for the linear of weight ``W`` (``hessian`` None: uncalibrated)."""
    signs = rotation.signs(W.shape[1]).to(W.device)
    Hr = None if hessian is None else RotatedHessian(rotate_hessian(hessian.H, signs.to(hessian.H.device)),
                                                     hessian.n)
    return rotate_weight(W, signs), Hr, signs


def serve_rotated(res, signs: torch.Tensor) -> None:
    """The result's weight turned into the one the block computes with from now on, ``Q·Rᵀ``."""
    res.q = served_weight(res.q, signs.to(res.q.device))
