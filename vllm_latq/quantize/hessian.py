"""Layer Hessians ``H = XᵀX / n`` from calibration activations, summed in fp64."""
from __future__ import annotations

from typing import Hashable, Iterable

import torch

from .. import native
from ..algorithms.lattice import damped

PRODUCT_ROWS = 4096  # rows per fp32 XᵀX product of PanelHessian (8 sequences); products are summed in fp64
PANEL = 512  # columns per row panel of PanelHessian's upper-triangular product


class Hessian:
    """Running ``XᵀX / n`` over the rows fed to :meth:`add`, every product in fp64 (the definition).
    fp32 sums over 10⁵ tokens lose the small eigenvalues that steer GPTQ."""

    def __init__(self, columns: int, device="cpu"):
        self._sum: torch.Tensor | None = torch.zeros(columns, columns, dtype=torch.float64, device=device)
        self.n = 0
        self._H: torch.Tensor | None = None

    @classmethod
    def from_sum(cls, sum_: torch.Tensor, n: int) -> "Hessian":
        """A Hessian whose ``n`` rows were summed elsewhere into ``sum_`` (fp64, taken over)."""
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
        """``sum / n``, formed in place on first use; callers must not modify it."""
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
    """``S += aᵀb`` (``S`` fp64): one product of ≤ ``PRODUCT_ROWS`` rows in fp32, added in fp64."""
    if a.dtype == torch.bfloat16:
        torch.ops.latq_cpu.bf16_tn_add(a, b, S)
    else:
        S.add_(a.T @ b)


class PanelHessian(Hessian):
    """``XᵀX / n`` summed in fp64 over fp32 products of ≤ ``PRODUCT_ROWS`` rows, upper-triangle panels only."""

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
        """The upper triangle mirrored panel by panel, in place (no whole-matrix temporaries)."""
        n = H.shape[0]
        for c in range(0, n, PANEL):
            d = H[c:c + PANEL, c:c + PANEL]
            d.copy_(d.triu() + d.triu(1).T)
            H[c + PANEL:, c:c + PANEL] = H[c:c + PANEL, c + PANEL:].T
        return H


class CrossCovariance(PanelHessian):
    """Running ``X̃ᵀX / n`` over row-aligned pairs (quantized prefix's inputs, full-precision prefix's)."""

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
    """Target correction (after Qronos): ``W′ᵀ = Wᵀ + (H + λI)⁻¹(C − H)Wᵀ``, ``H = X̃ᵀX̃/n``, ``C = X̃ᵀX/n``.
    The W′ whose outputs on X̃ best match XWᵀ, damped toward W so that ``W′ = W`` when C = H."""
    if C.shape != H.shape:
        raise ValueError(f"cross-covariance {tuple(C.shape)} and Hessian {tuple(H.shape)} differ")
    Wt = W.double().T
    correction = torch.linalg.solve(damped(H, damp), (C.double() - H.double()) @ Wt)
    return (Wt + correction).T.to(W.dtype).contiguous()


def hook_linears(modules: dict[str, torch.nn.Linear]) -> tuple[dict[str, Hessian], list]:
    """Attach forward pre-hooks accumulating each linear's input Hessian → ``(hessians, handles)``."""
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
    """``{key: (W fp32, H fp64)}`` for ``modules``, ``model`` run on each row of ``batches``.
    ``stop_after``: the module after which each forward stops."""
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
