"""Per-input-column scales folded into the norm that feeds a linear (``--column-scales``): the checkpoint
stores the quantized ``W·diag(c)`` and the norm divided by ``c``, so every kernel serves it unchanged."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .. import hf_model
from ..algorithms import lattice
from .hessian import Hessian

MAX_RATIO = 16.0   # c is clamped to [1/16, 16] around its geometric mean: dead columns (D = λ) stay finite
# the folded block's outputs must match the original's up to the forward's rounding: a norm output
# that reaches anything but its linears (a residual, another branch) differs by O(1)
FOLD_RTOL = {torch.float32: 1e-4, torch.float64: 1e-4}
FOLD_RTOL_HALF = 2e-2


def column_scales(H: torch.Tensor, *, power: float = 0.5, order="act", damp: float = 0.01,
                  max_ratio: float = MAX_RATIO) -> torch.Tensor:
    """``c_j ∝ D_j^power`` (D: the LDL diagonal of the damped H in ``order``), geometric mean 1, clamped."""
    if power < 0:
        raise ValueError(f"column-scale power must be >= 0, got {power}")
    T = lattice.resolve_order(order, H, damp, babai=True)
    L, _ = lattice.cholesky(H, damp, T)
    logc = power * lattice.d_by_column(L, T).log()
    return (logc - logc.mean()).exp().clamp(1 / max_ratio, max_ratio).float()


def fold_weight(W: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``W·diag(c)``: the weight the folded linear stores."""
    return W * c.to(W.dtype)


