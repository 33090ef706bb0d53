"""RTN, GPTQ (front-to-back, lazy batch) and Babai's nearest plane (back-to-front).

Both sweeps work on transposed ``[in, out]`` copies so that one input column — the unit
of the sequential dependency — is a contiguous vector of all output rows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import native
from ..format import scale_codes
from ..format.packing import row_chunks
from . import decoders, lattice
from .result import CSR, QuantResult
from .scales import expand, grid, mse_scales, num_groups


@dataclass(frozen=True)
class Rounder:
    """The rounding step of a sweep: ω/s to an integer. ``qmin is None``: unclipped integers;
    else clipped to ``[qmin, qmax]``, or with ``outliers`` (SSQR) an integer off that grid
    becomes an outlier stored as the updated weight in fp16 (rounding error ≈ 0, so the
    certificate still holds) and 0 in the dense part."""
    qmin: int | None = None
    qmax: int | None = None
    outliers: bool = False

    @classmethod
    def of(cls, bits: int | None, clip: bool, outliers: bool = False) -> "Rounder":
        if bits is None or not (clip or outliers):
            return cls()
        return cls(*grid(bits), outliers)

    def __call__(self, omega: torch.Tensor, s: torch.Tensor, z: torch.Tensor, q: torch.Tensor):
        """Round ``omega`` on scales ``s`` into ``z`` and ``q = z·s`` (written in place: this
        runs once per column); returns the outlier mask or None."""
        torch.div(omega, s, out=z).round_()
        if self.qmin is None:
            torch.mul(z, s, out=q)
            return None
        if not self.outliers:
            z.clamp_(self.qmin, self.qmax)
            torch.mul(z, s, out=q)
            return None
        out = (z < self.qmin) | (z > self.qmax)
        z.masked_fill_(out, 0.0)
        torch.mul(z, s, out=q)
        q[out] = omega[out].half().to(omega.dtype)
        return out


@dataclass
class Sweep:
    """Sweep output in original column order, ``[out, in]``."""
    z: torch.Tensor
    q: torch.Tensor | None    # None: the result computes z·s when read (RTN)
    outlier: torch.Tensor | None
    rho: torch.Tensor | None  # the rounded argument ω/s, for tie analysis


def _compute_dtype(W: torch.Tensor) -> torch.dtype:
    return torch.float64 if W.dtype == torch.float64 else torch.float32


def _rows(X: torch.Tensor, order: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """``[out, in]`` (possibly an expanded view) → contiguous ``[in, out]`` rows in ``order``:
    transpose first, then gather whole rows (gathering a transposed view is ~10x slower)."""
    return X.T.to(dt).contiguous().index_select(0, order.to(X.device))


def _scale_table(scales: torch.Tensor, group_size: int | None, order: torch.Tensor, dt: torch.dtype):
    """The scales of every processed column without materialising ``[in, out]``: ``scales``
    is a scalar, ``[out, 1]`` (one per row) or ``[out, ngroups]`` (group g covers columns
    ``[g·group_size, (g+1)·group_size)``) → (table ``[ngroups, out]`` or ``[1, 1]``, int64
    ``[in]``: the table row of processed column j)."""
    if scales.dim() == 0:
        return scales.to(dt).reshape(1, 1), torch.zeros(len(order), dtype=torch.long, device=order.device)
    sT = scales.T.to(dt).contiguous()               # [ngroups, out]
    g = order // group_size if sT.shape[0] > 1 else torch.zeros(len(order), dtype=torch.long, device=order.device)
    return sT, g.long().contiguous()


def _column_scales(table: torch.Tensor, gidx: torch.Tensor):
    """j → the scales of processed column j (a row of the table, or its scalar)."""
    if table.shape[1] == 1:
        s = table[0, 0]
        return lambda j: s
    g = gidx.tolist()
    return lambda j: table[g[j]]


def _native(dt: torch.dtype) -> bool:
    """The C++ per-column step (``algorithms/csrc/sweep.cpp``) for fp32 problems when built."""
    return dt == torch.float32 and native.usable()


def _mode(rounder: Rounder) -> tuple[int, float, float]:
    if rounder.qmin is None:
        return 0, 0.0, 0.0
    return (2 if rounder.outliers else 1), float(rounder.qmin), float(rounder.qmax)


def _sweep_result(tables: list) -> Sweep:
    """:func:`back_substitution`'s ``[in, out]`` outputs ``[Zt, Qt, Ot, Rt]`` (in original
    column order) → ``[out, in]``, each table freed once transposed (``tables`` holds the
    only references)."""
    out = []
    while tables:
        x = tables.pop(0)
        out.append(None if x is None else x.T.contiguous())
    return Sweep(*out)


# ----------------------------------------------------------------------------- the sweep

INNER = 16  # columns rounded between GEMM updates: the in-sub-block work stays in cache


def _outputs(c, r, dt, device, rounder, keep_rho, zdt=None):
    """Output tables ``[in, out]`` on ``device``; ``zdt``: the integers' dtype (int32 from the
    C++ step, which saves a conversion pass; the torch step rounds into ``dt``)."""
    Zt, Qt = torch.empty(c, r, dtype=zdt or dt, device=device), torch.empty(c, r, dtype=dt, device=device)
    Ot = torch.zeros(c, r, dtype=torch.bool, device=device) if rounder.outliers else None
    Rt = torch.empty(c, r, dtype=dt, device=device) if keep_rho else None
    return Zt, Qt, Ot, Rt


def _round_column(j, w, s, rounder, Zt, Qt, Ot, Rt, jq=None):
    """Round column ``w`` into row ``j`` of the outputs (``jq``: its row in ``Qt``)."""
    jq = j if jq is None else jq
    if Rt is not None:
        torch.div(w, s, out=Rt[j])
    o = rounder(w, s, Zt[j], Qt[jq])
    if o is not None:
        Ot[j] = o


def back_substitution(M: torch.Tensor, T: torch.Tensor, X: torch.Tensor, scales: torch.Tensor,
                      group_size: int | None, rounder: Rounder, errors: bool, block_size: int = 128,
                      keep_rho: bool = False) -> list:
    """The loop GPTQ and Babai both are: for j = c−1 … 0, ``ω_j = X_j − Σ_{l>j} M_jl b_l``, round
    ω_j to q_j, propagate b_j = q_j (Babai: X = A_d Wᵀ, M = A_d) or ω_j − q_j (GPTQ: X = Wᵀ,
    M = A⁻¹ over its diagonal); blocked as GEMMs with a GEMV per 16-row sub-block. ``X`` [in, out]
    in order ``T``, overwritten; results go to row ``T[j]`` of the tables [Z, Q, outlier, rho]."""
    dt = M.dtype
    table, gidx = _scale_table(scales, group_size, T, dt)
    c, r = X.shape
    dev = X.device
    fast = _native(dt) and all(t.device.type == "cpu" for t in (M, X, table))   # the C++ step: CPU only
    Zt, Qt, Ot, Rt = _outputs(c, r, dt, dev, rounder, keep_rho, torch.int32 if fast else None)
    B = torch.empty(block_size, r, dtype=dt, device=dev)   # the block's propagated rows (stays in cache)
    if fast:   # the path is chosen here, once: the sub-block step in C++ (algorithms/csrc/sweep.cpp) ...
        rows, mode = T.long().contiguous(), _mode(rounder)

        def subblock(j0: int, k1: int, k2: int) -> None:
            torch.ops.latq_cpu.back_substitution_subblock(X, B, M, table, gidx, rows, Zt, Qt if errors else None,
                                                          Ot, Rt, j0, k1, k2, *mode)
    else:      # ... or in torch, one column at a time (any dtype, any device)
        s, Tl = _column_scales(table, gidx), T.tolist()
        omega = torch.empty(r, dtype=dt, device=dev)

        def subblock(j0: int, k1: int, k2: int) -> None:
            for k in range(k2 - 1, k1 - 1, -1):
                j = j0 + k
                om = X[j] if k == k2 - 1 else torch.addmv(X[j], B[k + 1:k2].T, M[j, j + 1:j0 + k2], alpha=-1,
                                                          out=omega)
                if errors:
                    _round_column(Tl[j], om, s(j), rounder, Zt, Qt, Ot, Rt)
                    torch.sub(om, Qt[Tl[j]], out=B[k])
                else:
                    _round_column(Tl[j], om, s(j), rounder, Zt, B, Ot, Rt, jq=k)
    for j1 in range(c, 0, -block_size):
        j0 = max(j1 - block_size, 0)
        for k2 in range(j1 - j0, 0, -INNER):        # block-local indices
            k1 = max(k2 - INNER, 0)
            subblock(j0, k1, k2)
            X[j0:j0 + k1].addmm_(M[j0:j0 + k1, j0 + k1:j0 + k2], B[k1:k2], alpha=-1)
        if not errors:
            Qt.index_copy_(0, T[j0:j1], B[: j1 - j0])
        X[:j0].addmm_(M[:j0, j0:j1], B[: j1 - j0], alpha=-1)
    return [Zt, Qt, Ot, Rt]


# ----------------------------------------------------------------------------- GPTQ

@dataclass
class GPTQLattice:
    """Everything GPTQ needs from H, computed once (SSQR/HPTQ reuse it for every search step).
    ``perm``: GPTQ's processing order p; the sweep runs in Babai's frame ``T = p.flip(0)``
    (back-to-front) on ``M`` = ``A⁻¹`` with columns divided by their diagonal ``diag``, where
    ``AᵀA = (H_d)_TT`` (A upper). ``D_col``: the LDL diagonal of order T, by original column."""
    perm: torch.Tensor
    M: torch.Tensor
    diag: torch.Tensor
    D_col: torch.Tensor
    damp: float

    @property
    def T(self) -> torch.Tensor:
        return self.perm.flip(0)


def gptq_lattice(H: torch.Tensor, order="act", damp: float = 0.01, name: str | None = None,
                 dtype: torch.dtype = torch.float32) -> GPTQLattice:
    p = lattice.resolve_order(order, H, damp, babai=False)
    # With T = p reversed and (H_d)_TT = AᵀA: (H_d)_pp⁻¹ = J A⁻¹ A⁻ᵀ J, so GPTQ's upper factor
    # of H⁻¹ is U = J A⁻ᵀ J — Babai's factor inverted and reversed: the equivalence in one
    # line. The sweep stays in Babai's frame, so nothing is flipped or copied.
    L, damp_used = lattice.cholesky(H, damp, p.flip(0), name, dtype=dtype)
    D_col = lattice.d_by_column(L, p.flip(0))
    M = lattice.tri_inv_upper(L.T, overwrite=True)  # in L's memory: L is not read again
    d = M.diagonal().clone()
    M.div_(d)                                       # in place: no second c×c matrix
    return GPTQLattice(p, M, d, D_col, damp_used)


def gptq_sweep(lat: GPTQLattice, W: torch.Tensor, scales: torch.Tensor, group_size: int | None,
               rounder: Rounder, block_size: int = 128, keep_rho: bool = False, offset: float = 0.0) -> Sweep:
    """Paper Alg. 1 in GPTQ's lazy-batch form, as :func:`back_substitution` in Babai's frame (errors
    propagated through ``A⁻¹``). ``offset``: the shifted grid ``s·(z + offset)``, rounded as
    ``W − offset·s`` on the integers (the certificate unchanged)."""
    T = lat.T
    shift = offset * expand(scales.to(W.device).float(), group_size, tuple(W.shape)) if offset else None
    sw = _sweep_result(back_substitution(lat.M, T, _rows(W if shift is None else W - shift, T, lat.M.dtype), scales,
                                         group_size, rounder, True, block_size, keep_rho))
    if shift is not None:
        sw.q += shift
        if sw.outlier is not None:
            sw.q[sw.outlier] = sw.q[sw.outlier].half().to(sw.q.dtype)
    return sw


# ----------------------------------------------------------------------------- Babai

def babai_sweep(A: torch.Tensor, T: torch.Tensor, W: torch.Tensor, scales: torch.Tensor,
                group_size: int | None, rounder: Rounder, block_size: int = 128, keep_rho: bool = False) -> Sweep:
    """Paper v1 Alg. 3: ``Y = A Wᵀ``; for j = c..1: ``ω = Y_j / A_jj``, round,
    ``Y -= A[:, j] ⊗ q`` — :func:`back_substitution` propagating q. A's rows are divided
    by their diagonal once, so ``Y_j`` is ω itself. ``A`` may be a strided view (e.g. ``Lᵀ``)."""
    Ad = A / A.diagonal()[:, None]
    return _sweep_result(back_substitution(Ad, T, lattice.upper_mm(Ad, _rows(W, T, Ad.dtype)), scales, group_size,
                                           rounder, False, block_size, keep_rho))


# ----------------------------------------------------------------------------- decoders beyond Babai

def decoded_sweep(A: torch.Tensor, T: torch.Tensor, W: torch.Tensor, scales: torch.Tensor, group_size: int | None,
                  rounder: Rounder, decoder: str = "babai", beam: int = 1, block_size: int = 128,
                  seed: int = 0) -> Sweep:
    """Babai's sweep, or with ``decoder`` ``kbest``/``klein`` (``beam`` survivors / draws, Klein's
    drawn from ``seed``; :mod:`.decoders`) that decoder's point in every row where it is at least as
    close to W as Babai's (exact fp64 distances), Babai's elsewhere: never farther."""
    base = babai_sweep(A, T, W, scales, group_size, rounder, block_size)
    if decoder == "babai":
        return base
    Ad = A / A.diagonal()[:, None]
    table, gidx = _scale_table(scales, group_size, T, Ad.dtype)
    args = (Ad, A.diagonal() ** 2, lattice.upper_mm(Ad, _rows(W, T, Ad.dtype)), table, gidx.tolist(), rounder, beam)
    Z, Q, O = decoders.kbest(*args) if decoder == "kbest" else decoders.klein(*args, seed=seed)
    inv = torch.empty_like(T)
    inv[T] = torch.arange(len(T), device=T.device)
    Z, Q = Z[inv.to(Z.device)].T, Q[inv.to(Z.device)].T
    closer = (decoders.lattice_distance(A, T, W, Q) <= decoders.lattice_distance(A, T, W, base.q))[:, None]
    out = None if O is None else torch.where(closer, O[inv.to(O.device)].T, base.outlier)
    return Sweep(torch.where(closer, Z.to(base.z.dtype), base.z), torch.where(closer, Q.to(base.q.dtype), base.q),
                 out, None)


@dataclass
class DecoderLattice:
    """What a decoder needs from H, computed once (SSQR/HPTQ search with it like with
    :class:`GPTQLattice`): Babai's order T, the upper factor ``A`` (``AᵀA = (H_d)_TT``), D by column."""
    T: torch.Tensor
    A: torch.Tensor
    D_col: torch.Tensor
    damp: float
    decoder: str
    beam: int

    @property
    def perm(self) -> torch.Tensor:
        return self.T.flip(0)


