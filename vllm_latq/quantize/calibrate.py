"""Calibration statistics: the Hessians ``XᵀX`` of a decoder block's linears over every
calibration sequence, and of the output head.

Linears fed the very same tensor (q/k/v, gate/up) share one Hessian; products are fp32 GEMMs
summed in fp64 (:class:`~.hessian.PanelHessian`).

With target correction (``targets``: the block's full-precision inputs X, a second stream), each
sequence first runs through the unquantized block on X, keeping every linear's input, then on X̃
(the quantized prefix's outputs): the Hessian hooks add ``X̃ᵀX`` (:class:`~.hessian.CrossCovariance`)
beside ``X̃ᵀX̃``, same tokens on both streams. The X pass's outputs are the next block's X.
:func:`target_corrected_stages` does this true-sequentially: a group of linears sharing an input
(q/k/v, o, gate/up, down) gets its X̃ from the block with every earlier group already quantized,
because a corrected earlier group already moves its outputs toward the full-precision ones — from
inputs of the unquantized block a later group would correct the same drift a second time.
Experts of a mixture-of-experts block get no cross term: they are solved against their own W.
A stage's forwards stop once its group has seen its input (:class:`InputsSeen`): the rest of the
block is not needed until the last stage, whose unquantized outputs are the next block's X.
"""
from __future__ import annotations

import copy
import shutil
from typing import Iterator

import torch

from .. import hf_model
from . import capture
from .activations import Activations
from .hessian import CrossCovariance, Hessian, PanelHessian
from .moe import MoeInputs
from . import ranks
from .ranks import World


class InputsSeen(Exception):
    """Raised by a hook once every linear of :attr:`SharedHessians.stop_after` has seen its input
    in the current forward: what follows in the block would not change the statistics."""


class SharedHessians:
    """Forward pre-hooks on a block's linears accumulating ``XᵀX`` in fp64. During the first
    forward, linears that receive the very same input tensor (q/k/v, gate/up) are grouped and
    share one Hessian; afterwards only each group's first member accumulates. ``moe``: the
    inputs of each experts module of ``block`` (by name within it). ``cross_of``: with target
    correction, each linear's ``X̃ᵀX`` (shared like the Hessians), against the inputs
    :meth:`record_targets` kept. ``stop_after``: linears whose inputs end a forward
    (:meth:`forward`) once all of them have been seen; empty: forwards run to the end."""

    def __init__(self, linears: dict[str, torch.nn.Linear], block: torch.nn.Module | None = None,
                 target_linears: dict[str, torch.nn.Linear] | None = None):
        self.linears = linears
        self.moe = {n: MoeInputs(m) for n, m in hf_model.expert_modules(block).items()} if block is not None else {}
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
        """``layer``'s outputs on ``x``, or None when ``stop`` and :attr:`stop_after` ended it early."""
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
            hs = PanelHessian(mod.in_features, mod.weight.device)
            hs.add(x.detach())
            self.of[name], self.leader[name] = hs, True
            self._leader_of[id(hs)] = name
            if self.targets is not None:
                self.cross_of[name] = CrossCovariance(mod.in_features, mod.weight.device)
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
        """Run ``layer`` (the unquantized copy whose linears were given as ``target_linears``) on
        the full-precision inputs ``x`` keeping each linear's input (the X of the next forward's
        cross terms; no Hessian is touched) → its outputs (None: ``stop`` ended it early)."""
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
        """Drop the Hessian (and cross term) of ``name`` and of every linear sharing it: called
        once the last of them is solved, so that a block holds one c×c matrix at a time."""
        h = self.of[name]
        for n in [n for n, x in self.of.items() if x is h]:
            del self.of[n]
            self.cross_of.pop(n, None)

    def groups(self) -> list[list[str]]:
        """The groups in the order their inputs were first seen (after the first forward)."""
        return [[n for n in self.linears if id(self.of[n]) == h] for h in dict.fromkeys(id(v) for v in self.of.values())]

    def remove(self):
        for h in self.handles:
            h.remove()
        for m in self.moe.values():
            m.remove()


