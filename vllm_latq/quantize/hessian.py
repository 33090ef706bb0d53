"""Layer Hessians ``H = XᵀX / n`` from calibration activations, summed in fp64."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Iterable

import torch

from .. import native
from ..algorithms.lattice import damped
from ..progress import bar

PRODUCT_ROWS = 4096  # rows per fp32 XᵀX product of PanelHessian (8 sequences of 512); summed exactly
MIN_PRODUCTS = 16  # products a calibration set is cut into at least (when it has that many sequences)
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
    """``x`` as an operand of :meth:`ExactSum.add_product`: bf16 kept where the bf16 GEMM runs, else fp32."""
    if x.dtype == torch.bfloat16 and x.device.type == "cpu" and bf16_products():
        return x if x.stride(-1) == 1 else x.contiguous()
    return x.float()


def sequences_per_product(nsamples: int, seqlen: int) -> int:
    """Consecutive sequences per fp32 product: ≤ ``PRODUCT_ROWS`` rows, ≥ ``MIN_PRODUCTS`` products."""
    return max(1, min(PRODUCT_ROWS // max(seqlen, 1), nsamples // MIN_PRODUCTS))


@dataclass(frozen=True)
class Chunks:
    """Products of ``size`` consecutive sequences counted from the set's first; ``first``: the index
    of the first sequence fed here. A product is then the same sequences' on any rank."""
    size: int = 1
    first: int = 0

    def ends_after(self, fed: int) -> bool:
        return (self.first + fed) % self.size == 0


def two_sum_add(hi: torch.Tensor, lo: torch.Tensor, v: torch.Tensor, inexact: torch.Tensor) -> None:
    """``hi + lo += v`` unrounded (TwoSum: hi's rounding error into lo; lo rounding sets ``inexact``),
    a ``PANEL`` of rows at a time: the torch twin of ``latq_cpu::exact_add``."""
    for r in range(0, hi.shape[0], PANEL):
        h, l, x = hi[r:r + PANEL], lo[r:r + PANEL], v[r:r + PANEL].double()
        s = h + x
        t = s - h
        e = (h - (s - t)) + (x - t)
        h.copy_(s)
        s = l + e
        t = s - l
        inexact.logical_or_(((l - (s - t)) + (e - t)).ne(0).any())
        l.copy_(s)