def decoder_lattice(H: torch.Tensor, order="act", damp: float = 0.01, name: str | None = None,
                    dtype: torch.dtype = torch.float32, decoder: str = "babai", beam: int = 1) -> DecoderLattice:
    """For GPTQ's ``order`` (processed first to last): Babai's factor in the reversed order."""
    if decoder not in decoders.DECODERS or beam < 1:
        raise ValueError(f"decoder must be one of {decoders.DECODERS} with beam >= 1, got {decoder!r}, beam {beam}")
    T = lattice.resolve_order(order, H, damp, babai=False).flip(0)
    L, damp_used = lattice.cholesky(H, damp, T, name, dtype=dtype)
    return DecoderLattice(T, L.T, lattice.d_by_column(L, T), damp_used, decoder, beam)


def lattice_sweep(lat, W: torch.Tensor, scales: torch.Tensor, group_size: int | None, rounder: Rounder,
                  block_size: int = 128, offset: float = 0.0) -> Sweep:
    """One sweep on a :class:`GPTQLattice` (:func:`gptq_sweep`) or a :class:`DecoderLattice`."""
    if isinstance(lat, GPTQLattice):
        return gptq_sweep(lat, W, scales, group_size, rounder, block_size, offset=offset)
    if offset:
        raise ValueError("a shifted grid (offset) is not decoded beyond Babai")
    return decoded_sweep(lat.A.to(W.device), lat.T, W, scales, group_size, rounder, lat.decoder, lat.beam, block_size)


