"""Layer Hessians ``H = XᵀX / n`` accumulated from calibration activations (fp64 sums).

:class:`Hessian` is the definition (every product in fp64); :class:`PanelHessian` the
pipeline's faster accumulator (fp32 sums of upper-triangular row panels' products, fp64 sums
over sequences).
:func:`hook_linears` attaches one Hessian to each linear of a model and
:func:`linear_hessians` runs calibration text through a whole Hugging Face model with
them: the one collector the tests, the demo and the study use. The sequential pipeline's
per-block collector (shared Hessians of linears fed the same input) is in
:mod:`.calibrate`. :class:`CrossCovariance` and :func:`qronos_target` are target correction's
cross term ``X̃ᵀX`` and its corrected weight.
"""
from __future__ import annotations

from typing import Hashable, Iterable

import torch

from .. import native
from ..algorithms.lattice import damped

PRODUCT_ROWS = 4096  # rows per fp32 XᵀX product of PanelHessian (8 sequences); products are summed in fp64
PANEL = 512  # columns per row panel of PanelHessian's upper-triangular product


class Hessian:
    """Running ``XᵀX / n`` over the rows of every input fed to :meth:`add` (``[..., in]``).
    fp64 accumulation: a Hessian summed over 10⁵ tokens in fp32 loses the small
    eigenvalues that decide GPTQ's error propagation.

    :attr:`H` is formed once, in place of the sum: a second c×c fp64 matrix would be the
    largest allocation of a block (1.6 GB for a 14336-wide input). From then on ``sum`` is
    None and :meth:`add` refuses."""

    def __init__(self, columns: int, device="cpu"):
        self._sum: torch.Tensor | None = torch.zeros(columns, columns, dtype=torch.float64, device=device)
        self.n = 0
        self._H: torch.Tensor | None = None

    @classmethod
    def from_sum(cls, sum_: torch.Tensor, n: int) -> "Hessian":
        """A Hessian whose rows were summed elsewhere: ``sum_`` (fp64, taken over) over ``n`` rows."""
        out = cls.__new__(cls)
        out._sum, out.n, out._H = sum_, n, None
        return out

    @property
    def sum(self) -> torch.Tensor | None:
        """The fp64 sum of every row added so far (None once :attr:`H` is formed)."""
        return self._sum

    @sum.setter
    def sum(self, value: torch.Tensor | None) -> None:
        self._sum = value

    def _open_sum(self) -> torch.Tensor:
        if self.sum is None:
            raise RuntimeError("rows added to a Hessian whose H was already formed from its sum")
        return self.sum

    def add(self, x: torch.Tensor) -> None:
        S = self._open_sum()
        x = x.reshape(-1, x.shape[-1]).to(S.device, torch.float64)
        S.addmm_(x.T, x)
        self.n += x.shape[0]

    @property
    def H(self) -> torch.Tensor:
        """``sum / n`` (the very values of a fresh division), formed in place on first use;
        later reads return the same tensor: callers must not modify it."""
        if self._H is None:
            if self.n == 0:
                raise ValueError("no calibration rows were seen for this layer")
            self._H = self._symmetric(self._open_sum().div_(self.n))
            self.sum = None
        return self._H

    def _symmetric(self, H: torch.Tensor) -> torch.Tensor:
        return H


def bf16_products() -> bool:
    """bf16 activations' products summed by the CPU's bf16 GEMM (``quantize/csrc/gram.cpp``)."""
    return native.usable() and torch.ops.latq_cpu.has_bf16_gemm()


def product_operand(x: torch.Tensor) -> torch.Tensor:
    """``x`` as an operand of :func:`tn_add`: bf16 kept where the bf16 GEMM runs, else fp32."""
    if x.dtype == torch.bfloat16 and x.device.type == "cpu" and bf16_products():
        return x if x.stride(-1) == 1 else x.contiguous()
    return x.float()