def fold_hessian(H: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``diag(1/c) H diag(1/c)``: the Hessian of the folded linear's inputs ``x/c``."""
    ci = 1.0 / c.to(H.dtype)
    return H * ci[:, None] * ci[None, :]


def unfold(Q: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """A solution of the folded problem in the original columns: ``Q·diag(1/c)``."""
    return Q / c.to(Q.dtype)


# ----------------------------------------------------------------------------- a decoder block

@dataclass
class NormFold:
    """One norm and the linears its output feeds; ``unit_offset``: it multiplies by ``1 + weight`` (Gemma)."""
    norm: str
    linears: list[str]
    unit_offset: bool


def _is_norm(m: torch.nn.Module) -> bool:
    ps = dict(m.named_parameters(recurse=False))
    return "weight" in ps and ps["weight"].dim() == 1 and not list(m.children())


def trace_norms(layer: torch.nn.Module, prefix: str, linears: dict, x: torch.Tensor, kw: dict) -> list[NormFold]:
    """Every norm of ``layer`` (a leaf with a 1-D weight) whose output feeds only linears, traced on ``x``."""
    from .capture import run_block
    out_of, fed, handles = {}, {}, []
    names = {m: n for n, m in layer.named_modules()}
    for m, n in names.items():
        if _is_norm(m):
            handles.append(m.register_forward_hook(lambda mod, a, y, n=n: out_of.__setitem__(n, y)))
    lin_mods = {m: full for full, m in linears.items()}
    for m, full in lin_mods.items():
        handles.append(m.register_forward_pre_hook(lambda mod, a, full=full: fed.__setitem__(full, a[0])))
    try:
        with torch.no_grad():
            run_block(layer, x, kw)
    finally:
        for h in handles:
            h.remove()
    folds = []
    for n, y in out_of.items():
        users = [full for full, a in fed.items() if a is y]
        if users:
            folds.append(NormFold(f"{prefix}.{n}", users, _unit_offset(layer.get_submodule(n))))
    return folds


def _unit_offset(norm: torch.nn.Module) -> bool:
    """Does ``norm`` scale by ``1 + weight``? Probed with a zero weight."""
    w = norm.weight
    probe = torch.randn(2, w.shape[0], dtype=w.dtype, device=w.device)
    try:
        hf_model.set_tensor(norm, "weight", torch.zeros_like(w))
        with torch.no_grad():
            return bool(norm(probe).abs().max() > 0)
    finally:
        hf_model.set_tensor(norm, "weight", w)


def folded_norm_weight(weight: torch.Tensor, c: torch.Tensor, unit_offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The norm weight scaling by ``γ/c``, rounded to its dtype, and the scales it really applies.
    Folding those scales into W keeps the pair exact up to fp32 rounding."""
    one = 1.0 if unit_offset else 0.0
    g = weight.float() + one
    dead = g == 0          # γ_j = 0 (Gemma3-270M has such channels): input j is always 0, any c_j fits
    new = torch.where(dead, weight.float(), g / c - one).to(weight.dtype)
    g_new = new.float() + one
    if (g_new[~dead] == 0).any():
        raise ValueError("a folded norm weight rounds to γ′ = 0: column scale out of the weight dtype's range")
    return new, torch.where(dead, torch.ones_like(g), g / torch.where(dead, torch.ones_like(g_new), g_new))


@dataclass
class BlockFolding:
    """What :func:`fold_block` changed: per linear its scales and folded Hessian; the folded norm weights."""
    scales: dict[str, torch.Tensor]
    hessians: dict[str, Hessian]
    norm_tensors: dict[str, torch.Tensor]

    def wrap(self, quantize: Callable) -> Callable:
        """``quantize(name, W, hessian)`` solving each folded linear's problem instead."""
        def folded(name, W, hessian, **kw):
            if name not in self.scales:
                return quantize(name, W, hessian, **kw)
            return quantize(name, fold_weight(W, self.scales[name].to(W.device)), self.hessians[name], **kw)
        return folded


def _scaled_hessian(h: Hessian, c: torch.Tensor) -> Hessian:
    """The folded linear's Hessian, from the symmetric ``h.H``."""
    return Hessian.from_sum(fold_hessian(h.H, c) * h.n, h.n)


@torch.no_grad()
def fold_block(layer: torch.nn.Module, prefix: str, linears: dict, hessians: dict[str, Hessian], x: torch.Tensor,
               kw: dict, *, power: float = 0.5, order="act", damp: float = 0.01,
               stored: Callable[[str], torch.Tensor] | None = None) -> BlockFolding:
    """Fold column scales into the norms of block ``layer`` that feed only linears, in place, checked on ``x``.
    ``stored(name)``: a norm weight as the checkpoint stores it, which is what gets folded."""
    from .capture import run_block
    ref = run_block(layer, x, kw)
    folds = trace_norms(layer, prefix, linears, x, kw)
    out = BlockFolding({}, {}, {})
    for f in folds:
        H = {id(hessians[n]): hessians[n] for n in f.linears}
        if len(H) != 1:
            raise ValueError(f"{f.norm}: the linears it feeds {f.linears} do not share one Hessian")
        h = next(iter(H.values()))
        norm = layer.get_submodule(f.norm[len(prefix) + 1:])
        w = norm.weight.detach() if stored is None else stored(f"{f.norm}.weight").to(norm.weight.device)
        new_w, c = folded_norm_weight(w, column_scales(h.H, power=power, order=order, damp=damp).to(w.device),
                                      f.unit_offset)
        # new tensors, never in place: a loaded parameter may share memory with the source's tensor
        hf_model.set_tensor(norm, "weight", new_w.to(norm.weight.dtype))
        out.norm_tensors[f"{f.norm}.weight"] = new_w.cpu()
        hs = _scaled_hessian(h, c.to(h.H.device))
        for n in f.linears:
            lin = linears[n]
            hf_model.set_tensor(lin, "weight", fold_weight(lin.weight.float(), c).to(lin.weight.dtype))
            out.scales[n], out.hessians[n] = c, hs
    got = run_block(layer, x, kw)
    err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
    if err > FOLD_RTOL.get(ref.dtype, FOLD_RTOL_HALF):
        raise ValueError(f"{prefix}: the block with column scales folded into its norms differs from the original "
                         f"by {err:.2e} (relative): a norm's output reaches more than its linears here")
    return out
