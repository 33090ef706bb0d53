"""GPTQ as IST-DASLab's column loop, written independently of the package: the oracle the fast
solver is tested against and the study's peer GPTQ."""
from __future__ import annotations

import torch


def reference_gptq(W: torch.Tensor, H: torch.Tensor, S: torch.Tensor, perm: torch.Tensor, bits: int,
                   damp: float) -> torch.Tensor:
    """GPTQ as IST-DASLab's ``fasterquant`` without lazy batches, in ``perm`` order, on fixed scales ``S``.
    → int32 integers ``[out, in]``; computed in W's dtype (the factor in fp64 first)."""
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    Hd = H.double().clone()
    Hd.diagonal().add_(damp * Hd.diagonal().mean())
    Hd = Hd[perm][:, perm]
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(Hd)), upper=True).to(W.dtype)
    Wp = W[:, perm].clone()
    Sp = S[:, perm].to(W.dtype)
    Z = torch.empty_like(Wp, dtype=torch.int32)
    for j in range(Wp.shape[1]):
        w = Wp[:, j]
        z = torch.clamp(torch.round(w / Sp[:, j]), lo, hi)
        Z[:, j] = z.int()
        e = (w - z * Sp[:, j]) / Hinv[j, j]
        Wp[:, j:].sub_(e[:, None] * Hinv[j, j:][None, :])
    out = torch.empty_like(Z)
    out[:, perm] = Z
    return out
