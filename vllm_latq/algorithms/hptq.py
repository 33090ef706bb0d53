"""HPTQ and HRTN (paper §5, Alg. 11/12): one scale per matrix, unclipped integers,
one canonical Huffman code per matrix; the scale is searched so that the stored size
(payload + codebook + chunk table + the fp32 scale) meets a target bits/weight."""
from __future__ import annotations

import torch

from ..format import huffman
from . import lattice
from .result import QuantResult
from .scales import matrix_scale
from .search import scale_search
from .solvers import Rounder, Sweep, _compute_dtype, lattice_sweep, solver_lattice

SCALE_BITS = 32  # the per-matrix scale is stored as fp32


def hptq_bits(z: torch.Tensor) -> float:
    """Exact stored bits/weight of a Huffman-coded integer matrix (the codec is numpy: on the CPU)."""
    return (huffman.coded_bits(z.to(torch.int32).cpu().numpy()) + SCALE_BITS) / z.numel()


def _estimated_bits(z_sample: torch.Tensor, numel: int) -> float:
    """Bits/weight of the full matrix, estimated from a row sample's histogram."""
    _, counts = torch.unique(z_sample, return_counts=True)
    counts = counts.cpu().numpy()
    payload = (counts * huffman.code_lengths(counts)).sum() * numel / z_sample.numel()
    return (huffman.stored_bits(int(payload), len(counts), numel) + SCALE_BITS) / numel


def _huffman_search(method, W, target_bits, tol, run, name, **result_kw) -> QuantResult:
    if target_bits <= 1.0:
        raise ValueError(f"{method}: target_bits must exceed 1 (a Huffman code spends ≥ 1 bit "
                         f"per weight), got {target_bits}")
    numel = W.numel()

    def bits(sw, k):
        zs = sw.z.reshape(k, -1).to(torch.int32)
        if k == 1 and zs.shape[1] == numel:
            return [hptq_bits(zs)]
        return [_estimated_bits(zk, numel) for zk in zs]

    s0 = matrix_scale(W, target_bits)
    alpha, b, sw, scale, log = scale_search(W, s0, run, bits, target_bits, tol)
    res = QuantResult(method, sw.z.to(torch.int32), sw.q.float(), scale, None, None, b, **result_kw)
    res.info.update(alpha=alpha, target_bits=target_bits, search=log,
                    code=huffman.HuffmanCode.fit(sw.z.to(torch.int32).cpu().numpy()))
    return res


@torch.no_grad()
def hptq(W: torch.Tensor, H: torch.Tensor, *, target_bits: float = 3.125, order="act",
         damp: float = 0.01, block_size: int = 128, tol: float = 5e-3, decoder: str = "babai", beam: int = 1,
         name: str | None = None) -> QuantResult:
    """W ``[out, in]``, H ``[in, in]`` → unclipped ``.z`` under one scalar ``.scales``,
    ``.bits_per_weight`` ≤ ``target_bits`` (within ``tol`` when reachable), ``.bound``,
    the Huffman code in ``.info["code"]``. H is factorized once for the whole search.
    ``decoder``/``beam``: every search step decoded beyond Babai (:func:`.solvers.decoded_sweep`)."""
    lattice.check_inputs(W, H, name)
    lat = solver_lattice(H, order, damp, name, _compute_dtype(W), decoder, beam)
    res = _huffman_search("hptq", W, target_bits, tol,
                          lambda Wr, S: lattice_sweep(lat, Wr, S, None, Rounder(), block_size), name,
                          order=lat.perm, damp=lat.damp)
    res.bound = lattice.bound_from_d(lat.D_col, res.scales, None, W.shape[0])
    return res


@torch.no_grad()
def hrtn(W: torch.Tensor, H: torch.Tensor | None = None, *, target_bits: float = 3.125,
         tol: float = 5e-3, name: str | None = None) -> QuantResult:
    """HPTQ's baseline: the same scale search and coding with plain rounding (H unused)."""
    lattice.check_inputs(W, H, name)

    def run(Wr, S):
        z = torch.round(Wr.float() / S)
        return Sweep(z, z * S, None, None)

    return _huffman_search("hrtn", W, target_bits, tol, run, name)
