"""E8 codebooks and block Babai (BlockLDLQ, QuIP#): a weight quantized eight input columns at a time,
each block to a point of an E8 codebook (E8P, a ball of E8 + ¼, with residual stages), blocks processed
back to front on the block LDL of H, each block's point searched in its own metric D_k; the blocks any
eight columns (min-pivot by blocks). The design and the screen: docs/KERNELS.md#e8-codebooks."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable

import torch

from .. import native
from ..format import codebook as cb, scale_codes
from ..format.codebook import DIM, e8_ball256, e8p_patterns, in_e8p
from . import lattice
from .result import QuantResult
from .scales import to_fp16_grid

FALLBACK_CHUNK = 4096   # blocks searched at a time by the exhaustive path (bounds its temporaries)
NEAREST_CHUNK = 16384   # blocks a whole-matrix search takes at a time: ~2 KB of temporaries a block


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


def _native(x: torch.Tensor) -> bool:
    """The searches' C++ ops (``algorithms/csrc/e8.cpp``: the same points, a block at a time) for CPU rows."""
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and native.usable()


def nearest_e8p(x: torch.Tensor, D: torch.Tensor | None = None) -> torch.Tensor:
    """Nearest E8P point to each row of ``x [N, 8]`` (exact); with a metric ``D`` that point improved
    in ``(p − x)ᵀD(p − x)`` by :func:`metric_descent`."""
    if _native(x):
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


def metric_descent(p: torch.Tensor, x: torch.Tensor, D: torch.Tensor, member, rounds: int = 3,
                   tries: int = 8) -> torch.Tensor:
    """Local search from codebook points ``p`` toward the nearest to ``x`` in the metric ``D``: moves to
    the best admitted neighbour p + r (r a root of E8) while one improves; never farther than ``p``."""
    if member is in_e8p and _native(x):   # E8P's: the C++ op, a block at a time
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
    if D is not None and _native(x):
        return torch.ops.latq_cpu.nearest_in_metric(x, book, D)
    book = book.to(x.device, x.dtype)
    Dc = book.T if D is None else D.to(x.device, x.dtype) @ book.T
    return book[(2 * x @ Dc - (book * Dc.T).sum(-1)).argmax(-1)]


def nearest_ball256(x: torch.Tensor, D: torch.Tensor | None = None) -> torch.Tensor:
    """The ball's nearest point to each row of ``x``: Euclidean in closed form, in ``D`` by the whole ball."""
    if D is not None:
        return nearest_in(x, e8_ball256(), D)
    return torch.ops.latq_cpu.ball256_nearest(x) if _native(x) else _nearest_ball_euclid(x)


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


# ----------------------------------------------------------------------------- codes: stages of codebooks

COVERING_RADIUS = 1.0   # E8's (minimal norm √2): no point of space lies farther from the lattice


@dataclass(frozen=True)
class Search:
    """A stage's searches: Euclidean nearest, then refined in D (never farther); ``keeps_error``: the
    book holds the origin and ``refine`` is exact, so the stage never adds error."""
    euclid: Callable
    refine: Callable
    keeps_error: bool


SEARCH = {cb.E8P: Search(nearest_e8p, lambda p, t, D: metric_descent(p, t, D, in_e8p), False),
          cb.BALL: Search(nearest_ball256, lambda p, t, D: nearest_ball256(t, D), True)}