def sum_over_ranks(hs: SharedHessians, world: World) -> None:
    """Every Hessian (and cross term) of ``hs``, accumulated over this rank's sequences, made
    the sum over every rank's — in the linears' order, the same on every rank."""
    seen = set()
    for name in hs.linears:
        h = hs.of.get(name)
        if h is None or id(h) in seen:
            continue
        seen.add(id(h))
        ranks.sum_hessian(h, world)
        if name in hs.cross_of:
            ranks.sum_hessian(hs.cross_of[name], world)


@torch.no_grad()
def block_hessians(layer, linears: dict, inps, kw: dict, desc: str, progress: bool) -> SharedHessians:
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


def target_corrected_stages(layer, linears: dict, inps: Activations, targets: Activations, kw: dict, desc: str,
                            progress: bool) -> Iterator[tuple[list[str], SharedHessians, bool]]:
    """True-sequential calibration with target correction: yields ``(names, hessians, last)`` per
    group of linears sharing an input, in forward order, with their X̃ᵀX̃ and X̃ᵀX from a forward
    of ``layer`` as the caller has quantized it so far (it quantizes each group between yields)
    and X from an unquantized copy of it; ``last``: the stage after which the block is done (its
    Hessians also hold the experts' inputs). The copy's outputs on X become the next block's X."""
    from tqdm.auto import tqdm
    original = copy.deepcopy(layer)
    name_in_layer = {id(m): n for n, m in layer.named_modules()}
    in_original = dict(original.named_modules())
    twins = {name: in_original[name_in_layer[id(m)]] for name, m in linears.items()}
    has_experts = bool(hf_model.expert_modules(layer))
    groups: list[list[str]] | None = None
    stage = 0
    while groups is None or stage < len(groups) + has_experts:
        names = list(linears) if groups is None else groups[stage] if stage < len(groups) else []
        last = groups is not None and stage == len(groups) + has_experts - 1
        hs = SharedHessians({n: linears[n] for n in names}, layer if last and has_experts else None,
                            {n: twins[n] for n in names})
        try:
            for j in tqdm(range(len(inps)), desc=f"{desc}: Hessians {stage + 1}", unit="seq", disable=not progress,
                          leave=False):
                if groups is not None or j > 0:   # the first forward of the block finds the groups
                    hs.stop_after = frozenset(hs.groups()[0] if groups is None else names)
                y = hs.record_targets(original, targets[j:j + 1], kw, stop=not last)
                hs.forward(layer, inps[j:j + 1], kw)
                hs.end_forward()
                if last:
                    targets.write(j, y[0])   # the sequence's X is not read again in this block
        finally:
            hs.remove()
        if groups is None:   # the first pass found the groups (the order their inputs were seen)
            groups = hs.groups()
            for g in groups[1:]:   # their statistics come from later stages: one block's worth less held
                hs.release(g[0])
            last = len(groups) == 1 and not has_experts
            if last:   # a single group: its outputs were not written; nothing is quantized yet
                for j in range(len(inps)):
                    targets.write(j, capture.run_block(original, targets[j:j + 1], kw)[0])
            yield groups[0], hs, last
        else:
            yield names, hs, last
        stage += 1
    targets.advance()   # its older inputs go once the block is saved (RunDir.save_block), as the first stream's


TARGET_STREAM_DIR = "latq_target_stream"  # in the run directory, when the stream spills to disk


def full_precision_stream(acts: Activations, budget: int | None) -> Activations:
    """Target correction's second stream for the block ``acts`` enters, kept in memory up to
    ``budget`` bytes (None: half the memory then available) like the first: a copy of block 0's
    inputs, or, resuming, the stream saved with the last finished block (``RunDir.save_block``)."""
    run_dir = acts.run_dir / TARGET_STREAM_DIR
    if acts.block > 0:
        return Activations.resume(run_dir, acts.shape, acts.dtype, acts.device, budget, acts.block, acts.rows,
                                  acts.world)
    run_dir.mkdir(exist_ok=True)
    targets = Activations.create(run_dir, acts.shape, acts.dtype, acts.device, budget, acts.block - 1, acts.rows,
                                 acts.world)
    for j in range(len(acts)):
        targets.write(j, acts[j:j + 1][0])
    targets.advance()
    return targets


def drop_stream(targets: Activations) -> None:
    ranks.barrier(targets.world)
    if targets.world.writes:
        shutil.rmtree(targets.run_dir, ignore_errors=True)


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