class ExactSum:
    """A sum of fp32 products held exactly as the fp64 pair ``hi + lo``, rounded once: no order, so
    the ranks' partial sums give the one-process bits. ``regions``: ``(row0, row1, col0)``, the parts
    ``hi[row0:row1, col0:]`` products go to (a lo tensor each, made on first use)."""

    def __init__(self, hi: torch.Tensor, regions: list[tuple[int, int, int]]):
        self.hi, self.regions = hi, regions
        self.lo: list[torch.Tensor | None] = [None] * len(regions)
        self.inexact = torch.zeros((), dtype=torch.bool, device=hi.device)

    def lo_of(self, k: int) -> torch.Tensor:
        """Region ``k``'s low part (zeros until first used)."""
        if self.lo[k] is None:
            r0, r1, c0 = self.regions[k]
            self.lo[k] = torch.zeros(r1 - r0, self.hi.shape[1] - c0, dtype=torch.float64, device=self.hi.device)
        return self.lo[k]

    def _pair(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        r0, r1, c0 = self.regions[k]
        return self.hi[r0:r1, c0:], self.lo_of(k)

    def add_product(self, k: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Region ``k`` += ``aᵀb`` (operands from :func:`product_operand`), exactly."""
        hi, lo = self._pair(k)
        if a.dtype == torch.bfloat16:
            torch.ops.latq_cpu.bf16_tn_add(a, b, hi, lo, self.inexact)
        elif hi.device.type == "cpu" and native.usable():
            torch.ops.latq_cpu.exact_add((a.T @ b).contiguous(), hi, lo, self.inexact)
        else:
            two_sum_add(hi, lo, a.T @ b, self.inexact)

    def merge(self, hi: torch.Tensor, lo: list[torch.Tensor | None]) -> None:
        """Add another pair of the same regions (another rank's), exactly."""
        for k, (r0, r1, c0) in enumerate(self.regions):
            mine_hi, mine_lo = self._pair(k)
            two_sum_add(mine_hi, mine_lo, hi[r0:r1, c0:], self.inexact)
            if lo[k] is not None:
                two_sum_add(mine_hi, mine_lo, lo[k], self.inexact)

    def rounded(self) -> torch.Tensor:
        """``hi + lo`` rounded once, in place of hi; the pair is spent."""
        for k, (r0, r1, c0) in enumerate(self.regions):
            if self.lo[k] is not None:
                self.hi[r0:r1, c0:] += self.lo[k]
        self.lo = [None] * len(self.regions)
        return self.hi

    @property
    def exact(self) -> bool:
        return not bool(self.inexact)


class PanelHessian(Hessian):
    """``XᵀX / n``, upper-triangle panels only, from fp32 products of :class:`Chunks` of sequences
    (one per :meth:`add`) summed by an :class:`ExactSum`."""

    def __init__(self, columns: int, device="cpu", chunks: Chunks = Chunks()):
        super().__init__(columns, device)
        self._init_state(chunks, ExactSum(self._sum, self._regions()))

    def _init_state(self, chunks: Chunks, exact_sum: ExactSum | None) -> None:
        self.chunks, self.fed, self.exact_sum = chunks, 0, exact_sum
        self._pending: list[list[torch.Tensor]] = []
        self._pending_rows = 0

    def _regions(self) -> list[tuple[int, int, int]]:
        n = self._sum.shape[0]
        return [(c, min(c + PANEL, n), c) for c in range(0, n, PANEL)]

    @classmethod
    def from_sum(cls, sum_: torch.Tensor, n: int) -> "PanelHessian":
        out = super().from_sum(sum_, n)
        out._init_state(Chunks(), None)
        return out

    @property
    def sum(self) -> torch.Tensor | None:
        """The fp64 sum, rounded once from the exact pair (no rows may be added after)."""
        if self.exact_sum is not None:
            self._flush()
            self._sum = self.exact_sum.rounded()
            self.exact_sum = None
        return self._sum

    @sum.setter
    def sum(self, value: torch.Tensor | None) -> None:
        self._pending, self._pending_rows, self._sum, self.exact_sum = [], 0, value, None

    def pair(self) -> ExactSum:
        """The exact running sum, every pending row in it."""
        if self.exact_sum is None:
            raise RuntimeError("a Hessian's exact sum was read after it was rounded")
        self._flush()
        return self.exact_sum

    def add(self, x: torch.Tensor) -> None:
        self._add_rows(x, None)

    def _add_rows(self, a: torch.Tensor, b: torch.Tensor | None) -> None:
        """Keep one sequence's rows ``a`` (and the row-aligned ``b`` of a cross product) for its chunk's product."""
        if self.exact_sum is None:
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
        self.fed += 1
        if self.chunks.ends_after(self.fed):
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        parts = [torch.cat(ts) if len(ts) > 1 else ts[0] for ts in zip(*self._pending)]
        self._pending, self._pending_rows = [], 0
        if parts[0].shape[0]:
            self._product(*parts)

    def _product(self, x: torch.Tensor) -> None:
        for k, (c, c1, _) in enumerate(self.exact_sum.regions):
            self.exact_sum.add_product(k, x[:, c:c1], x[:, c:])

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

    def _regions(self) -> list[tuple[int, int, int]]:
        return [(0, self._sum.shape[0], 0)]

    def _product(self, x_tilde: torch.Tensor, x: torch.Tensor) -> None:
        self.exact_sum.add_product(0, x_tilde, x)

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
        batches = bar(batches, desc, unit="seq", leave=True)
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
