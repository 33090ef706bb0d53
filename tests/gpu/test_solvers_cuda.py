"""The solvers on CUDA against the CPU: the sweep, the MSE scales, whole solves (equal up to
rounding ties).

Run by ``scripts/gpu_check.sh`` on a CUDA machine (``TRITON_INTERPRET=0``); skipped elsewhere.
"""
from __future__ import annotations

import pytest
import torch

from tests.gpu.cases import DEV, pytestmark


# |ω/s − (j + ½)| at a rounding that may flip between devices: fp32 sweeps over 4096 columns drift
# apart by a few 1e-3 of a step before a row's first different rounding (H100 vs CPU, 3-bit outliers)
TIE = 5e-3


def real_layer(out=1024, cin=4096, seed=0):
    """A real-shaped layer: W with per-row scale spread; H = D C D of correlated activations
    (rank-256 covariance with a decaying spectrum + isotropic part, log-normal channel scales,
    8 outlier channels ×20, as LLM activations have) — fp64, as the pipeline accumulates it."""
    g = torch.Generator().manual_seed(seed)
    B = torch.randn(256, cin, generator=g, dtype=torch.float64)
    lam = torch.logspace(0, -3, 256, dtype=torch.float64)
    chan = torch.exp(torch.randn(cin, generator=g, dtype=torch.float64) * 0.7)
    chan[torch.randperm(cin, generator=g)[:8]] *= 20
    C = (B.T * lam) @ B / 256
    C.diagonal().add_(0.05)
    H = chan[:, None] * C * chan[None, :]
    W = (torch.randn(out, cin, generator=g) * 0.02) * torch.exp(torch.randn(out, 1, generator=g) * 0.3)
    return W.float(), H


@pytest.fixture(scope="module")
def layer_wh():
    return real_layer()


def assert_same_up_to_ties(z_cpu, z_dev, rho_cpu, rho_dev, order, min_same, what):
    """Rows are swept column by column in ``order``; a device may round differently only at a
    tie: each row's first differing integer must sit within TIE of a half-integer on both
    devices (later ones follow from it through the error propagation). Plus a bound on the
    fraction of identical integers."""
    z_dev, rho_dev = z_dev.cpu(), rho_dev.cpu()
    d = (z_cpu != z_dev)[:, order]
    rows = d.any(1).nonzero().squeeze(1)
    cols = order[d[rows].int().argmax(1)]
    ra, rb = rho_cpu[rows, cols].double(), rho_dev[rows, cols].double()
    half = torch.floor(torch.minimum(ra, rb)) + 0.5
    at_tie = ((ra - half).abs() <= TIE) & ((rb - half).abs() <= TIE)
    far = torch.maximum((ra - half).abs(), (rb - half).abs())
    assert at_tie.all(), (f"{what}: {int((~at_tie).sum())} rows first differ away from a rounding tie (farthest "
                          f"{far.max().item():.2e}), e.g. row {int(rows[~at_tie][0])} col {int(cols[~at_tie][0])}: "
                          f"ω/s cpu {ra[~at_tie][0].item():.6f} vs {DEV.type} {rb[~at_tie][0].item():.6f}")
    same = (z_cpu == z_dev).double().mean().item()
    assert same >= min_same, (f"{what}: {same:.5f} of the integers identical (< {min_same}); "
                              f"{rows.numel()} of {z_cpu.shape[0]} rows differ")


@pytest.mark.parametrize("grid", ["gptq-clipped", "ssqr-outliers", "hptq-unclipped"])
def test_sweep_cuda_matches_cpu(grid, layer_wh):
    """The GPTQ sweep (what SSQR/HPTQ/GPTQ run) with the same scales on both devices."""
    from vllm_latq.algorithms import solvers
    from vllm_latq.algorithms.scales import matrix_scale, mse_scales
    W, H = layer_wh
    if grid == "hptq-unclipped":
        S, group, rounder = matrix_scale(W, 3.125) * 0.7, None, solvers.Rounder()
    else:
        S, group = mse_scales(W, 3 if grid == "ssqr-outliers" else 4, 128), 128
        rounder = solvers.Rounder.of(3, clip=False, outliers=True) if grid == "ssqr-outliers" else solvers.Rounder.of(4, True)

    def sweep(dev):
        lat = solvers.gptq_lattice(H.to(dev), "act", 0.01)
        return lat.perm, solvers.gptq_sweep(lat, W.to(dev), S.to(dev), group, rounder, keep_rho=True)

    _, b = sweep(DEV)                      # the device first: if it fails, no CPU time is spent
    order, a = sweep("cpu")
    # 3 bits with unclipped outliers: more rows meet a tie (an H100 kept 0.99879 identical)
    assert_same_up_to_ties(a.z, b.z, a.rho, b.rho, order, 0.998 if grid == "ssqr-outliers" else 0.999, grid)
    if a.outlier is not None:
        assert (a.outlier != b.outlier.cpu()).double().mean().item() <= 1e-3