@dataclass(frozen=True)
class VectorCode:
    """A format :class:`~vllm_latq.format.codebook.Codebook` with its searches: stage i rounds the
    residual times its gain to its nearest point."""
    book: cb.Codebook

    @property
    def name(self) -> str:
        return self.book.name

    @property
    def bits_per_weight(self) -> float:
        return float(self.book.bits)

    def points(self, x: torch.Tensor, D: torch.Tensor | None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Each stage's point for the rows of ``x [N, 8]`` (stage units), searched in ``D``; and each row's
        certified radius (inf: an overload), the rule of docs/FORMAT.md, "kind codebook"."""
        v, out = torch.zeros_like(x), []
        radius = torch.full(x.shape[:1], math.inf, dtype=torch.float64, device=x.device)
        for stage in self.book.stages:
            target = (x - v) * stage.gain
            search = SEARCH[stage.book]
            p = search.euclid(target)
            within = (target - p).square().sum(-1) <= COVERING_RADIUS ** 2 * (1 + 1e-9)
            kept = radius if search.keeps_error else torch.full_like(radius, math.inf)
            radius = torch.where(within, torch.full_like(radius, COVERING_RADIUS / stage.gain), kept)
            out.append(p if D is None else search.refine(p, target, D))
            v = v + out[-1] / stage.gain
        return out, radius

    def nearest(self, x: torch.Tensor, D: torch.Tensor | None = None) -> torch.Tensor:
        """The code's point for each row of ``x [N, 8]``, every stage in the metric ``D`` (None: Euclidean);
        :data:`NEAREST_CHUNK` rows at a time, so a whole matrix's search holds no [N, 256] temporaries."""
        if D is None and _native(x):   # every stage in one C++ call, a block at a time
            kinds = [{cb.E8P: 0, cb.BALL: 1}[s.book] for s in self.book.stages]
            return torch.ops.latq_cpu.e8_code_nearest(x, e8p_patterns(), kinds, [s.gain for s in self.book.stages])
        out = torch.empty_like(x)
        for i in range(0, len(x), NEAREST_CHUNK):
            pts, _ = self.points(x[i:i + NEAREST_CHUNK], D)
            out[i:i + NEAREST_CHUNK] = sum(p / s.gain for p, s in zip(pts, self.book.stages))
        return out


CODES = {bits: VectorCode(book) for bits, book in cb.CODEBOOKS.items()}


# ----------------------------------------------------------------------------- scales

def _check_blocks(c: int, group_size: int | None) -> None:
    if c % DIM or (group_size or DIM) % DIM:
        raise ValueError(f"E8 blocks need in ({c}) and the group ({group_size}) to be multiples of {DIM}")


def code_scales(W: torch.Tensor, code: VectorCode, group_size: int | None = None, coarse: int = 7,
                fine: int = 2, lo: float = 0.75, hi: float = 1.35) -> torch.Tensor:
    """Per group of ``group_size`` columns (the last may be ragged; None: per row) the fp16 scale
    s = f·rms(w) minimising the code's round-to-nearest error (as ``mse_scales`` for the grid), f on a
    geometric grid over [lo, hi] then finer → ``[out, groups]``."""
    r, c = W.shape
    _check_blocks(c, group_size)
    Wb = W.float().reshape(r, c // DIM, DIM)
    grp = cb.groups_of_blocks(c, group_size, W.device)
    ng = int(grp[-1]) + 1

    def per_group(x):   # [r, blocks] → [r, groups]
        return x.new_zeros(r, ng).index_add_(1, grp, x)
    rms = (per_group(Wb.square().sum(-1)) / (torch.bincount(grp, minlength=ng) * DIM)).sqrt().clamp(min=1e-12)
    ratio = (hi / lo) ** (1 / (coarse - 1))
    best = None   # (factor, scale, error) per group

    def consider(f, best):
        s = to_fp16_grid(rms * f)
        sb = s[:, grp, None]
        e = per_group((sb * code.nearest((Wb / sb).reshape(-1, DIM)).reshape(Wb.shape) - Wb).square().sum(-1))
        f = torch.as_tensor(f, dtype=rms.dtype, device=rms.device).expand_as(rms)
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
    blocks = torch.arange(c // DIM, device=H.device)
    if order == "act":   # ascending trace: back to front takes the largest first
        blocks = torch.argsort(H.diagonal().reshape(-1, DIM).sum(1), stable=True)
    return (blocks[:, None] * DIM + torch.arange(DIM, device=H.device)).reshape(-1)


def block_min_pivot(H: torch.Tensor, damp: float = 0.01) -> torch.Tensor:
    """Paper v1 Alg. 4 by blocks: T built front to back, each block the eight columns of smallest
    Schur-complement diagonal eliminated together (greedily minimises Σ tr D_k)."""
    S = lattice.damped(H, damp)
    left = torch.arange(S.shape[0], device=S.device)   # S: the Schur complement on the columns not yet taken
    T = []
    while len(left):
        pick = S.diagonal().topk(DIM, largest=False).indices
        keep = torch.ones(len(left), dtype=torch.bool, device=S.device)
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
    eye = torch.eye(DIM, dtype=A.dtype, device=A.device).expand(K, DIM, DIM)
    inv = torch.linalg.solve_triangular(Akk, eye, upper=True)
    U = (inv @ A.reshape(K, DIM, c)).reshape(c, c)
    return BlockLDL(T, U, Akk.transpose(1, 2) @ Akk, damp_used)


def certificate(D: torch.Tensor, block_scales: torch.Tensor, radius: torch.Tensor) -> torch.Tensor:
    """Per row, ``Σ_k s_k²·λmax(D_k)·r_k²`` (blocks ``D [K, 8, 8]``, scales and radii ``[K, out]``):
    block Babai's error bound, inf on a row with an overload."""
    lam = torch.linalg.eigvalsh(D.double())[:, -1]
    return (lam[:, None] * block_scales.double().square() * radius.to(lam.device).square()).sum(0)


def _whole_groups(T: torch.Tensor, group_size: int) -> bool:
    """Whether every block (eight consecutive entries of T) lies inside one group of columns."""
    g = (T // group_size).reshape(-1, DIM)
    return bool((g == g[:, :1]).all())


@dataclass
class BlockResult:
    """Block Babai's ``q``, scales, bits, order, stages' points, rows' overloads, :func:`certificate`."""
    q: torch.Tensor
    scales: torch.Tensor
    group_size: int | None
    code: VectorCode
    bits_per_weight: float
    T: torch.Tensor
    stage_points: list = field(default_factory=list)
    overloads: torch.Tensor | None = None
    bound: torch.Tensor | None = None
    damp: float | None = None


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
    _check_blocks(c, group_size)
    if scales is None:
        scales = code_scales(W, code, group_size)
    T = block_order(H, order, damp) if isinstance(order, str) else order
    if not lattice.is_permutation(T, c):
        raise ValueError(f"order must be one of {BLOCK_ORDERS} or a permutation of range({c})")
    if group_size and not _whole_groups(T, group_size):
        raise ValueError("group scales need each block inside one group: use order natural or act")
    ldl = block_ldl(H, T, damp, name)
    X = W.double().T[T].contiguous()                   # [in, out] in order T
    Y = X.clone()                                      # the targets, fed as later blocks are fixed
    Q = torch.empty_like(X)
    P = [torch.empty(c, r, device=X.device) for _ in code.book.stages]  # each stage's points, code units
    S = scales.double().T                              # [groups, out]
    grp = T[::DIM] // (group_size or c)                # each block's group
    radius = torch.empty(c // DIM, r, dtype=torch.float64, device=X.device)
    for k in range(c // DIM - 1, -1, -1):
        j = k * DIM
        s = S[int(grp[k])][:, None]
        pts, radius[k] = code.points(Y[j:j + DIM].T / s, ldl.D[k] if metric else None)
        Q[j:j + DIM] = (s * sum(p / st.gain for p, st in zip(pts, code.book.stages))).T
        for Pi, p in zip(P, pts):
            Pi[j:j + DIM] = p.T
        if j:
            Y[:j].addmm_(ldl.U[:j, j:j + DIM], X[j:j + DIM] - Q[j:j + DIM])
    bound = certificate(ldl.D, S[grp], radius)
    q, pts = torch.empty_like(X), [torch.empty_like(p) for p in P]
    q[T] = Q
    for Pi, p in zip(P, pts):
        p[T] = Pi
    bits = code.bits_per_weight + 16 * scales.numel() / W.numel()
    return BlockResult(q.T.to(W.dtype if W.dtype == torch.float64 else torch.float32).contiguous(), scales,
                       group_size, code, bits, T, [p.T.contiguous() for p in pts], torch.isinf(radius).sum(0), bound,
                       ldl.damp)


# ----------------------------------------------------------------------------- the method

E8_ORDERS = ("act", "natural")   # blocks of neighbouring columns: the input needs no permutation at serving


def e8(W: torch.Tensor, H: torch.Tensor, *, bits: int, group_size: int | None = 64, scale_bits: int | None = None,
       order: str = "act", damp: float = 0.01, name: str | None = None) -> QuantResult:
    """The method ``e8``: block Babai with the ``bits`` code, scales per ``group_size`` columns, coded
    in ``scale_bits`` (None: fp16); ``bound`` holds on rows where ``info["overloads"]`` is 0."""
    if bits not in CODES:
        raise ValueError(f"e8 codes have {', '.join(map(str, CODES))} bits a weight, not {bits}")
    if order not in E8_ORDERS:
        raise ValueError(f"e8 blocks are eight neighbouring columns: order {' or '.join(E8_ORDERS)}, not {order}")
    code = CODES[bits]
    S = code_scales(W, code, group_size)
    coded = None if scale_bits is None else scale_codes.code_scales(S, scale_bits)
    S = S if coded is None else coded.decode()
    res = block_babai(W, H, code, group_size=group_size, scales=S, order=order, damp=damp, name=name)
    r, c = W.shape
    codes = cb.encode([p.reshape(r, c // DIM, DIM) for p in res.stage_points], code.book)
    scale_storage = 16 * S.numel() if coded is None else scale_codes.stored_bits(*S.shape)
    return QuantResult("e8", None, res.q, S, group_size, bits, bits + scale_storage / W.numel(), order=res.T,
                       damp=res.damp, bound=res.bound, info={"overloads": res.overloads}, coded_scales=coded,
                       codes=codes)