def tn_add(a: torch.Tensor, b: torch.Tensor, S: torch.Tensor) -> None:
    """``S += aᵀb`` (``S`` fp64): one product of ≤ ``PRODUCT_ROWS`` rows in fp32, added in fp64.
    bf16 operands go to the CPU's bf16 GEMM: their products are exact in fp32 and summed in fp32,
    the values an fp32 GEMM of the upcast operands computes, up to the order of the sum."""
    if a.dtype == torch.bfloat16:
        torch.ops.latq_cpu.bf16_tn_add(a, b, S)
    else:
        S.add_(a.T @ b)


class PanelHessian(Hessian):
    """``XᵀX / n`` with an fp64 accumulator, each product of ≤ ``PRODUCT_ROWS`` rows (the rows
    of consecutive :meth:`add` calls, kept until there are enough) summed in fp32 (:func:`tn_add`:
    the bf16 GEMM for bf16 activations) and added to the fp64 sum: a 4096-term fp32 dot product's
    error is far below the damping, an fp64 GEMM would cost more than the block's forward pass,
    and each fp64 addition of a c×c product costs as much memory traffic as a GEMM of several
    sequences. The sum over products, where fp32 would lose the small eigenvalues, is fp64.

    Only the row panels of the upper triangle are computed and summed (``PANEL`` rows
    each), which halves both the GEMM and the fp64 additions. :attr:`H` mirrors the upper
    triangle."""

    def __init__(self, columns: int, device="cpu"):
        super().__init__(columns, device)
        self._pending: list[list[torch.Tensor]] = []
        self._pending_rows = 0

    @classmethod
    def from_sum(cls, sum_: torch.Tensor, n: int) -> "PanelHessian":
        out = super().from_sum(sum_, n)
        out._pending, out._pending_rows = [], 0
        return out

    @property
    def sum(self) -> torch.Tensor | None:
        self._flush()
        return self._sum

    @sum.setter
    def sum(self, value: torch.Tensor | None) -> None:
        self._pending, self._pending_rows, self._sum = [], 0, value

    def add(self, x: torch.Tensor) -> None:
        self._add_rows(x, None)

    def _add_rows(self, a: torch.Tensor, b: torch.Tensor | None) -> None:
        """Keep rows ``a`` (and the row-aligned ``b`` of a cross product) for the next product."""
        if self._sum is None:
            raise RuntimeError("rows added to a Hessian whose H was already formed from its sum")
        a = a.reshape(-1, a.shape[-1]).to(self._sum.device)
        b = None if b is None else b.reshape(-1, b.shape[-1]).to(self._sum.device)
        if b is not None and a.dtype != b.dtype:
            a, b = a.float(), b.float()
        for i in range(0, a.shape[0], PRODUCT_ROWS):
            # copies: the caller's activations may be reused before the product is taken
            rows = [product_operand(t[i:i + PRODUCT_ROWS]).clone() for t in ((a,) if b is None else (a, b))]
            self._pending.append(rows)
            self._pending_rows += rows[0].shape[0]
            if self._pending_rows >= PRODUCT_ROWS:
                self._flush()
        self.n += a.shape[0]

    def _flush(self) -> None:
        if not self._pending:
            return
        parts = [torch.cat(ts) if len(ts) > 1 else ts[0] for ts in zip(*self._pending)]
        self._pending, self._pending_rows = [], 0
        self._product(*parts)

    def _product(self, x: torch.Tensor) -> None:
        S, n = self._sum, x.shape[1]
        for c in range(0, n, PANEL):
            tn_add(x[:, c:c + PANEL], x[:, c:], S[c:c + PANEL, c:])

    def _symmetric(self, H: torch.Tensor) -> torch.Tensor:
        """The upper triangle mirrored panel by panel, in place (whole-matrix ``triu``
        temporaries were 4 copies: 6.6 GB for a 14336-wide input)."""
        n = H.shape[0]
        for c in range(0, n, PANEL):
            d = H[c:c + PANEL, c:c + PANEL]
            d.copy_(d.triu() + d.triu(1).T)
            H[c + PANEL:, c:c + PANEL] = H[c:c + PANEL, c + PANEL:].T
        return H


