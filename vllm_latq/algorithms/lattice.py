"""The lattice side of GPTQ: the damped Hessian, its factors, column orders and the no-clipping
error bound (paper v1 Alg. 3-4, Theorem 5). GPTQ processes columns first-to-last in ``p``, Babai
back-to-front in ``T``: ``gptq(order=p)`` ≡ ``babai(order=p.flip(0))``; ``act`` and ``min-pivot``
name the same processing sequence in both frames."""
from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch

from .. import format as fmt
from .. import native

# The column orders by name: the format's list (a checkpoint records one of them), defined once there.
ORDERS = fmt.ORDERS


def check_finite(x: torch.Tensor, what: str, name: str | None) -> None:
    if torch.isfinite(x.sum()):   # NaN/Inf propagate through a sum: one fast pass (an overflowing
        return                    # sum of finite values only sends us to the exact count below)
    bad = (~torch.isfinite(x)).sum().item()
    if bad:
        raise ValueError(f"{_where(name)}{what} has {bad} non-finite (NaN/Inf) entries")


def _where(name: str | None) -> str:
    return f"layer {name}: " if name else ""


def check_inputs(W: torch.Tensor, H: torch.Tensor | None, name: str | None) -> None:
    if W.dim() != 2:
        raise ValueError(f"{_where(name)}W must be [out, in], got shape {tuple(W.shape)}")
    check_finite(W, "weight", name)
    if H is None:
        return
    c = W.shape[1]
    if H.shape != (c, c):
        raise ValueError(f"{_where(name)}H must be [in, in] = [{c}, {c}], got {tuple(H.shape)}")
    check_finite(H, "Hessian", name)
    if (H.diagonal() < 0).any():
        raise ValueError(f"{_where(name)}Hessian has negative diagonal entries: not X^T X")


def damp_lambda(H: torch.Tensor, damp: float) -> float:
    """λ = damp · mean(diag H). Dead columns (H_jj = 0: the input never fired) get λ too,
    so they stay in the lattice and their weights are kept, quantized by plain rounding."""
    mean = H.diagonal().double().mean().item()
    return damp * (mean if mean > 0 else 1.0)


def damped(H: torch.Tensor, damp: float, dtype: torch.dtype = torch.float64,
           perm: torch.Tensor | None = None) -> torch.Tensor:
    """``H + λI`` (formed in fp64, returned in ``dtype``), rows and columns in ``perm`` order."""
    lam = damp_lambda(H, damp)
    if perm is not None and H.device.type == "cpu" and dtype in (torch.float32, torch.float64) and native.usable():
        return torch.ops.latq_cpu.permuted_damped(H, perm, lam, dtype)  # the same values in one pass
    Hd = H.to(dtype, copy=True)
    Hd.diagonal().copy_(_damped_diagonal(H, lam))
    return Hd if perm is None else Hd[perm][:, perm]


def _damped_diagonal(H: torch.Tensor, lam: float) -> torch.Tensor:
    return H.diagonal().to(torch.float64) + lam


@contextmanager
def damped_in_place(H: torch.Tensor, damp: float):
    """``damped(H, damp)`` of an fp64 ``H`` (the same values) formed in H itself for the
    ``with`` body, its diagonal restored after: no second c×c matrix. Nothing else may read H
    meanwhile."""
    if H.dtype != torch.float64:
        raise ValueError(f"damped_in_place needs an fp64 Hessian, got {H.dtype}")
    diag = H.diagonal().clone()
    H.diagonal().copy_(_damped_diagonal(H, damp_lambda(H, damp)))
    try:
        yield H
    finally:
        H.diagonal().copy_(diag)


def cholesky(H: torch.Tensor, damp: float, perm: torch.Tensor | None = None,
             name: str | None = None, max_tries: int = 6,
             dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, float]:
    """Lower Cholesky factor of the damped (and permuted) Hessian in ``dtype``; where it is not
    positive definite (or finite) damping rises ×10 a try, warned about and returned, so every
    later step and the certificate use the same matrix."""
    d = damp
    for _ in range(max_tries):
        L, info = torch.linalg.cholesky_ex(damped(H, d, dtype, perm))
        if info.item() == 0 and torch.isfinite(L.diagonal()).all():
            if d != damp:
                warnings.warn(f"{_where(name)}Hessian not positive definite with damp={damp}; "
                              f"damping raised to {d:g}", RuntimeWarning, stacklevel=3)
            return L, d
        d *= 10
    raise ValueError(f"{_where(name)}Hessian is not positive definite even with damp={d / 10:g}")


