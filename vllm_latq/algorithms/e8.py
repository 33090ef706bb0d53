"""E8 codebooks and block Babai (BlockLDLQ, QuIP#): a weight quantized eight input columns at a time,
each block to a point of an E8 codebook (E8P, a ball of E8 + ¼, with residual stages), blocks processed
back to front on the block LDL of H, each block's point searched in its own metric D_k; the blocks any
eight columns (min-pivot by blocks). The design and the screen: docs/KERNELS.md#e8-codebooks."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..format import codebook as cb, scale_codes
from ..format.codebook import DIM, e8_ball256, e8p_patterns, in_e8p
from . import lattice
from .e8_lattice import (DESCENT_ROUNDS, DESCENT_TRIES, cpp_rows, e8_roots, e8p_codebook,  # noqa: F401
                         in_ball256, metric_descent, nearest_ball256, nearest_d8, nearest_e8, nearest_e8p, nearest_in)
from .result import QuantResult
from .scales import to_fp16_grid

NEAREST_CHUNK = 16384   # blocks a whole-matrix search takes at a time: ~2 KB of temporaries a block
SWEEP_CHUNK = 16        # blocks whose targets block Babai feeds at once (GPTQ's lazy batch)


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

    @property
    def cpp_stages(self) -> tuple[list[int], list[float]]:
        # the stages as the C++ ops take them: kinds (0 E8P, 1 the ball) and gains
        return [{cb.E8P: 0, cb.BALL: 1}[s.book] for s in self.book.stages], [s.gain for s in self.book.stages]

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
        if D is None and cpp_rows(x):   # every stage in one C++ call, a block at a time
            return torch.ops.latq_cpu.e8_code_nearest(x, e8p_patterns(), *self.cpp_stages)
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


@dataclass(frozen=True)
class ScaleSearch:
    """Scale factors of a group's rms tried: ``coarse`` on a geometric grid over [lo, hi], then ``fine``
    strictly between the best one's neighbours."""
    coarse: int
    fine: int
    lo: float
    hi: float


# Five coarse factors keep the nine's layer error at 3 bits on a real model, and lose it at 2 and 4 bits;
# narrower ranges lose at 3 (docs/KERNELS.md, "Quantization cost").
_WIDE = ScaleSearch(7, 2, 0.75, 1.35)
SCALE_SEARCH = {2: _WIDE, 3: ScaleSearch(5, 2, 0.75, 1.35), 4: _WIDE}


