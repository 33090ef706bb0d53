"""SSQR (paper §5, Alg. 9): b-bit group-quantized inliers + CSR fp16 outliers, the weights whose
integer would overflow the grid after unclipped GPTQ; one multiplier α on the MSE scales is
searched so that they are at most ``outlier_rate``. Nothing is clipped: the certificate holds."""
from __future__ import annotations

import torch

from . import lattice
from .result import CSR, QuantResult
from .scales import mse_scales
from .search import scale_search
from .solvers import Rounder, _compute_dtype, lattice_sweep, solver_lattice


def ssqr_bits(shape: tuple[int, int], bits: int, n_scales: int, nnz: int) -> float:
    """Stored bits/weight: b-bit inliers, fp16 scales, per outlier an fp16 value + 16-bit
    column index (the paper's b + 16/g + 32·rate), plus int32 CSR row pointers."""
    r, c = shape
    return (r * c * bits + 16 * n_scales + 32 * nnz + 32 * (r + 1)) / (r * c)


@torch.no_grad()
def ssqr(W: torch.Tensor, H: torch.Tensor, *, bits: int = 4, group_size: int = 128,
         outlier_rate: float = 0.01, order="act", damp: float = 0.01, block_size: int = 128,
         tol: float = 5e-4, offset: float = 0.0, decoder: str = "babai", beam: int = 1,
         name: str | None = None) -> QuantResult:
    """W ``[out, in]``, H ``[in, in]`` → inliers ``.z`` (0 at outliers), ``.scales`` (α·MSE scales),
    ``.outliers`` (CSR), ``.bound``; the rate achieved is ≤ ``outlier_rate``, within ``tol`` where
    reachable. ``offset``: the shifted grid (:func:`.solvers.gptq_sweep`); ``decoder``/``beam``:
    every search step decoded beyond Babai."""
    lattice.check_inputs(W, H, name)
    if not 0 <= outlier_rate < 1:
        raise ValueError(f"outlier_rate must be in [0, 1), got {outlier_rate}")
    S0 = mse_scales(W, bits, group_size, offset=offset)
    lat = solver_lattice(H, order, damp, name, _compute_dtype(W), decoder, beam)
    rounder = Rounder.of(bits, clip=False, outliers=True)

    def run(Wr, S):
        return lattice_sweep(lat, Wr, S, group_size, rounder, block_size, offset=offset)

    def rates(sw, k):
        return sw.outlier.reshape(k, -1).float().mean(1).tolist()

    alpha, rate, sw, scales, log = scale_search(W, S0, run, rates, outlier_rate, tol)
    outliers = CSR.from_mask(sw.outlier, sw.q)
    res = QuantResult("ssqr", sw.z.to(torch.int32), sw.q.float(), scales, group_size, bits,
                      ssqr_bits(tuple(W.shape), bits, scales.numel(), outliers.nnz), lat.perm,
                      lat.damp, lattice.bound_from_d(lat.D_col, scales, group_size, W.shape[0]), outliers)
    res.info.update(alpha=alpha, target_rate=outlier_rate, search=log)
    return res
