"""Lattice decoders beyond Babai's nearest plane, for the same problem: ``min ‖A(q − w)‖²`` over
the grid, A the upper Cholesky factor of the damped Hessian in Babai's order (``AᵀA = (H_d)_TT``),
back to front. Babai rounds each ``ω_j`` (the target less the decided ones' pull) greedily:

* :func:`kbest` — the K-best beam: each survivor branches to the two grid points around its
  ``ω_j``, the K cheapest partial paths survive;
* :func:`klein` — Klein's randomized nearest plane: K draws, each rounding ``ω_j/s`` down or up at
  random (Gaussian weights, width ``tau`` grid steps), draw 0 Babai's own.

The solvers (``solvers.decoded_sweep``) keep per row the closer of its point and Babai's
(:func:`lattice_distance`): never farther than Babai, so unclipped Babai's certificate holds too.
"""
from __future__ import annotations

import torch

DECODERS = ("babai", "kbest", "klein")
MAX_BEAM = 1 << 12   # survivors / draws: the solve time and the [c, r, beam] buffers grow with it
DECODER_BYTES = 28   # per column, row and beam entry: kbest's fp32 buffers, with a gather's copy and a product


def decoder_bytes(rows: int, columns: int, beam: int) -> int:
    """The memory a ``beam``-wide decoder holds for a ``[rows, columns]`` layer: its ``[c, r, beam]``
    targets, integers, points and parents."""
    return rows * columns * beam * DECODER_BYTES


def _round_options(omega: torch.Tensor, s: torch.Tensor, rounder, up: torch.Tensor | None = None):
    """The grid points a decoder may pick for ``omega`` (``[r, K]``) on scales ``s`` (``[r, 1]``):
    (integers ``[r, K, 2]``: the nearest one, then the other neighbour — or, with ``up`` (bool
    ``[r, K]``), the floor or the ceiling —, whether each is allowed, the outlier mask or None).
    ``rounder`` (``solvers.Rounder``): clipped, both on the grid; SSQR's, a nearest integer off the
    grid makes an outlier (its only option, ``q = ω`` in fp16) and no other outlier is made."""
    rho = omega / s
    near = torch.round(rho)
    other = near + torch.where(rho >= near, 1.0, -1.0) if up is None else torch.floor(rho) + up.to(rho.dtype)
    z = torch.stack((near, other), -1)
    ok = torch.ones_like(z, dtype=torch.bool)
    outlier = None
    if rounder.qmin is not None:
        off = (z < rounder.qmin) | (z > rounder.qmax)
        if rounder.outliers:
            outlier = off[..., 0]
            ok = ~off
            ok[..., 0] |= outlier
        else:
            z = z.clamp(rounder.qmin, rounder.qmax)
            ok[..., 1] = z[..., 1] != z[..., 0]
    q = z * s[..., None]
    if outlier is not None:   # an outlier stores the updated weight (fp16) and integer 0
        q[..., 0] = torch.where(outlier, omega.half().to(omega.dtype), q[..., 0])
        z[..., 0] = torch.where(outlier, 0.0, z[..., 0])
    return z, q, ok, outlier


def _column_scales(table: torch.Tensor, gidx: list, j: int, r: int) -> torch.Tensor:
    return table[gidx[j]][:, None] if table.shape[1] > 1 else table[0, 0].expand(r, 1)