class CrossCovariance(PanelHessian):
    """Running ``X̃ᵀX / n`` (fp64 sums of fp32 products of the same rows as :class:`PanelHessian`'s)
    over row-aligned pairs: ``x_tilde`` the linear's inputs with the quantized prefix, ``x`` the
    same tokens' inputs with the full-precision prefix. Not symmetric: the whole product is summed."""

    def add(self, x_tilde: torch.Tensor, x: torch.Tensor) -> None:  # type: ignore[override]
        if x_tilde.shape != x.shape:
            raise ValueError(f"the two activation streams disagree: {tuple(x_tilde.shape)} vs {tuple(x.shape)}")
        self._add_rows(x_tilde, x)

    def _product(self, x_tilde: torch.Tensor, x: torch.Tensor) -> None:
        tn_add(x_tilde, x, self._sum)

    def _symmetric(self, H: torch.Tensor) -> torch.Tensor:
        return H

    @property
    def C(self) -> torch.Tensor:
        return self.H


def qronos_target(W: torch.Tensor, H: torch.Tensor, C: torch.Tensor, damp: float) -> torch.Tensor:
    """Target correction (after Qronos): the weight ``W′`` whose outputs on
    the quantized prefix's inputs X̃ best match the full-precision outputs XWᵀ, damped toward W:
    ``argmin ‖X̃W′ᵀ − XWᵀ‖² + λn‖W′ − W‖²``, i.e. ``W′ᵀ = Wᵀ + (H + λI)⁻¹(C − H)Wᵀ`` (``H =
    X̃ᵀX̃/n``, ``C = X̃ᵀX/n``, λ the solvers' damping). Damping toward W rather than 0 keeps
    ``W′ = W`` exactly when the streams agree (C = H, block 0) instead of shrinking W.
    Solving the layer against ``W′`` and ``H`` then minimizes ‖X̃Qᵀ − XWᵀ‖ up to the damping."""
    if C.shape != H.shape:
        raise ValueError(f"cross-covariance {tuple(C.shape)} and Hessian {tuple(H.shape)} differ")
    Wt = W.double().T
    correction = torch.linalg.solve(damped(H, damp), (C.double() - H.double()) @ Wt)
    return (Wt + correction).T.to(W.dtype).contiguous()


def hook_linears(modules: dict[str, torch.nn.Linear]) -> tuple[dict[str, Hessian], list]:
    """Attach forward pre-hooks that accumulate each linear's input Hessian.
    Returns ``(hessians, handles)``; call ``h.remove()`` on every handle when done."""
    hessians, handles = {}, []
    for name, mod in modules.items():
        hs = hessians[name] = Hessian(mod.in_features, mod.weight.device)
        handles.append(mod.register_forward_pre_hook(lambda m, args, hs=hs: hs.add(args[0].detach())))
    return hessians, handles


class _Stop(Exception):
    pass


@torch.no_grad()
def linear_hessians(model: torch.nn.Module, modules: dict[Hashable, torch.nn.Linear],
                    batches: Iterable[torch.Tensor], *, stop_after: torch.nn.Module | None = None,
                    desc: str | None = None) -> dict[Hashable, tuple[torch.Tensor, torch.Tensor]]:
    """``{key: (W [out, in] fp32, H [in, in] fp64)}`` for ``modules`` (linears of ``model``, by
    any key), ``model`` run on every token-id row of ``batches`` (one sequence per forward).
    ``stop_after``: a module after which each forward stops (the later blocks are not needed).
    ``desc``: show a progress bar with this label."""
    hs, handles = hook_linears(modules)
    if stop_after is not None:
        def stop(*_):
            raise _Stop
        handles.append(stop_after.register_forward_hook(stop))
    if desc is not None:
        from tqdm.auto import tqdm
        batches = tqdm(batches, desc=desc, unit="seq")
    try:
        for seq in batches:
            try:
                model(seq[None])
            except _Stop:
                pass
    finally:
        for h in handles:
            h.remove()
    return {k: (m.weight.detach().float(), hs[k].H) for k, m in modules.items()}
