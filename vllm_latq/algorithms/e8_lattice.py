"""Nearest points of D8, E8, E8P (a ball of E8 + ¼) and the 256-point ball, a block of 8 a row, Euclidean
and in a metric D: block Babai's searches (algorithms/e8.py); C++ ops (csrc/e8.cpp) on CPU rows."""
from __future__ import annotations

from functools import lru_cache

import torch

from .. import native
from ..format import codebook as cb
from ..format.codebook import DIM, e8_ball256, e8p_patterns, in_e8p

FALLBACK_CHUNK = 4096   # blocks searched at a time by the exhaustive path (bounds its temporaries)
DESCENT_ROUNDS, DESCENT_TRIES = 3, 8   # metric_descent: moves at most, the least-gain roots tried a move


# ----------------------------------------------------------------------------- the lattice

def nearest_d8(x: torch.Tensor) -> torch.Tensor:
    """Nearest point of D8 (integer vectors of even sum) to each row of ``x [..., 8]`` (Conway–Sloane)."""
    f = torch.round(x)
    odd = (f.sum(-1) % 2) != 0
    if odd.any():   # an odd sum: the coordinate farthest from its integer rounds the other way
        d = x - f
        i = d.abs().argmax(-1, keepdim=True)
        step = torch.where(d.gather(-1, i) >= 0, 1.0, -1.0).to(x.dtype)
        f = f.scatter_add(-1, i, torch.where(odd[..., None], step, torch.zeros_like(step)))
    return f


def nearest_e8(x: torch.Tensor) -> torch.Tensor:
    """Nearest point of E8 = D8 ∪ (D8 + ½) to each row of ``x [..., 8]``."""
    a = nearest_d8(x)
    b = nearest_d8(x - 0.5) + 0.5
    closer_b = ((x - b).square().sum(-1) < (x - a).square().sum(-1))[..., None]
    return torch.where(closer_b, b, a)


# ----------------------------------------------------------------------------- E8P: a ball of E8 + ¼

def e8p_codebook() -> torch.Tensor:
    """All 2¹⁶ E8P points ``[65536, 8]`` fp64, in code order."""
    return cb.decode_e8p(torch.arange(2 ** 16)).double()


