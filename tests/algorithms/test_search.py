"""The one-dimensional scale search shared by SSQR, HPTQ and HRTN (algorithms/search.py)."""
import math

import pytest
import torch

from vllm_latq.algorithms.scales import to_fp16_grid
from vllm_latq.algorithms.search import _next_alpha, scale_search


def _overflow_search(seed: int, target: float, tol: float = 5e-4):
    """SSQR's metric without a solver: the share of weights whose rounded integer leaves the
    4-bit grid under scales α·S0 (falls as α grows; a step function of α)."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(512, 256, generator=g) / torch.rand(512, 256, generator=g).add(0.05).sqrt()
    S0 = W.abs().amax(1, keepdim=True) / 7

    def run(Wr, S):
        return torch.round(Wr / S)

    def rates(z, k):
        return ((z < -8) | (z > 7)).reshape(k, -1).float().mean(1).tolist()

    return W, S0, scale_search(W, S0, run, rates, target, tol)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("target", [0.01, 0.02, 0.05])
def test_search_lands_in_band_with_few_full_runs(seed, target):
    tol = 5e-4
    W, S0, (alpha, v, z, S, log) = _overflow_search(seed, target, tol)
    full = [e for e in log if e[0] == "full"]
    assert target - tol <= v <= target
    assert ((z < -8) | (z > 7)).float().mean().item() == pytest.approx(v)  # the sweep returned is the α's
    assert torch.equal(S, to_fp16_grid(S0 * alpha))                        # and so are the scales
    # the secant steps from the sampled slope: one full run usually, three at most here
    assert len(full) <= 3, full


def test_search_zero_target_and_unreachable():
    W, S0, (alpha, v, z, S, log) = _overflow_search(0, 0.0)
    assert v == 0.0

    def stuck(Wr, S):
        return Wr

    with pytest.raises(ValueError, match="unreachable"):
        scale_search(torch.ones(4, 8), torch.ones(4, 1), stuck, lambda z, k: [1.0] * k, 0.1, 1e-3)


def test_search_takes_a_minimum_between_the_aim_and_the_target():
    """A metric that is not monotone in α (SSQR on the half-integer grid: large scales err by
    s/2 everywhere, and the propagated error makes outliers again) whose lowest value lies above
    the aim but under the target: the search returns an α there instead of "unreachable"."""
    target, tol = 0.01, 5e-4

    def run(Wr, S):
        return S[:, :1].expand(Wr.shape[0], 1)

    def u_shaped(S, k):   # lowest, 0.0099 (over the aim 0.00975), at α = 2
        return [0.0099 + 0.01 * math.log(a / 2) ** 2 for a in S.reshape(k, -1)[:, 0].tolist()]

    W, S0 = torch.ones(64, 8), torch.ones(64, 1)
    alpha, v, _, S, log = scale_search(W, S0, run, u_shaped, target, tol)
    assert v <= target and 1.5 < alpha < 2.7 and torch.equal(S, to_fp16_grid(S0 * alpha))
    with pytest.raises(ValueError, match="unreachable"):   # its lowest value over the target
        scale_search(W, S0, run, lambda S, k: [x + 0.001 for x in u_shaped(S, k)], target, tol)

    def full_runs_higher(S, k):   # the row sample touches the target, the whole matrix never does
        return [x + 0.001 * (S.shape[0] == 64 * k) for x in u_shaped(S, k)]

    with pytest.raises(ValueError, match="unreachable"):   # said so, before a scale leaves fp16's range
        scale_search(W, S0, run, full_runs_higher, target, tol)


def test_next_alpha_secant_inside_bracket_else_bisect():
    # the metric is 0.02 above the aim with slope 0.1 per unit log α: step e^0.2
    assert _next_alpha(1.0, 0.07, 0.05, 0.1, None, None) == pytest.approx(math.exp(0.2))
    # the secant would leave the bracket (0.9, 1.1): geometric bisection
    assert _next_alpha(1.0, 0.07, 0.05, 0.1, 1.1, 0.9) == pytest.approx(math.sqrt(1.1 * 0.9))
    # no slope and one side unknown: widen ×1.02² towards the unknown side
    assert _next_alpha(1.0, 0.07, 0.05, None, None, 1.0) == pytest.approx(1.02**2)
    assert _next_alpha(1.0, 0.01, 0.05, None, 1.0, None) == pytest.approx(1.02**-2)


def test_solver_bench_runs_small(capsys):
    """bench/solver_speed.py end to end on small layers: every ratio printed, one HEADLINE line."""
    from bench import solver_speed as mod
    mod.main(["--rows", "256", "--cols", "384", "--tokens", "768", "--repeats", "1", "--e8-shapes", "48x128,16x64",
              "--e8-tokens", "256"])
    lines = capsys.readouterr().out.strip().splitlines()
    head = [x for x in lines if x.startswith("HEADLINE")]
    assert len(head) == 1 and lines[-1] == head[0]
    vals = dict(kv.split("=") for kv in head[0].split()[1:])
    assert set(vals) == {"gptq_vs_gemm", "babai_vs_gemm", "ssqr_vs_gptq", "hptq_vs_gptq", "e8_2b_vs_gptq",
                         "e8_3b_vs_gptq", "e8_4b_vs_gptq", "e8_3b_s", "gptq_4b_s"}
    assert all(float(v) > 0 for v in vals.values())