def min_pivot_order(H: torch.Tensor, damp: float = 0.01, block: int = 64) -> torch.Tensor:
    """Paper v1 Alg. 4: greedy LDL pivoting on the smallest Schur-complement diagonal → Babai's order
    ``T`` (GPTQ: ``T.flip(0)``), blocked like LAPACK's pivoted Cholesky (trailing update per panel)."""
    A = damped(H, damp, H.dtype if H.dtype.is_floating_point else torch.float64)
    c = A.shape[0]
    diag = A.diagonal().clone()
    taken = torch.zeros(c, dtype=torch.bool, device=A.device)
    T = torch.empty(c, dtype=torch.long, device=A.device)
    for k0 in range(0, c, block):
        nb = min(block, c - k0)
        Lp = torch.zeros(c, nb, dtype=A.dtype, device=A.device)
        for k in range(nb):
            j = int(torch.where(taken, torch.inf, diag).argmin())
            col = A[:, j] - Lp[:, :k] @ Lp[j, :k]
            piv = col[j].clamp(min=torch.finfo(A.dtype).tiny)
            col[taken] = 0.0
            l = col / piv.sqrt()
            Lp[:, k] = l
            diag -= l * l
            taken[j] = True
            T[k0 + k] = j
        A -= Lp @ Lp.T
    return T


def is_permutation(p: torch.Tensor, n: int) -> bool:
    return (p.dim() == 1 and p.numel() == n
            and torch.equal(torch.sort(p.long()).values, torch.arange(n, device=p.device)))


def resolve_order(order, H: torch.Tensor, damp: float, *, babai: bool) -> torch.Tensor:
    """A name or explicit permutation → the permutation in the solver's own frame (int64, on
    H's device)."""
    c = H.shape[0]
    if isinstance(order, torch.Tensor):
        if not is_permutation(order, c):
            raise ValueError(f"order must be a permutation of range({c}), got a tensor of shape "
                             f"{tuple(order.shape)} that is not one")
        return order.long().to(H.device)
    if order == "natural":
        return torch.arange(c, device=H.device)
    if order == "reverse":
        return torch.arange(c, device=H.device).flip(0)
    if order == "act":  # GPTQ: descending diag H first; Babai: its reverse
        p = torch.argsort(H.diagonal(), descending=True, stable=True)
        return p.flip(0) if babai else p
    if order == "min-pivot":
        T = min_pivot_order(H, damp)
        return T if babai else T.flip(0)
    raise ValueError(f"unknown order {order!r}: use one of {ORDERS} or a permutation tensor")


def ldl_diag(H: torch.Tensor, order, damp: float = 0.01) -> torch.Tensor:
    """D of the LDLᵀ decomposition of the damped ``TᵀHT`` (pivot order = Babai order T),
    in pivot order, computed in fp64. ``tr(D)`` is what min-pivot greedily minimises
    (paper Table 2)."""
    T = resolve_order(order, H, damp, babai=True)
    L, _ = cholesky(H, damp, T)
    return L.diagonal() ** 2


def d_by_column(L: torch.Tensor, T: torch.Tensor) -> torch.Tensor:
    """The LDL diagonal ``D = diag(L)²`` of the Cholesky factor ``L`` of ``(H_d)_TT``,
    indexed by original column (fp64, on L's device)."""
    D_col = torch.empty(len(T), dtype=torch.float64, device=L.device)
    D_col[T.to(L.device)] = L.diagonal().double() ** 2
    return D_col


def bound_from_d(D_col: torch.Tensor, scales: torch.Tensor, group_size: int | None, rows: int) -> torch.Tensor:
    """¼ Σ_j D_j s_ij² per row, with ``D_col`` indexed by original column and ``scales`` a
    scalar or ``[out, ngroups]`` (a scale is constant over its group, so D is summed per
    group first: no ``[out, in]`` scale matrix). → ``[rows]`` fp64."""
    D = D_col.double()
    if scales.dim() == 0:
        return torch.full((rows,), 0.25 * scales.double().item() ** 2 * D.sum().item(), dtype=torch.float64,
                          device=D.device)
    G = scales.shape[1]
    Dg = torch.nn.functional.pad(D, (0, G * min(group_size or len(D), len(D)) - len(D))).reshape(G, -1).sum(1)
    return 0.25 * (scales.double() ** 2 @ Dg)