def code_scales(W: torch.Tensor, code: VectorCode, group_size: int | None = None,
                search: ScaleSearch | None = None) -> torch.Tensor:
    """Per group of ``group_size`` columns (the last may be ragged; None: per row) the fp16 scale
    s = f·rms(w) minimising the code's round-to-nearest error (as ``mse_scales`` for the grid), f from
    ``search`` (None: the code's :data:`SCALE_SEARCH`) → ``[out, groups]``; of equal errors, the first tried."""
    r, c = W.shape
    _check_blocks(c, group_size)
    search = search or SCALE_SEARCH[code.book.bits]
    Wf = W.float()
    grp = cb.groups_of_blocks(c, group_size, W.device)
    ng = int(grp[-1]) + 1
    sq = Wf.reshape(r, c // DIM, DIM).square().sum(-1)
    rms = sq.new_zeros(r, ng).index_add_(1, grp, sq) / (torch.bincount(grp, minlength=ng) * DIM)
    rms = rms.sqrt().clamp(min=1e-12)
    ratio = (search.hi / search.lo) ** (1 / max(search.coarse - 1, 1))
    factors = [search.lo * ratio ** k for k in range(search.coarse)]
    S = torch.stack([to_fp16_grid(rms * f) for f in factors])
    E = rounding_errors(Wf, S, code, grp)
    k = E.argmin(0, keepdim=True)   # the first least: a scan that keeps only strict improvements
    if search.fine:   # strictly between the coarse neighbours of each group's best
        center = torch.tensor(factors, dtype=rms.dtype, device=rms.device)[k[0]]
        fine_S = torch.stack([to_fp16_grid(rms * (center * ratio ** (2 * i / (search.fine + 1) - 1)))
                              for i in range(1, search.fine + 1)])
        S, E = torch.cat([S.gather(0, k), fine_S]), torch.cat([E.gather(0, k), rounding_errors(Wf, fine_S, code, grp)])
        k = E.argmin(0, keepdim=True)
    return S.gather(0, k)[0].float()


def rounding_errors(W: torch.Tensor, S: torch.Tensor, code: VectorCode, grp: torch.Tensor) -> torch.Tensor:
    """Each group's Σ ‖s·nearest(w/s) − w‖² for candidate scales ``S [n, out, groups]`` → ``[n, out, groups]``."""
    if cpp_rows(W):   # one C++ call: no [n, out, in] temporaries
        return torch.ops.latq_cpu.e8_code_errors(W, S, grp, e8p_patterns(), *code.cpp_stages)
    r, c = W.shape
    Wb = W.reshape(r, c // DIM, DIM)
    out = []
    for s in S:
        sb = s[:, grp, None]
        e = (sb * code.nearest((Wb / sb).reshape(-1, DIM)).reshape(Wb.shape) - Wb).square().sum(-1)
        out.append(e.new_zeros(s.shape).index_add_(1, grp, e))
    return torch.stack(out)


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
    S = scales.double().T.contiguous()                 # [groups, out]
    grp = T[::DIM] // (group_size or c)                # each block's group
    Q, P, radius = (cpp_sweep if cpp_rows(X) else babai_sweep)(X, ldl, S, grp, code, metric)
    bound = certificate(ldl.D, S[grp], radius)
    q, pts = torch.empty_like(Q), torch.empty_like(P)
    q[T] = Q
    pts[:, T] = P
    bits = code.bits_per_weight + 16 * scales.numel() / W.numel()
    return BlockResult(q.T.to(W.dtype if W.dtype == torch.float64 else torch.float32).contiguous(), scales,
                       group_size, code, bits, T, [p.T.contiguous() for p in pts], torch.isinf(radius).sum(0), bound,
                       ldl.damp)


def babai_sweep(X: torch.Tensor, ldl: BlockLDL, S: torch.Tensor, grp: torch.Tensor, code: VectorCode,
                metric: bool = True, chunk: int = SWEEP_CHUNK):
    """Block Babai's sweep on ``X [in, out]`` (Babai's order, scales ``S [groups, out]``, blocks' groups ``grp``)
    → (Q, stages' points ``[stages, in, out]``, radii ``[blocks, out]``); targets fed lazily (GPTQ's lazy batch)."""
    c, r = X.shape
    Y, Q = X.clone(), torch.empty_like(X)
    P = torch.empty(len(code.book.stages), c, r, device=X.device)
    radius = torch.empty(c // DIM, r, dtype=torch.float64, device=X.device)
    for k in range(c // DIM - 1, -1, -1):
        j, j0 = k * DIM, k // chunk * chunk * DIM    # the block's and its chunk's first column
        s = S[int(grp[k])][:, None]
        pts, radius[k] = code.points(Y[j:j + DIM].T / s, ldl.D[k] if metric else None)
        Q[j:j + DIM] = (s * sum(p / st.gain for p, st in zip(pts, code.book.stages))).T
        P[:, j:j + DIM] = torch.stack(pts).transpose(1, 2)
        Y[j0:j].addmm_(ldl.U[j0:j, j:j + DIM], X[j:j + DIM] - Q[j:j + DIM])
        if j == j0 and j0:
            done = slice(j0, j0 + chunk * DIM)
            Y[:j0].addmm_(ldl.U[:j0, done], X[done] - Q[done])
    return Q, P, radius


def cpp_sweep(X: torch.Tensor, ldl: BlockLDL, S: torch.Tensor, grp: torch.Tensor, code: VectorCode,
              metric: bool = True, chunk: int = SWEEP_CHUNK):
    """:func:`babai_sweep` as one C++ call (``algorithms/csrc/e8_sweep.cpp``): the same searches and GEMMs."""
    return tuple(torch.ops.latq_cpu.e8_block_babai(
        X, ldl.U, ldl.D.contiguous(), S, grp, e8p_patterns(), e8_roots(), e8_ball256(), *code.cpp_stages, metric,
        DESCENT_ROUNDS, DESCENT_TRIES, chunk))


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