def _e8p_shift_search(y: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The nearest point of {σ⊙a : a a pattern, Σσa even} to each row of ``y`` → (point, squared
    distance); the ``top`` patterns nearest without the parity first, all of them where that can miss."""
    a = e8p_patterns().to(y.device, y.dtype)
    sgn = torch.where(y < 0, -1.0, 1.0).to(y.dtype)
    ay = y.abs()
    free = ay.square().sum(-1, keepdim=True) - 2 * ay @ a.T + a.square().sum(-1)   # [N, 256]
    # a pattern's best signs are y's, the cheapest coordinate (least |y_i|·a_i) flipped where Σσa is odd;
    # the flip only adds, so a row whose best beats the next pattern's parity-free distance is done
    near, cand = free.topk(top + 1, dim=-1, largest=False)
    best_d, best = _fixed_parity(ay, sgn, a, cand[:, :top], free)
    rest = best_d > near[:, top]
    if rest.any():
        every = torch.arange(len(a), device=y.device).expand(int(rest.sum()), len(a))
        best_d[rest], best[rest] = _fixed_parity(ay[rest], sgn[rest], a, every, free[rest])
    return best, best_d


def _fixed_parity(ay, sgn, a, cand, free):
    """The candidates ``cand [N, k]`` (pattern indices) with their parity fixed → the best (distance, point)."""
    ac = a[cand]                                                   # [N, k, 8]
    odd = torch.remainder(torch.round((sgn[:, None, :] * ac).sum(-1) * 2), 4) != 0
    flip_cost, flip_at = (ay[:, None, :] * ac).min(-1)
    d = free.gather(1, cand) + torch.where(odd, 4 * flip_cost, torch.zeros_like(flip_cost))
    dmin, k = d.min(-1)
    s = sgn.clone()
    fix = odd.gather(1, k[:, None]).squeeze(1)
    i = flip_at.gather(1, k[:, None]).squeeze(1)
    s[fix, i[fix]] *= -1
    return dmin, s * ac[torch.arange(len(k), device=k.device), k]


def _e8p_exhaustive(x: torch.Tensor, top: int = 16) -> torch.Tensor:
    """E8P's nearest point by the pattern search for both shifts (exact)."""
    p_plus, d_plus = _e8p_shift_search(x - 0.25, top)
    p_minus, d_minus = _e8p_shift_search(x + 0.25, top)
    return torch.where((d_plus <= d_minus)[:, None], p_plus + 0.25, p_minus - 0.25)


def cpp_rows(x: torch.Tensor) -> bool:
    """The searches' C++ ops (``algorithms/csrc/e8.cpp``: the same points, a block at a time) for CPU rows."""
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and native.usable()


def nearest_e8p(x: torch.Tensor, D: torch.Tensor | None = None) -> torch.Tensor:
    """Nearest E8P point to each row of ``x [N, 8]`` (exact); with a metric ``D`` that point improved
    in ``(p − x)ᵀD(p − x)`` by :func:`metric_descent`."""
    if cpp_rows(x):
        p = torch.ops.latq_cpu.e8p_nearest(x, e8p_patterns())
        return p if D is None else metric_descent(p, x, D, in_e8p)
    p = nearest_e8(x - 0.25) + 0.25
    out = ~in_e8p(p)
    if out.any():
        rows = out.nonzero().squeeze(1)
        for r0 in range(0, len(rows), FALLBACK_CHUNK):
            r = rows[r0:r0 + FALLBACK_CHUNK]
            p[r] = _e8p_exhaustive(x[r])
    return p if D is None else metric_descent(p, x, D, in_e8p)


@lru_cache(maxsize=None)
def e8_roots() -> torch.Tensor:
    """E8's 240 minimal vectors (squared norm 2) ``[240, 8]`` fp64."""
    return e8_ball256()[1:241]


def metric_descent(p: torch.Tensor, x: torch.Tensor, D: torch.Tensor, member, rounds: int = DESCENT_ROUNDS,
                   tries: int = DESCENT_TRIES) -> torch.Tensor:
    """Local search from codebook points ``p`` toward the nearest to ``x`` in the metric ``D``: moves to
    the best admitted neighbour p + r (r a root of E8) while one improves; never farther than ``p``."""
    if member is in_e8p and cpp_rows(x):   # E8P's: the C++ op, a block at a time
        return torch.ops.latq_cpu.e8p_metric_descent(p, x, D, e8_roots(), e8p_patterns(), rounds, tries)
    R = e8_roots().to(x.device, x.dtype)
    D = D.to(x.device, x.dtype)
    RD = (R @ D * R).sum(-1)                                       # rᵀDr
    for _ in range(rounds):
        gain = 2 * ((p - x) @ D) @ R.T + RD                        # change of the distance, [N, 240]
        val, idx = gain.topk(tries, dim=-1, largest=False)
        cand = p[:, None, :] + R[idx]                              # [N, tries, 8]
        ok = (val < 0) & member(cand)
        if not ok.any():
            break
        val = torch.where(ok, val, torch.zeros_like(val))
        k = val.argmin(-1)
        move = ok.gather(1, k[:, None]).squeeze(1)
        p = torch.where(move[:, None], cand[torch.arange(len(k), device=k.device), k], p)
    return p


# ----------------------------------------------------------------------------- a 1-bit ball of E8

def nearest_in(x: torch.Tensor, book: torch.Tensor, D: torch.Tensor | None = None) -> torch.Tensor:
    """Nearest row of ``book [n, 8]`` to each row of ``x [N, 8]``, in the metric ``D`` where given."""
    if D is not None and cpp_rows(x):
        return torch.ops.latq_cpu.nearest_in_metric(x, book, D)
    book = book.to(x.device, x.dtype)
    Dc = book.T if D is None else D.to(x.device, x.dtype) @ book.T
    return book[(2 * x @ Dc - (book * Dc.T).sum(-1)).argmax(-1)]


def nearest_ball256(x: torch.Tensor, D: torch.Tensor | None = None) -> torch.Tensor:
    """The ball's nearest point to each row of ``x``: Euclidean in closed form, in ``D`` by the whole ball."""
    if D is not None:
        return nearest_in(x, e8_ball256(), D)
    return torch.ops.latq_cpu.ball256_nearest(x) if cpp_rows(x) else _nearest_ball_euclid(x)


def _nearest_ball_euclid(x: torch.Tensor) -> torch.Tensor:
    """The best of the ball's four kinds by the gain 2⟨x, p⟩ − |p|² (ties: the earlier kind, as in the
    table): 0; (±1, ±1, 0⁶) on the two largest |xᵢ|; (±½)⁸ with x's signs, the smallest |xᵢ| flipped
    where the minus signs are odd; ±2eᵢ on the largest admitted ±xᵢ (all but −2e₇)."""
    ax = x.abs()
    sgn = torch.where(x < 0, -1.0, 1.0).to(x.dtype)
    top2, at2 = ax.topk(2, dim=-1)
    odd = (x < 0).sum(-1) % 2 == 1
    low, at_low = ax.min(-1)
    axis = torch.cat([ax[:, :DIM - 1], x[:, DIM - 1:]], -1)          # −2e₇ is not in the ball
    far, at_far = axis.max(-1)
    gains = torch.stack([torch.zeros_like(far), 2 * top2.sum(-1) - 2,
                         ax.sum(-1) - 2 * low * odd - 2, 4 * far - 4], -1)
    kind = gains.argmax(-1)
    root = torch.zeros_like(x).scatter_(1, at2, sgn.gather(1, at2))
    flip = torch.where(odd, -0.5, 0.5)[:, None] * sgn.gather(1, at_low[:, None])
    half = (0.5 * sgn).scatter_(1, at_low[:, None], flip)
    axis_sign = torch.where(at_far == DIM - 1, 1.0, sgn.gather(1, at_far[:, None]).squeeze(1)).to(x.dtype)
    spike = torch.zeros_like(x).scatter_(1, at_far[:, None], (2 * axis_sign)[:, None])
    kinds = torch.stack([torch.zeros_like(x), root, half, spike], 1)   # [N, 4, 8]
    return kinds[torch.arange(len(x), device=x.device), kind]


def in_ball256(p: torch.Tensor) -> torch.Tensor:
    return cb.table_index(cb.BALL, p)[1]
