"""``--rotate hadamard``: a linear's problem moved into its rotated frame (``algorithms/rotation.py``).

:func:`~.solve_layers.solve_linear` solves, encodes, certifies and records ``(W·R, Rᵀ·H·R)``
and hands the block the served weight ``Q·Rᵀ``. It is the innermost change of problem: target
correction and column-scale folds act in the original frame first. R depends only on the seed
and the input size, so the linears that share a Hessian (q/k/v, gate/up, a block's experts)
share one R and a fused layer transforms its input once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..algorithms.rotation import rotate_hessian, rotate_weight, served_weight
from ..format.rotation import Rotation


@dataclass
class RotatedHessian:
    """A linear's Hessian in the rotated frame: what the solve reads of a ``Hessian``."""
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