def solver_lattice(H, order, damp, name, dtype, decoder: str = "babai", beam: int = 1):
    """GPTQ's lattice for Babai's sweep, a :class:`DecoderLattice` for another decoder."""
    if decoder == "babai":
        return gptq_lattice(H, order, damp, name, dtype)
    return decoder_lattice(H, order, damp, name, dtype, decoder, beam)


# ----------------------------------------------------------------------------- public API

def dense_bits(z: torch.Tensor, bits: int | None, clip: bool, group_size: int | None, n_scales: int,
               scale_storage: float | None = None) -> float:
    """Storage cost of fixed-width integers + fp16 scales (``scale_storage``: the scales' bits
    when coded). Unclipped integers need ``ceil(log2(range))`` bits to be stored at a fixed
    width, whatever ``bits`` was asked."""
    if clip and bits is not None:
        width = bits
    else:
        span = int(z.max().item() - z.min().item()) + 1 if z.numel() else 1
        width = max(1, math.ceil(math.log2(span)))
    return width + (16 * n_scales if scale_storage is None else scale_storage) / z.numel()


def _scales_for(W, bits, group_size, scales, offset: float = 0.0, scale_bits: int | None = None):
    """The group scales a solver quantizes against (given, or MSE), with ``scale_bits`` their
    coded form (scale_codes.py): the solver sees the decoded scales, so z is chosen for them."""
    if scales is None:
        scales = mse_scales(W, bits, group_size, offset=offset)
    elif scales.dim() == 0:
        return scales.float(), None, None
    if scale_bits is None:
        return scales.float(), group_size, None
    coded = scale_codes.code_scales(scales, scale_bits)
    return coded.decode(), group_size, coded


