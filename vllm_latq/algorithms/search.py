"""One-dimensional scale search shared by SSQR, HPTQ and HRTN (paper Alg. 9/11/12): the multiplier
α of the reference scales whose metric (outlier rate, Huffman bits/weight) meets ``target``
within ``tol`` — k-ary rounds on a sample of rows, then a few full-matrix runs (docs/ARCHITECTURE.md)."""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch

from .scales import FP16_MAX, to_fp16_grid

Run = Callable[[torch.Tensor, torch.Tensor], object]      # (W rows, their scales: 0-dim, [rows, 1] or [rows, ngroups]) → sweep
Metric = Callable[[object, int], list]                   # (sweep of k stacked copies, k) → k values


class Searched(NamedTuple):
    """The search's answer: the multiplier, its metric value, the full-matrix sweep run with
    ``scales`` (= α·S0 on the fp16 grid, exactly the scales that sweep used) and the log of
    every evaluation ``(kind, α, value)``."""
    alpha: float
    value: float
    sweep: object
    scales: torch.Tensor
    log: list


def scaled(S0: torch.Tensor, alpha: float) -> torch.Tensor:
    return to_fp16_grid(S0 * alpha)


def _sample_scales(S0: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The sample's scales, one row per sampled row (a scalar becomes ``[n, 1]``, so that
    stacked copies can carry different multipliers)."""
    return S0.expand(len(idx), 1) if S0.dim() == 0 else S0[idx]


def _unreachable(target: float, v: float, alpha: float):
    raise ValueError(f"target {target} is unreachable: the metric stays at {v:.4g} even with "
                     f"scales {alpha:.3g}x the reference")


def _slope(points) -> float | None:
    """−d(metric)/d(log α) between the first and last of ``(kind, α, value)`` points, if the
    metric fell across them (it is a step function of α: flat spans carry no slope)."""
    (_, a0, v0), (_, a1, v1) = points[0], points[-1]
    if a0 == a1 or (v0 - v1) / (a1 - a0) <= 0:
        return None
    return (v0 - v1) / (math.log(a1) - math.log(a0))


def _next_alpha(a: float, v: float, aim: float, slope: float | None, ok: float | None,
                above: float | None) -> float:
    """The secant step from (α, value) towards ``aim``, inside the bracket (``above``, ``ok``):
    bisected (geometrically) when the step leaves it, widened ×1.02² per miss while one side
    of the bracket is still unknown."""
    nxt = a * math.exp((v - aim) / slope) if slope else None
    lo, hi = above or 0.0, ok or math.inf
    if nxt is not None and lo < nxt < hi:
        return nxt
    if ok is not None and above is not None:
        return math.sqrt(ok * above)
    return ok / 1.02**2 if ok is not None else above * 1.02**2


def scale_search(W: torch.Tensor, S0: torch.Tensor, run: Run, metric: Metric,
                 target: float, tol: float, *, sample_rows: int | None = None, grid: int = 12, rounds: int = 3,
                 span: float = 16.0, max_full: int = 10, seed: int = 0) -> Searched:
    """→ :class:`Searched` for the full matrix with metric ≤ target (if any α up to the search
    limit reaches it) and as close to it as found."""
    r, c = W.shape
    log = []
    gen = torch.Generator().manual_seed(seed)
    # ~1/32 of the rows (≥ 16, ≤ 128): a round of `grid` copies costs ≈ 1/3 of a full run.
    n = sample_rows or min(128, max(16, r // 32))
    # drawn on the CPU (its generator), so every device samples the same rows
    idx = torch.randperm(r, generator=gen, device="cpu")[: min(r, n)].sort().values.to(W.device)
    Ws = W[idx]

    def sampled(alphas):
        S = torch.cat([scaled(_sample_scales(S0, idx), a) for a in alphas])
        vals = metric(run(Ws.repeat(len(alphas), 1), S), len(alphas))
        log.extend(("sample", a, v) for a, v in zip(alphas, vals))
        return vals

    def full(a):
        S = scaled(S0, a)
        sw = run(W, S)
        v = metric(sw, 1)[0]
        log.append(("full", a, v))
        return v, Searched(a, v, sw, S, log)

    # aim half a tolerance below the target so the full matrix usually lands inside
    # [target - tol, target] at the first full run
    aim = target - tol / 2 if target > tol else target  # a zero target must stay reachable
    smax = S0.abs().max().item()   # scales beyond FP16_MAX / smax cannot be stored
    hi = _bracket(sampled, log, aim, target, smax, grid, rounds, span)
    return _settle(full, log, hi, _slope(log[-grid:]), aim, target, tol, smax, max_full)


def _bracket(sampled: Callable, log: list, aim: float, target: float, smax: float, grid: int, rounds: int,
             span: float) -> float:
    """Stage 1: k-ary bracketing on the row sample (``sampled(alphas)`` → their values, logged in
    ``log``) → the multiplier the full runs start from (the bracket's upper end)."""
    lo, hi = 1.0 / span, span
    for _ in range(rounds + 8):  # extra rounds only when the bracket must move
        alphas = torch.logspace(math.log10(lo), math.log10(hi), grid).tolist()
        vals = sampled(alphas)
        ok = [i for i, v in enumerate(vals) if v <= aim]
        if not ok:
            if smax * hi * span > FP16_MAX:
                # the metric need not fall with α (the half-integer grid cannot hold a zero: large
                # scales err by s/2 everywhere): the lowest sampled value of every round may be
                # under the target but not under the aim, so the full runs start from there
                v, hi = min((v, a) for _, a, v in log)
                if v > target:
                    _unreachable(target, v, hi)
                break
            lo, hi = hi, hi * span
        elif ok[0] == 0:
            if lo < 1e-6:
                break
            lo, hi = lo / span, lo
        else:
            lo, hi = alphas[ok[0] - 1], alphas[ok[0]]
            rounds -= 1
            if rounds == 0:
                break
    return hi


def _settle(full: Callable, log: list, a: float, slope: float | None, aim: float, target: float, tol: float,
            smax: float, max_full: int) -> Searched:
    """Stage 2: full-matrix runs from the sampled estimate ``a``, each next α a secant step kept
    inside the bracket found so far (bisected where it would leave it)."""
    best = None    # Searched: the smallest alpha seen with value ≤ target
    above = None   # the largest alpha seen with value > target
    prev = None
    for _ in range(max_full):
        if smax * a > FP16_MAX:   # a metric that does not fall with α can walk the secant past fp16
            break
        v, found = full(a)
        if v <= target:
            if best is None or a < best.alpha:
                best = found
            if target - v <= tol:
                break
        else:
            above = a if above is None else max(above, a)
        if prev is not None:
            slope = _slope([prev, ("full", a, v)]) or slope
        prev = ("full", a, v)
        a = _next_alpha(a, v, aim, slope, best.alpha if best else None, above)
        found = None   # a full sweep is several [out, in] matrices: keep only the best one through the next
    for _ in range(40):  # never under target yet: grow α (the metric falls as z → 0)
        if best is not None:
            return best
        if smax * a * 2 > FP16_MAX:
            break
        a *= 2
        v, found = full(a)
        if v <= target:
            best = found
    if best is not None:
        return best
    _unreachable(target, min(v for _, _, v in log), a)
