"""E8 codebooks and block Babai (BlockLDLQ, QuIP#): a weight quantized eight input columns at a time,
each block to a point of an E8 codebook (E8P, a ball of E8 + ¼, with residual stages), blocks processed
back to front on the block LDL of H, each block's point searched in its own metric D_k; the blocks any
eight columns (min-pivot by blocks). The design and the screen: docs/KERNELS.md#e8-codebooks."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from . import lattice
from .scales import to_fp16_grid

DIM = 8          # the block: E8's dimension
FALLBACK_CHUNK = 4096   # blocks searched at a time by the exhaustive path (bounds its temporaries)


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

def _half_odd_patterns(max_norm2: float) -> torch.Tensor:
    """Every vector of positive half-odd-integers (½, 3/2, 5/2, …) with squared norm ≤ ``max_norm2``."""
    top = int(math.sqrt(max_norm2 - (DIM - 1) * 0.25) + 0.5)
    vals = [k + 0.5 for k in range(top)]
    out = [p for p in itertools.product(vals, repeat=DIM) if sum(v * v for v in p) <= max_norm2 + 1e-9]
    return torch.tensor(out, dtype=torch.float64)


@lru_cache(maxsize=None)
def e8p_patterns() -> torch.Tensor:
    """E8P's 256 absolute patterns ``[256, 8]`` fp64: the 227 half-odd vectors of squared norm ≤ 10 and
    the 29 lexicographically largest of the 56 of type (3/2)⁵(½)³."""
    inner = _half_odd_patterns(10.0)
    twelve = [p for p in itertools.permutations((1.5,) * 5 + (0.5,) * 3)]
    extra = sorted(set(twelve), reverse=True)[:256 - len(inner)]
    return torch.cat([inner, torch.tensor(extra, dtype=torch.float64)])


@lru_cache(maxsize=None)
def _pattern_table() -> torch.Tensor:
    """bool ``[3⁸]``: whether the pattern (k_i + ½) is in the table (key Σ k_i·3^i)."""
    table = torch.zeros(3 ** DIM, dtype=torch.bool)
    table[_pattern_keys(e8p_patterns())] = True
    return table


def _pattern_keys(a: torch.Tensor) -> torch.Tensor:
    """Absolute patterns ``[..., 8]`` → keys into :func:`_pattern_table` (−1: a coordinate ≥ 7/2)."""
    k = torch.round(a - 0.5).long()
    key = (k * torch.tensor([3 ** i for i in range(DIM)])).sum(-1)
    return torch.where((k > 2).any(-1), -1, key)


def e8p_codebook() -> torch.Tensor:
    """All 2¹⁶ E8P points ``[65536, 8]`` fp64: pattern a, signs σ with Σσa even, shift ±¼."""
    a = e8p_patterns()
    signs = torch.tensor(list(itertools.product((1.0, -1.0), repeat=DIM)), dtype=torch.float64)
    pts = (signs[None] * a[:, None]).reshape(-1, DIM)
    pts = pts[(pts.sum(-1) % 2) == 0]
    return torch.cat([pts + 0.25, pts - 0.25])


def _e8p_shift_search(y: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The nearest point of {σ⊙a : a a pattern, Σσa even} to each row of ``y`` → (point, squared
    distance); the ``top`` patterns nearest without the parity first, all of them where that can miss."""
    a = e8p_patterns().to(y.dtype)
    sgn = torch.where(y < 0, -1.0, 1.0).to(y.dtype)
    ay = y.abs()
    free = ay.square().sum(-1, keepdim=True) - 2 * ay @ a.T + a.square().sum(-1)   # [N, 256]
    # a pattern's best signs are y's, the cheapest coordinate (least |y_i|·a_i) flipped where Σσa is odd;
    # the flip only adds, so a row whose best beats the next pattern's parity-free distance is done
    near, cand = free.topk(top + 1, dim=-1, largest=False)
    best_d, best = _fixed_parity(ay, sgn, a, cand[:, :top], free)
    rest = best_d > near[:, top]
    if rest.any():
        every = torch.arange(len(a)).expand(int(rest.sum()), len(a))
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
    return dmin, s * ac[torch.arange(len(k)), k]