def _finish(method, sw: Sweep, scales, group_size, bits, clip, perm, damp, D_col, W, coded=None) -> QuantResult:
    bound = None if clip or D_col is None else lattice.bound_from_d(D_col, scales, group_size, W.shape[0])
    n_scales = 1 if scales.dim() == 0 else scales.numel()
    storage = None if coded is None else scale_codes.stored_bits(*coded.codes.shape)
    z = sw.z if sw.z.dtype == torch.int8 else sw.z.to(torch.int32)
    res = QuantResult(method, z, None if sw.q is None else sw.q.float(), scales, group_size, bits,
                      dense_bits(sw.z, bits, clip, group_size, n_scales, storage), perm, damp, bound,
                      coded_scales=coded)
    if sw.rho is not None:
        res.info["rho"] = sw.rho
    return res


@torch.no_grad()
def rtn(W: torch.Tensor, H: torch.Tensor | None = None, *, bits: int = 4, group_size: int = 128,
        clip: bool = True, scales: torch.Tensor | None = None, scale_bits: int | None = None,
        name: str | None = None) -> QuantResult:
    """Round-to-nearest with MSE group scales (``scale_bits``: coded, :func:`gptq`). ``H`` is
    accepted for a uniform signature and only validated: RTN ignores it. ``W`` ``[out, in]`` in
    any float dtype: it is read a few rows at a time in fp32, and the result stores only the
    integers (int8 on a clipped grid; ``q`` is computed when read), so quantizing an 8B model's
    largest matrix holds about its bf16 weight and one byte a weight besides."""
    lattice.check_inputs(W, H, name)
    scales, group_size, coded = _scales_for(W, bits, group_size, scales, scale_bits=scale_bits)
    z = torch.empty(W.shape, dtype=torch.int8 if clip and bits is not None and bits <= 8 else torch.int32, device=W.device)
    round_ = Rounder.of(bits, clip)
    for rows in row_chunks(*W.shape):   # fp32 temporaries of a few MiB, not of the matrix
        w = W[rows].float()
        S = expand(scales if scales.dim() == 0 else scales[rows], group_size, tuple(w.shape))
        zf, qf = torch.empty_like(w), torch.empty_like(w)
        round_(w, S, zf, qf)
        z[rows] = zf.to(z.dtype)
    return _finish("rtn", Sweep(z, None, None, None), scales, group_size, bits, clip, None, None, None, W, coded)


