"""Calibration statistics: the Hessians ``XᵀX`` of a decoder block's linears over every
calibration sequence, and of the output head.

Linears fed the very same tensor (q/k/v, gate/up) share one Hessian; products are fp32 GEMMs
summed in fp64 (:class:`~.hessian.PanelHessian`).
"""
from __future__ import annotations

import torch

from .. import hf_model
from . import capture
from .hessian import Hessian, PanelHessian
from .moe import MoeInputs


class SharedHessians:
    """Forward pre-hooks on a block's linears accumulating ``XᵀX`` in fp64. During the first
    forward, linears that receive the very same input tensor (q/k/v, gate/up) are grouped and
    share one Hessian; afterwards only each group's first member accumulates. ``moe``: the
    inputs of each experts module of ``block`` (by name within it)."""

    def __init__(self, linears: dict[str, torch.nn.Linear], block: torch.nn.Module | None = None):
        self.linears = linears
        self.moe = {n: MoeInputs(m) for n, m in hf_model.expert_modules(block).items()} if block is not None else {}
        self.of: dict[str, Hessian] = {}
        self.leader: dict[str, bool] = {}
        self._call: list = []  # (input tensor, Hessian) seen in the current forward (keeps refs)
        self.frozen = False
        self.handles = [m.register_forward_pre_hook(self._hook(n)) for n, m in linears.items()]

    def _hook(self, name):
        def hook(mod, args):
            x = args[0]
            if self.frozen:
                if self.leader[name]:
                    self.of[name].add(x.detach())
                return
            for seen, hs in self._call:
                if seen is x:  # the very same tensor object (kept alive in _call: ids cannot be reused)
                    self.of[name], self.leader[name] = hs, False
                    return
            hs = PanelHessian(mod.in_features, mod.weight.device)
            hs.add(x.detach())
            self.of[name], self.leader[name] = hs, True
            self._call.append((x, hs))
        return hook

    def end_forward(self):
        if not self.frozen:
            missing = set(self.linears) - set(self.of)
            if missing:
                raise RuntimeError(f"linears never called in a forward pass: {sorted(missing)}")
            self.frozen = True
            self._call = []

    def groups(self) -> list[list[str]]:
        out: dict[int, list[str]] = {}
        for n in self.linears:
            out.setdefault(id(self.of[n]), []).append(n)
        return list(out.values())

    def remove(self):
        for h in self.handles:
            h.remove()
        for m in self.moe.values():
            m.remove()


@torch.no_grad()
def block_hessians(layer, linears: dict, inps: torch.Tensor, kw: dict, desc: str, progress: bool) -> SharedHessians:
    """Run the (unquantized) block on every calibration sequence with Hessian hooks."""
    from tqdm.auto import tqdm
    hs = SharedHessians(linears, layer)
    try:
        for j in tqdm(range(len(inps)), desc=f"{desc}: Hessians", unit="seq", disable=not progress, leave=False):
            capture.run_block(layer, inps[j:j + 1], kw)
            hs.end_forward()
    finally:
        hs.remove()
    return hs


@torch.no_grad()
def head_hessian(norm: torch.nn.Module, inps: torch.Tensor, columns: int, device, desc: str,
                 progress: bool) -> PanelHessian:
    """The output head's Hessian: ``XᵀX/n`` of its real inputs, the final ``norm`` applied to
    the last (quantized) block's outputs ``inps`` over all calibration tokens."""
    from tqdm.auto import tqdm
    hs = PanelHessian(columns, device)
    for j in tqdm(range(len(inps)), desc=f"{desc}: Hessian", unit="seq", disable=not progress, leave=False):
        hs.add(norm(inps[j:j + 1]))
    return hs