def kbest(Ad: torch.Tensor, d2: torch.Tensor, Y: torch.Tensor, table: torch.Tensor, gidx: list, rounder,
          beam: int) -> tuple:
    """The K-best beam (``beam`` survivors). ``Ad``: A with rows divided by their diagonal;
    ``d2 = diag(A)²``; ``Y = Ad·wᵀ`` ``[c, r]`` in processing order (overwritten); ``table``,
    ``gidx``: the scales of each processed column (``solvers._scale_table``). → (z, q, outlier or
    None) ``[c, r]`` in processing order: the cheapest surviving path of every row."""
    c, r, K = Y.shape[0], Y.shape[1], beam
    dev, dt = Y.device, Y.dtype
    Yk = Y.unsqueeze(-1).repeat(1, 1, K)                      # [c, r, K]: each beam's residual targets
    cost = torch.full((r, K), torch.inf, dtype=dt, device=dev)
    cost[:, 0] = 0
    parents = torch.empty(c, r, K, dtype=torch.int32, device=dev)
    zs, qs = torch.empty(c, r, K, dtype=dt, device=dev), torch.empty(c, r, K, dtype=dt, device=dev)
    outl = torch.zeros(c, r, K, dtype=torch.bool, device=dev) if rounder.outliers else None
    rows = torch.arange(r, device=dev)[:, None]
    for j in range(c - 1, -1, -1):
        omega = Yk[j]
        z, q, ok, outlier = _round_options(omega, _column_scales(table, gidx, j, r), rounder)
        step = torch.where(ok, d2[j] * (omega[..., None] - q) ** 2, torch.inf)
        cost, pick = torch.topk((cost[..., None] + step).reshape(r, 2 * K), K, dim=1, largest=False)
        parent = pick // 2
        parents[j] = parent
        zs[j], qs[j] = z.reshape(r, 2 * K)[rows, pick], q.reshape(r, 2 * K)[rows, pick]
        if outl is not None:
            outl[j] = outlier[rows, parent] & (pick % 2 == 0)
        if j:
            Yk[:j] = Yk[:j].gather(2, parent.long()[None].expand(j, r, K))
            Yk[:j] -= Ad[:j, j, None, None] * qs[j][None]
    b = cost.argmin(1)
    Z, Q = torch.empty(c, r, dtype=dt, device=dev), torch.empty(c, r, dtype=dt, device=dev)
    O = torch.zeros(c, r, dtype=torch.bool, device=dev) if outl is not None else None
    rr = rows[:, 0]
    for j in range(c):                                         # the path back from its last decision
        Z[j], Q[j] = zs[j, rr, b], qs[j, rr, b]
        if O is not None:
            O[j] = outl[j, rr, b]
        b = parents[j, rr, b].long()
    return Z, Q, O


def klein(Ad: torch.Tensor, d2: torch.Tensor, Y: torch.Tensor, table: torch.Tensor, gidx: list, rounder,
          draws: int, tau: float = 0.3, seed: int = 0) -> tuple:
    """Klein's randomized nearest plane, ``draws`` draws (draw 0: Babai's rounding), each ``ω/s``
    rounded up with probability ``σ((2·frac − 1)/(2τ²))`` — a Gaussian of width ``tau`` grid steps
    over its two neighbours. Arguments and result as :func:`kbest`: each row's cheapest draw."""
    c, r, K = Y.shape[0], Y.shape[1], draws
    dev, dt = Y.device, Y.dtype
    Yk = Y.unsqueeze(-1).repeat(1, 1, K)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    cost = torch.zeros(r, K, dtype=dt, device=dev)
    Zt, Qt = torch.empty(c, r, K, dtype=dt, device=dev), torch.empty(c, r, K, dtype=dt, device=dev)
    Ot = torch.zeros(c, r, K, dtype=torch.bool, device=dev) if rounder.outliers else None
    for j in range(c - 1, -1, -1):
        omega = Yk[j]
        s = _column_scales(table, gidx, j, r)
        frac = omega / s - torch.floor(omega / s)
        up = torch.rand(r, K, generator=gen).to(dev) < torch.sigmoid((2 * frac - 1) / (2 * tau * tau))
        z, q, ok, outlier = _round_options(omega, s, rounder, up)
        use = ok[..., 1] if outlier is None else ok[..., 1] & ~outlier
        use[:, 0] = False                                      # draw 0: the nearest point, Babai's
        Zt[j], Qt[j] = torch.where(use, z[..., 1], z[..., 0]), torch.where(use, q[..., 1], q[..., 0])
        if Ot is not None:
            Ot[j] = outlier & ~use
        cost += d2[j] * (omega - Qt[j]) ** 2
        if j:
            Yk[:j] -= Ad[:j, j, None, None] * Qt[j][None]
    rows, b = torch.arange(r, device=dev), cost.argmin(1)
    return Zt[:, rows, b], Qt[:, rows, b], None if Ot is None else Ot[:, rows, b]


def lattice_distance(A: torch.Tensor, T: torch.Tensor, W: torch.Tensor, Q: torch.Tensor) -> torch.Tensor:
    """Per row ``‖A (q − w)_T‖² = (q − w)ᵀ H_d (q − w)`` in fp64 → ``[out]``."""
    E = (Q.double() - W.double())[:, T.to(W.device)]
    return (A.double() @ E.T).pow(2).sum(0)