def _e8p_exhaustive(x: torch.Tensor, top: int = 16) -> torch.Tensor:
    """E8P's nearest point by the pattern search for both shifts (exact)."""
    p_plus, d_plus = _e8p_shift_search(x - 0.25, top)
    p_minus, d_minus = _e8p_shift_search(x + 0.25, top)
    return torch.where((d_plus <= d_minus)[:, None], p_plus + 0.25, p_minus - 0.25)


def in_e8p(p: torch.Tensor) -> torch.Tensor:
    """Whether each point ``p [..., 8]`` of E8 + ¼ is an E8P point (its pattern in the table)."""
    half = (torch.remainder(p - 0.25, 1.0) == 0.5).all(-1, keepdim=True)   # p − ¼ ∈ D8 + ½
    keys = _pattern_keys(torch.where(half, p - 0.25, p + 0.25).abs())
    return (keys >= 0) & _pattern_table()[keys.clamp(min=0)]


def nearest_e8p(x: torch.Tensor, D: torch.Tensor | None = None) -> torch.Tensor:
    """Nearest E8P point to each row of ``x [N, 8]`` (exact); with a metric ``D`` that point improved
    in ``(p − x)ᵀD(p − x)`` by :func:`metric_descent`."""
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


def metric_descent(p: torch.Tensor, x: torch.Tensor, D: torch.Tensor, member, rounds: int = 3,
                   tries: int = 8) -> torch.Tensor:
    """Local search from codebook points ``p`` toward the nearest to ``x`` in the metric ``D``: moves to
    the best admitted neighbour p + r (r a root of E8) while one improves; never farther than ``p``."""
    R = e8_roots().to(x.dtype)
    D = D.to(x.dtype)
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
        p = torch.where(move[:, None], cand[torch.arange(len(k)), k], p)
    return p


# ----------------------------------------------------------------------------- a 1-bit ball of E8

@lru_cache(maxsize=None)
def e8_ball256() -> torch.Tensor:
    """The origin, E8's 240 roots and 15 of the 16 vectors ±2eᵢ: 256 points, a 1-bit residual stage."""
    roots = [v for v in itertools.product((-1.0, 0.0, 1.0), repeat=DIM) if sum(map(abs, v)) == 2]
    roots += [v for v in itertools.product((-0.5, 0.5), repeat=DIM) if sum(v) % 2 == 0]
    axes = [tuple(2.0 * s if j == i else 0.0 for j in range(DIM)) for s in (1, -1) for i in range(DIM)][:15]
    return torch.tensor([(0.0,) * DIM] + roots + axes, dtype=torch.float64)


def nearest_in(x: torch.Tensor, book: torch.Tensor, D: torch.Tensor | None = None) -> torch.Tensor:
    """Nearest row of ``book [n, 8]`` to each row of ``x [N, 8]``, in the metric ``D`` where given."""
    book = book.to(x.dtype)
    Dc = book.T if D is None else D.to(x.dtype) @ book.T
    return book[(2 * x @ Dc - (book * Dc.T).sum(-1)).argmax(-1)]


def nearest_ball256(x: torch.Tensor, D: torch.Tensor | None = None) -> torch.Tensor:
    return nearest_in(x, e8_ball256(), D)


# ----------------------------------------------------------------------------- codes: stages of codebooks

@dataclass(frozen=True)
class VectorCode:
    """A codebook as greedy residual stages: stage i rounds the residual times ``gain_i`` to its
    nearest point; ``index_bits`` per 8-weight block, all stages."""
    name: str
    index_bits: int
    stages: tuple

    @property
    def bits_per_weight(self) -> float:
        return self.index_bits / DIM

    def nearest(self, x: torch.Tensor, D: torch.Tensor | None = None) -> torch.Tensor:
        """The code's point for each row of ``x [N, 8]``, every stage in the metric ``D`` (None: Euclidean)."""
        v = torch.zeros_like(x)
        for nearest, gain in self.stages:
            v = v + nearest((x - v) * gain, D) / gain
        return v