@torch.no_grad()
def gptq(W: torch.Tensor, H: torch.Tensor, *, bits: int = 4, group_size: int = 128, order="act",
         damp: float = 0.01, clip: bool = True, scales: torch.Tensor | None = None,
         block_size: int = 128, keep_rho: bool = False, offset: float = 0.0, scale_bits: int | None = None,
         decoder: str = "babai", beam: int = 1, name: str | None = None) -> QuantResult:
    """GPTQ (paper Alg. 1): columns first-to-last in ``order``, each rounded and its error spread
    over the later columns through the Cholesky factor of ``H⁻¹``; the plain loop this computes:
    :func:`vllm_latq.testing.gptq_loop.reference_gptq`. H is XᵀX undamped. ``clip=False``: unbounded
    integers and the certificate ``.bound``; ``scales`` overrides the MSE scales; ``keep_rho`` keeps
    ω/s; ``scale_bits``: scales coded on second-level grids, the integers solved against their decode;
    ``decoder``: ``kbest`` / ``klein`` search beyond Babai with ``beam`` survivors / draws."""
    lattice.check_inputs(W, H, name)
    scales, group_size, coded = _scales_for(W, bits, group_size, scales, offset, scale_bits)
    lat = solver_lattice(H, order, damp, name, _compute_dtype(W), decoder, beam)
    if decoder == "babai":
        sw = gptq_sweep(lat, W, scales, group_size, Rounder.of(bits, clip), block_size, keep_rho, offset)
    else:
        sw = lattice_sweep(lat, W, scales, group_size, Rounder.of(bits, clip), block_size, offset)
    return _finish("gptq", sw, scales, group_size, bits, clip, lat.perm, lat.damp, lat.D_col, W, coded)


