"""``--rotate hadamard``: every linear solved in its rotated frame (``algorithms/rotation.py``).

:func:`rotated` wraps the pipeline's per-linear ``quantize(name, W, hessian, **kw)``: the solver,
the encoding, the certificate and the layer's record all see ``(W·R, Rᵀ·H·R)``; the result's
``q`` is then turned into the served weight ``Q·Rᵀ``, which the block's later forwards use. It is
the innermost wrapper: target correction and column-scale folds change the problem in the
original frame first, and the rotation applies to the problem they hand on.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..algorithms.rotation import rotate_hessian, rotate_weight, served_weight
from ..format.rotation import Rotation


@dataclass
class RotatedHessian:
    """A linear's Hessian in the rotated frame: what ``quantize`` reads of a ``Hessian``."""
    H: torch.Tensor
    n: int


def rotated(quantize: Callable, rotation: Rotation | None) -> Callable:
    """``quantize`` solving every linear on ``(W·R, Rᵀ·H·R)``, R of the linear's input size
    (None: ``quantize`` itself). The layer's record gets ``rotation_block``."""
    if rotation is None:
        return quantize

    def solve_rotated(name, W, hessian, **kw):
        signs = rotation.signs(W.shape[1])
        kw["extra"] = {**(kw.get("extra") or {}), "rotation_block": signs.numel()}
        Hr = None if hessian is None else RotatedHessian(rotate_hessian(hessian.H, signs.to(W.device)), hessian.n)
        res, tensors = quantize(name, rotate_weight(W, signs.to(W.device)), Hr, **kw)
        res.q = served_weight(res.q, signs.to(res.q.device))
        return res, tensors
    return solve_rotated