# The residual gains minimise the mean squared error of unit Gaussian blocks at their best scale.
CODES = {
    2: VectorCode("e8p", 16, ((nearest_e8p, 1.0),)),
    3: VectorCode("e8p+ball256", 24, ((nearest_e8p, 1.0), (nearest_ball256, 2.0))),
    4: VectorCode("e8p+e8p", 32, ((nearest_e8p, 1.0), (nearest_e8p, 4.0))),
}


# ----------------------------------------------------------------------------- scales

def _blocks(W: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """``[out, in]`` → ``[out, groups, blocks per group, 8]`` (one group per row when None)."""
    r, c = W.shape
    g = group_size or c
    if c % DIM or g % DIM or c % g:
        raise ValueError(f"E8 blocks need in ({c}) and the group ({g}) to be multiples of {DIM}, "
                         f"the group dividing in")
    return W.reshape(r, c // g, g // DIM, DIM)


def code_scales(W: torch.Tensor, code: VectorCode, group_size: int | None = None, coarse: int = 7,
                fine: int = 2, lo: float = 0.75, hi: float = 1.35) -> torch.Tensor:
    """Per row (or group) the fp16 scale s = f·rms(w) minimising the code's round-to-nearest error
    (as ``mse_scales`` for the grid), f on a geometric grid over [lo, hi] then finer → ``[out, groups]``."""
    Wb = _blocks(W.float(), group_size)
    rms = Wb.square().mean((-1, -2)).sqrt().clamp(min=1e-12)
    ratio = (hi / lo) ** (1 / (coarse - 1))
    best = None   # (factor, scale, error) per group

    def consider(f, best):
        s = to_fp16_grid(rms * f)
        e = (s[..., None, None] * code.nearest((Wb / s[..., None, None]).reshape(-1, DIM)).reshape(Wb.shape)
             - Wb).square().sum((-1, -2))
        f = torch.as_tensor(f, dtype=rms.dtype).expand_as(rms)
        if best is None:
            return f, s, e
        better = e < best[2]
        return torch.where(better, f, best[0]), torch.where(better, s, best[1]), torch.minimum(e, best[2])

    for k in range(coarse):
        best = consider(lo * ratio ** k, best)
    center = best[0]
    for k in range(1, fine + 1):   # strictly between the coarse neighbours of each group's best
        best = consider(center * ratio ** (2 * k / (fine + 1) - 1), best)
    return best[1].float()


# ----------------------------------------------------------------------------- block LDL and block Babai

BLOCK_ORDERS = ("natural", "act", "min-pivot")


def block_order(H: torch.Tensor, order: str = "natural", damp: float = 0.01) -> torch.Tensor:
    """Babai's column order T, blocks its consecutive eights: ``natural`` and ``act`` (by block trace)
    keep neighbouring columns, ``min-pivot`` (:func:`block_min_pivot`) any eight."""
    c = H.shape[0]
    if order not in BLOCK_ORDERS:
        raise ValueError(f"unknown block order {order!r}: use one of {BLOCK_ORDERS}")
    if order == "min-pivot":
        return block_min_pivot(H, damp)
    blocks = torch.arange(c // DIM)
    if order == "act":   # ascending trace: back to front takes the largest first
        blocks = torch.argsort(H.diagonal().reshape(-1, DIM).sum(1), stable=True)
    return (blocks[:, None] * DIM + torch.arange(DIM)).reshape(-1)


def block_min_pivot(H: torch.Tensor, damp: float = 0.01) -> torch.Tensor:
    """Paper v1 Alg. 4 by blocks: T built front to back, each block the eight columns of smallest
    Schur-complement diagonal eliminated together (greedily minimises Σ tr D_k)."""
    S = lattice.damped(H, damp)
    left = torch.arange(S.shape[0])       # S: the Schur complement on the columns not yet taken
    T = []
    while len(left):
        pick = S.diagonal().topk(DIM, largest=False).indices
        keep = torch.ones(len(left), dtype=torch.bool)
        keep[pick] = False
        SB = S[keep][:, pick]
        S = S[keep][:, keep] - SB @ torch.linalg.solve(S[pick][:, pick], SB.T)
        T.append(left[pick].sort().values)
        left = left[keep]
    return torch.cat(T)


@dataclass
class BlockLDL:
    """``(H_d)_TT = Uᵀ·blockdiag(D)·U``, U unit block upper (``U = diag(A_kk)⁻¹A``, AᵀA = (H_d)_TT) and
    ``D_k = A_kkᵀA_kk`` ``[blocks, 8, 8]``."""
    T: torch.Tensor
    U: torch.Tensor
    D: torch.Tensor
    damp: float


def block_ldl(H: torch.Tensor, T: torch.Tensor, damp: float = 0.01, name: str | None = None) -> BlockLDL:
    L, damp_used = lattice.cholesky(H, damp, T, name)
    c = L.shape[0]
    K = c // DIM
    A = L.T
    Akk = A.reshape(K, DIM, K, DIM).diagonal(dim1=0, dim2=2).permute(2, 0, 1)        # [K, 8, 8]
    inv = torch.linalg.solve_triangular(Akk, torch.eye(DIM, dtype=A.dtype).expand(K, DIM, DIM), upper=True)
    U = (inv @ A.reshape(K, DIM, c)).reshape(c, c)
    return BlockLDL(T, U, Akk.transpose(1, 2) @ Akk, damp_used)


def _whole_groups(T: torch.Tensor, group_size: int) -> bool:
    """Whether every block (eight consecutive entries of T) lies inside one group of columns."""
    g = (T // group_size).reshape(-1, DIM)
    return bool((g == g[:, :1]).all())


@dataclass
class BlockResult:
    """A block Babai solution: ``q`` in W's frame, scales, stored bits a weight, Babai's order ``T``."""
    q: torch.Tensor
    scales: torch.Tensor
    group_size: int | None
    code: VectorCode
    bits_per_weight: float
    T: torch.Tensor


@torch.no_grad()
def block_babai(W: torch.Tensor, H: torch.Tensor, code: VectorCode, *, group_size: int | None = None,
                scales: torch.Tensor | None = None, order: str | torch.Tensor = "natural", damp: float = 0.01,
                metric: bool = True, name: str | None = None) -> BlockResult:
    """Block Babai: for blocks k = last … first of ``order`` (a name or T), ``t_k = w_k + Σ_{l>k}
    U_kl (w_l − q_l)`` is rounded to ``q_k = s·nearest(t_k / s)``, in D_k's metric where ``metric`` (else
    Euclidean, QuIP#'s BlockLDLQ); the error is Σ_k (q_k − t_k)ᵀD_k(q_k − t_k). ``scales`` per row
    (``group_size`` None) or group, from :func:`code_scales` when not given."""
    lattice.check_inputs(W, H, name)
    r, c = W.shape
    if scales is None:
        scales = code_scales(W, code, group_size)
    _blocks(W, group_size)   # the shape check
    T = block_order(H, order, damp) if isinstance(order, str) else order
    if not lattice.is_permutation(T, c):
        raise ValueError(f"order must be one of {BLOCK_ORDERS} or a permutation of range({c})")
    if group_size and not _whole_groups(T, group_size):
        raise ValueError("group scales need each block inside one group: use order natural or act")
    ldl = block_ldl(H, T, damp, name)
    X = W.double().T[T].contiguous()                   # [in, out] in order T
    Y = X.clone()                                      # the targets, fed as later blocks are fixed
    Q = torch.empty_like(X)
    S = scales.double().T                              # [groups, out]
    g = group_size or c
    for k in range(c // DIM - 1, -1, -1):
        j = k * DIM
        s = S[int(T[j]) // g][:, None]                 # the block's group (all its columns')
        Q[j:j + DIM] = (s * code.nearest(Y[j:j + DIM].T / s, ldl.D[k] if metric else None)).T
        if j:
            Y[:j].addmm_(ldl.U[:j, j:j + DIM], X[j:j + DIM] - Q[j:j + DIM])
    q = torch.empty_like(X)
    q[T] = Q
    bits = code.bits_per_weight + 16 * scales.numel() / W.numel()
    return BlockResult(q.T.to(W.dtype if W.dtype == torch.float64 else torch.float32).contiguous(), scales,
                       group_size, code, bits, T)