def test_mse_scales_cuda_matches_cpu(layer_wh):
    """Group scales on both devices: equal except near-ties. A near-tie in the coarse search moves
    the fine search to another neighbourhood, so a differing group's two errors are within 1 %
    of each other (not within rounding)."""
    from vllm_latq.algorithms.scales import _grouped, grid, mse_scales
    W, _ = layer_wh
    for bits, group in ((4, 128), (3, 64)):
        b = mse_scales(W.to(DEV), bits, group).cpu()
        a = mse_scales(W, bits, group)
        diff = a != b
        assert diff.double().mean().item() <= 1e-3, f"{bits}-bit g{group}: {int(diff.sum())} scales differ"
        if diff.any():
            qmin, qmax = grid(bits)
            Wg = _grouped(W.double(), group)[diff]

            def err(s):
                s = s[diff].double()[:, None]
                return ((Wg / s).round().clamp(qmin, qmax) * s - Wg).pow(2).sum(1)

            ea, eb = err(a), err(b)
            rel = ((ea - eb).abs() / torch.minimum(ea, eb).clamp_min(1e-30)).max().item()
            assert rel <= 1e-2, f"{bits}-bit g{group}: a differing scale's error is {rel:.2e} off the other's"


@pytest.mark.parametrize("method", ["gptq", "ssqr", "hptq"])
def test_solver_cuda_matches_cpu(method, layer_wh):
    """The public solvers on CUDA tensors (the pipeline's ``--device cuda``): they run, keep
    their contract and certificate, and give the CPU's integers up to ties. SSQR/HPTQ search
    one scale multiplier α on counts that a tie can move, and a moved α re-rounds the fp16
    scales: with the same α ≥ 99.5 % identical integers, else α within 1e-3 and the same
    layer error within 1 %."""
    from vllm_latq import algorithms
    from vllm_latq.algorithms.lattice import layer_error
    W, H = layer_wh
    fn = getattr(algorithms, method)
    b = fn(W.to(DEV), H.to(DEV))          # the device first: if it fails, no CPU time is spent
    a = fn(W, H)
    zb, qb = b.z.cpu(), b.q.cpu()
    same = (a.z == zb).double().mean().item()
    ea = layer_error(W, a.q, H, a.damp).sum().item()
    eb = layer_error(W, qb, H, b.damp).sum().item()
    if b.bound is not None:
        assert (layer_error(W, qb, H, b.damp) <= b.bound.cpu() * (1 + 1e-4)).all(), "certificate violated"
    if method == "ssqr":
        assert b.outlier_rate <= 0.01
    if method == "hptq":
        assert b.bits_per_weight <= 3.125
    alpha_a, alpha_b = a.info.get("alpha", 1.0), b.info.get("alpha", 1.0)
    msg = (f"{method}: identical {same:.5f}, α cpu {alpha_a} {DEV.type} {alpha_b}, "
           f"error cpu {ea:.6g} {DEV.type} {eb:.6g}")
    if alpha_a == alpha_b:
        assert same >= 0.995, msg
    else:
        assert abs(alpha_a - alpha_b) <= 1e-3 * alpha_a and abs(ea - eb) <= 0.01 * ea, msg


def test_e8_cuda_matches_cpu(layer_wh):
    """Method e8 (block Babai, E8 codes, coded scales) on CUDA tensors: it runs with every tensor on the
    device, its certificate holds on the rows without an overload, and its codes are the CPU's up to
    near-ties (≥ 99 % identical blocks, the same layer error within 1 %)."""
    from vllm_latq.algorithms.e8 import e8
    from vllm_latq.algorithms.lattice import layer_error
    W, H = layer_wh
    W = W[:256]
    b = e8(W.to(DEV), H.to(DEV), bits=3, group_size=16, scale_bits=4)
    a = e8(W, H, bits=3, group_size=16, scale_bits=4)
    assert b.q.device.type == DEV.type
    qb = b.q.cpu()
    same = (a.codes == b.codes.cpu()).all(-1).double().mean().item()
    ea, eb = layer_error(W, a.q, H, a.damp), layer_error(W, qb, H, b.damp)
    ok = b.info["overloads"].cpu() == 0
    assert (eb[ok] <= b.bound.cpu()[ok] * (1 + 1e-4)).all(), "certificate violated"
    assert same >= 0.99 and abs(ea.sum() - eb.sum()) <= 0.01 * ea.sum(), (same, ea.sum().item(), eb.sum().item())
