"""Calibration statistics: the Hessians ``XᵀX`` of a block's linears and of the output head."""
from __future__ import annotations

import torch

from .. import hf_model
from ..progress import bar
from . import capture
from .hessian import Chunks, CrossCovariance, Hessian, PanelHessian, sequences_per_product
from .moe import MoeInputs
from . import ranks
from .ranks import World


class InputsSeen(Exception):
    """Raised once every linear of :attr:`SharedHessians.stop_after` has seen its input."""


class SharedHessians:
    """Forward pre-hooks on a block's linears accumulating ``XᵀX`` in fp64.
    Linears fed the very same tensor (q/k/v, gate/up) share one Hessian; ``cross_of`` adds target
    correction's ``X̃ᵀX``; ``stop_after`` ends a forward once those linears have seen their inputs."""

    def __init__(self, linears: dict[str, torch.nn.Linear], block: torch.nn.Module | None = None,
                 target_linears: dict[str, torch.nn.Linear] | None = None, chunks: Chunks = Chunks()):
        self.linears, self.chunks = linears, chunks
        self.moe = {n: MoeInputs(m, chunks) for n, m in hf_model.expert_modules(block).items()} \
            if block is not None else {}
        self.of: dict[str, Hessian] = {}
        self.leader: dict[str, bool] = {}
        self._call: list = []  # (input tensor, Hessian) seen in the current forward (keeps refs)
        self._leader_of: dict[int, str] = {}  # id(Hessian) → its group's first linear
        self.frozen = False
        self.cross_of: dict[str, CrossCovariance] = {}
        self.targets: dict[str, torch.Tensor] | None = None   # each linear's X for the current sequence
        self._recording = False
        self.stop_after: frozenset[str] = frozenset()
        self._seen: set[str] = set()
        self._stopping = False
        self._done: set[str] = set()
        self.handles = [m.register_forward_pre_hook(self._hook(n)) for n, m in linears.items()]
        # the same linears in another module (the unquantized block) record X when it runs
        self.handles += [m.register_forward_pre_hook(self._record_hook(n)) for n, m in (target_linears or {}).items()]

    def _record_hook(self, name):
        def hook(mod, args):
            if self._recording:
                self.targets[name] = args[0].detach()
                self._note_seen(name)
        return hook

    def _note_seen(self, name: str) -> None:
        if self._stopping and name in self.stop_after:
            self._seen.add(name)
            if self._seen >= self.stop_after:
                raise InputsSeen

    def forward(self, layer, x: torch.Tensor, kw: dict, stop: bool = True) -> torch.Tensor | None:
        """``layer``'s outputs on ``x``, or None when ``stop`` ended it early."""
        self._seen, self._stopping = set(), stop
        try:
            return capture.run_block(layer, x, kw)
        except InputsSeen:
            return None
        finally:
            self._stopping = False

    def _hook(self, name):
        def record(mod, x):
            if self.frozen:
                if self.leader[name]:
                    self.of[name].add(x.detach())
                    self._add_cross(name, x)
                return
            for seen, hs in self._call:
                if seen is x:  # the very same tensor object (kept alive in _call: ids cannot be reused)
                    self.of[name], self.leader[name] = hs, False
                    if self.targets is not None:
                        self.cross_of[name] = self.cross_of[self._leader_of[id(hs)]]
                    return
            hs = PanelHessian(mod.in_features, mod.weight.device, self.chunks)
            hs.add(x.detach())
            self.of[name], self.leader[name] = hs, True
            self._leader_of[id(hs)] = name
            if self.targets is not None:
                self.cross_of[name] = CrossCovariance(mod.in_features, mod.weight.device, self.chunks)
                self._add_cross(name, x)
            self._call.append((x, hs))

        def hook(mod, args):
            record(mod, args[0])
            self._note_seen(name)
        return hook

    def _add_cross(self, name: str, x: torch.Tensor) -> None:
        if self.targets is not None:
            self.cross_of[name].add(x.detach(), self.targets[name])

    @torch.no_grad()
    def record_targets(self, layer, x: torch.Tensor, kw: dict, stop: bool) -> torch.Tensor | None:
        """Run the unquantized ``layer`` on full-precision ``x``, keeping each linear's input."""
        moe_seen = {m: len(m.hidden) for m in self.moe.values()}
        self.targets, self._recording = {}, True
        try:
            y = self.forward(layer, x, kw, stop)
        finally:
            self._recording = False
            for m, n in moe_seen.items():  # the experts keep only the X̃ stream's inputs
                del m.hidden[n:], m.index[n:]
        return y

    def end_forward(self):
        if not self.frozen:
            missing = set(self.linears) - set(self.of)
            if missing:
                raise RuntimeError(f"linears never called in a forward pass: {sorted(missing)}")
            self.frozen = True
            self._call = []
        self.targets = None

    def release(self, name: str) -> None:
        """Drop the Hessian (and cross term) shared by ``name``: one c×c matrix at a time."""
        h = self.of[name]
        for n in [n for n, x in self.of.items() if x is h]:
            del self.of[n]
            self.cross_of.pop(n, None)

    def done(self, name: str) -> None:
        """Linear ``name`` needs its Hessian no more; it is released once every sharer is done."""
        self._done.add(name)
        h = self.of.get(name)
        if h is not None and all(n in self._done for n, x in self.of.items() if x is h):
            self.release(name)

    def groups(self) -> list[list[str]]:
        """The groups in the order their inputs were first seen (after the first forward)."""
        return [[n for n in self.linears if id(self.of[n]) == h] for h in dict.fromkeys(id(v) for v in self.of.values())]

    def remove(self):
        for h in self.handles:
            h.remove()
        for m in self.moe.values():
            m.remove()


def sum_over_ranks(hs: SharedHessians, world: World) -> None:
    """Every Hessian and cross term of ``hs`` summed over the ranks, in the linears' order."""
    for m in hs.moe.values():
        m.world = world
    seen = set()
    for name in hs.linears:
        h = hs.of.get(name)
        if h is None or id(h) in seen:
            continue
        seen.add(id(h))
        ranks.sum_hessian(h, world, name)
        if name in hs.cross_of:
            ranks.sum_hessian(hs.cross_of[name], world, f"{name} (cross-covariance)")


def chunks_of(acts) -> Chunks:
    """How the sequences of activations ``acts`` (this rank's rows of the calibration set) share products."""
    start = acts.rows.start if hasattr(acts, "rows") else 0   # a plain tensor: every sequence, from the first
    return Chunks(sequences_per_product(*acts.shape[:2]), start)


@torch.no_grad()
def block_hessians(layer, linears: dict, inps, kw: dict, desc: str, progress: bool) -> SharedHessians:
    """Run the (unquantized) block on every calibration sequence with Hessian hooks."""
    hs = SharedHessians(linears, layer, chunks=chunks_of(inps))
    try:
        for j in bar(range(len(inps)), f"{desc}: Hessians", progress, unit="seq"):
            capture.run_block(layer, inps[j:j + 1], kw)
            hs.end_forward()
    finally:
        hs.remove()
    return hs


@torch.no_grad()
def head_hessian(norm: torch.nn.Module, inps: torch.Tensor, columns: int, device, desc: str,
                 progress: bool) -> PanelHessian:
    """The output head's ``XᵀX/n``: the final ``norm`` of the last quantized block's outputs ``inps``."""
    hs = PanelHessian(columns, device, chunks_of(inps))
    for j in bar(range(len(inps)), f"{desc}: Hessian", progress, unit="seq"):
        hs.add(norm(inps[j:j + 1]))
    return hs