@torch.no_grad()
def babai(W: torch.Tensor, H: torch.Tensor, *, bits: int = 4, group_size: int = 128, order="act",
          damp: float = 0.01, clip: bool = False, scales: torch.Tensor | None = None,
          block_size: int = 128, keep_rho: bool = False, scale_bits: int | None = None,
          decoder: str = "babai", beam: int = 1, name: str | None = None) -> QuantResult:
    """Babai's nearest plane (paper v1 Alg. 3), batched over rows, back-to-front on the upper
    Cholesky factor of the damped, permuted Hessian; ``babai(order=p.flip(0))`` equals
    ``gptq(order=p)``. Unclipped by default, where ``.bound`` holds."""
    lattice.check_inputs(W, H, name)
    scales, group_size, coded = _scales_for(W, bits, group_size, scales, scale_bits=scale_bits)
    T = lattice.resolve_order(order, H, damp, babai=True)
    L, damp_used = lattice.cholesky(H, damp, T, name, dtype=_compute_dtype(W))
    A = L.T.to(W.device)        # a view: the sweep reads it through strides
    if decoder == "babai":
        sw = babai_sweep(A, T, W, scales, group_size, Rounder.of(bits, clip), block_size, keep_rho)
    else:
        sw = decoded_sweep(A, T, W, scales, group_size, Rounder.of(bits, clip), decoder, beam, block_size)
    return _finish("babai", sw, scales, group_size, bits, clip, T.flip(0), damp_used, lattice.d_by_column(L, T), W,
                   coded)


__all__ = ["Rounder", "Sweep", "GPTQLattice", "gptq_lattice", "back_substitution", "gptq_sweep", "babai_sweep",
           "decoded_sweep", "DecoderLattice", "decoder_lattice", "lattice_sweep", "solver_lattice",
           "rtn", "gptq", "babai", "num_groups", "CSR"]
