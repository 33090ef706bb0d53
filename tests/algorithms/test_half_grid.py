"""The half-integer grid ``s·(z + ½)`` of the lever screen (docs/KERNELS.md, accuracy levers): solvers put every
inlier on it, the certificate holds on the shifted lattice, and SSQR's 2-bit overflows are no
longer one-sided."""
from __future__ import annotations

import torch

from vllm_latq.algorithms.scales import expand, grid, mse_scales
from vllm_latq.algorithms.solvers import gptq
from vllm_latq.algorithms.ssqr import ssqr


def _on_grid(res, bits, offset=0.5):
    S = expand(res.scales, res.group_size, tuple(res.q.shape))
    inl = torch.ones_like(res.q, dtype=torch.bool)
    if res.outliers is not None:
        inl &= res.outliers.to_dense() == 0
    qmin, qmax = grid(bits)
    assert res.z.min() >= qmin and res.z.max() <= qmax
    assert torch.allclose(res.q[inl], ((res.z.float() + offset) * S)[inl], rtol=1e-6, atol=0)


def test_half_grid_scales_and_gptq(real_hessians):
    W, H = real_hessians["model.layers.0.self_attn.q_proj"]
    S = mse_scales(W, 2, 128, offset=0.5)
    assert not torch.equal(S, mse_scales(W, 2, 128))
    res = gptq(W, H.float(), bits=2, offset=0.5)
    _on_grid(res, 2)
    free = gptq(W, H.float(), bits=2, offset=0.5, clip=False)   # unclipped: the certificate, on the shifted lattice
    assert (free.error(W, H) <= free.bound * (1 + 1e-4)).all()


def test_ssqr_half_grid_overflows_both_ways(real_hessians):
    W, H = real_hessians["model.layers.1.mlp.up_proj"]
    side = {}
    for offset in (0.0, 0.5):
        res = ssqr(W, H.float(), bits=2, outlier_rate=0.01, offset=offset)
        assert res.outliers.nnz <= 0.01 * W.numel()
        _on_grid(res, 2, offset)
        side[offset] = (res.outliers.val.float() > 0).float().mean().item()
    assert max(side[0.0], 1 - side[0.0]) > 0.85          # the lopsided {−2..1} grid: one side
    assert 0.25 < side[0.5] < 0.75, side