def error_bound(H: torch.Tensor, scales: torch.Tensor, order="act", *, group_size: int | None = None,
                damp: float = 0.01) -> torch.Tensor:
    """Per-row certificate ``(q_i - w_i)ᵀ H_d (q_i - w_i) ≤ ¼ Σ_j D_jj s_i[T_j]²`` of unclipped Babai /
    back-to-front GPTQ, D from the damped Hessian's LDLᵀ in Babai's ``order`` → ``[out]``."""
    T = resolve_order(order, H, damp, babai=True)
    L, _ = cholesky(H, damp, T)
    return bound_from_d(d_by_column(L, T), scales, group_size, 1 if scales.dim() == 0 else scales.shape[0])


def upper_mm(A: torch.Tensor, B: torch.Tensor, leaf: int = 256, left: bool = True,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """``A @ B`` (``left``) or ``B @ A`` for upper-triangular ``A``, by 2x2 block recursion
    that skips A's zero block: half the FLOPs of a dense product, still GEMM-shaped. The left
    product is written into ``out`` (row blocks of one buffer: no concatenation copies)."""
    n = A.shape[0]
    if left:                                   # [A11 B1 + A12 B2 ; A22 B2]
        if out is None:
            out = torch.empty(n, B.shape[1], dtype=torch.promote_types(A.dtype, B.dtype), device=B.device)
        if n <= leaf:
            return torch.mm(A, B, out=out)
        h = n // 2
        upper_mm(A[:h, :h], B[:h], leaf, True, out[:h]).addmm_(A[:h, h:], B[h:])
        upper_mm(A[h:, h:], B[h:], leaf, True, out[h:])
        return out
    if n <= leaf:
        return B @ A
    h = n // 2
    A11, A12, A22 = A[:h, :h], A[:h, h:], A[h:, h:]
    B1, B2 = B[:, :h], B[:, h:]                # [B1 A11 , B1 A12 + B2 A22]
    right = upper_mm(A22, B2, leaf, False).addmm_(B1, A12)
    return torch.cat([upper_mm(A11, B1, leaf, False), right], 1)


def tri_inv_upper(R: torch.Tensor, leaf: int = 256, overwrite: bool = False) -> torch.Tensor:
    """Inverse of an upper-triangular matrix by 2×2 block recursion, nearly all GEMM (≈ n³/3 FLOPs),
    row-major even for a transposed R. ``overwrite``: written into R's storage where it is one n×n
    matrix, once R's blocks are read (one matrix less at the peak)."""
    n = R.shape[0]
    if n <= leaf:
        return torch.linalg.solve_triangular(R, torch.eye(n, dtype=R.dtype, device=R.device), upper=True)
    h = n // 2
    A, C = tri_inv_upper(R[:h, :h], leaf), tri_inv_upper(R[h:, h:], leaf)
    AB = upper_mm(A, R[:h, h:], leaf, True)
    if overwrite and R.storage_offset() == 0 and R.untyped_storage().nbytes() == n * n * R.element_size():
        out = R.as_strided((n, n), (n, 1))   # R is not read from here on
        out[h:, :h] = 0
    else:
        out = torch.zeros(R.shape, dtype=R.dtype, device=R.device)
    out[:h, :h], out[h:, h:] = A, C
    out[:h, h:] = upper_mm(C, AB, leaf, False).neg_()
    return out


def relative_error(W: torch.Tensor, Q: torch.Tensor, H: torch.Tensor, panel: int = 2048) -> float:
    """``‖X(Q−W)ᵀ‖² / ‖XWᵀ‖²``, the figure a layer's record reports: fp32 products over column panels
    of H, summed in fp64; :func:`layer_error` is the fp64 definition."""
    W32 = W.float()
    E = Q.to(W32.device, torch.float32).sub(W32)
    num = den = 0.0
    for j0 in range(0, H.shape[1], panel):
        Hp = H[:, j0:j0 + panel].to(torch.float32)
        num += (E @ Hp).mul_(E[:, j0:j0 + panel]).sum(dtype=torch.float64).item()
        den += (W32 @ Hp).mul_(W32[:, j0:j0 + panel]).sum(dtype=torch.float64).item()
    return num / den if den > 0 else 0.0


def layer_error(W: torch.Tensor, Q: torch.Tensor, H: torch.Tensor, damp: float = 0.0) -> torch.Tensor:
    """Per-row ``(q_i - w_i)ᵀ (H + λI) (q_i - w_i)`` with λ = damp · mean diag H → ``[out]``.
    Two ``[out, in]`` fp64 temporaries, and an fp64 H damped in place rather than copied."""
    E = Q.to(torch.float64, copy=True).sub_(W)
    if damp and H.dtype == torch.float64:
        with damped_in_place(H, damp) as Hd:
            EH = E @ Hd
    else:
        EH = E @ (damped(H, damp) if damp else H.double())
    return EH.mul_(E).sum(1)
