"""Mixture-of-experts calibration: each expert's Hessians from the tokens its router sends it,
formed one expert at a time from inputs kept during the block's one Hessian forward."""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from . import ranks
from .hessian import Chunks, PanelHessian
from .ranks import SINGLE, World

BLEND, ALL_TOKENS = "blend", "all-tokens"   # the fallbacks recorded per expert


@dataclass
class ExpertHessians:
    """Expert e's Hessians (gate/up input, down input), its routed tokens and fallback used."""
    inp: PanelHessian
    mid: PanelHessian
    tokens: int
    fallback: str | None


def blend(routed: PanelHessian, everything: PanelHessian, min_tokens: int) -> PanelHessian:
    """``(S_e + (t − n_e)/N · S_all) / t``: the routed sums topped up to ``t`` tokens."""
    return PanelHessian.from_sum(routed.sum + everything.sum * ((min_tokens - routed.n) / everything.n), min_tokens)


class MoeInputs:
    """A pre-hook on one experts module keeping its inputs and routing, and the per-expert Hessians.
    Once ``world`` is set, sums are over every rank's tokens and every method is collective."""

    def __init__(self, experts: torch.nn.Module, chunks: Chunks = Chunks()):
        self.experts, self.chunks = experts, chunks
        self.hidden: list[torch.Tensor] = []   # [tokens, H] per forward
        self.index: list[torch.Tensor] = []    # [tokens, k] per forward
        self._signature = inspect.signature(experts.forward)
        self._all_inp: PanelHessian | None = None
        self.handle = experts.register_forward_pre_hook(self._hook, with_kwargs=True)
        self.world: World = SINGLE

    def _hook(self, mod, args, kwargs):
        a = self._signature.bind(*args, **kwargs).arguments
        self.hidden.append(a["hidden_states"].detach().reshape(-1, a["hidden_states"].shape[-1]))
        self.index.append(a["top_k_index"].detach().reshape(len(self.hidden[-1]), -1))

    def remove(self) -> None:
        self.handle.remove()

    @property
    def num_tokens(self) -> int:
        """The tokens that entered the module here (this rank's)."""
        return sum(len(x) for x in self.hidden)

    def total_tokens(self) -> int:
        return ranks.sum_counts([self.num_tokens], self.world)[0]

    def routed_tokens(self) -> list[int]:
        """Tokens routed to each expert (they sum to tokens × top_k)."""
        counts = sum(torch.bincount(i.reshape(-1).cpu(), minlength=self.experts.num_experts) for i in self.index)
        return ranks.sum_counts([int(c) for c in counts[:self.experts.num_experts]], self.world)

    def _all_inputs(self) -> PanelHessian:
        if self._all_inp is None:
            self._all_inp = PanelHessian(self.hidden[0].shape[1], self.hidden[0].device, self.chunks)
            for x in self.hidden:
                self._all_inp.add(x)
            ranks.sum_hessian(self._all_inp, self.world, "the experts' inputs")
        return self._all_inp

    @torch.no_grad()
    def expert_hessians(self, e: int, min_tokens: int, route_all: bool) -> ExpertHessians:
        """Expert ``e``'s Hessians, before its weights are replaced by quantized ones."""
        if min_tokens < 1:
            raise ValueError(f"moe_min_tokens must be >= 1, got {min_tokens}")
        W = self.experts.gate_up_proj[e]   # [2I, H]
        columns, device = W.shape[1], W.device
        inp, mid = PanelHessian(columns, device, self.chunks), PanelHessian(W.shape[0] // 2, device, self.chunks)
        tokens = ranks.sum_counts([sum(int((i == e).any(-1).sum()) for i in self.index)], self.world)[0]
        fallback = ALL_TOKENS if route_all else BLEND if tokens < min_tokens else None
        all_mid = PanelHessian(W.shape[0] // 2, device, self.chunks) if fallback else None
        for x, i in zip(self.hidden, self.index):
            routed = (i == e).any(-1)
            if fallback:
                act = self.experts._apply_gate(torch.nn.functional.linear(x, W))
                all_mid.add(act)
                act = act[routed]
            else:
                act = self.experts._apply_gate(torch.nn.functional.linear(x[routed], W))
            inp.add(x[routed])   # every sequence, routed tokens or none: products follow the sequences
            mid.add(act)
        for h, what in ((inp, "inputs"), (mid, "intermediate"), (all_mid, "intermediate, every token")):
            if h is not None:
                ranks.sum_hessian(h, self.world, f"expert {e}'s {what}")
        if fallback == ALL_TOKENS:
            return ExpertHessians(self._all_inputs(), all_mid, tokens, fallback)
        if fallback == BLEND:
            return ExpertHessians(blend(inp, self._all_inputs(), min_tokens), blend(mid, all_mid, min_tokens),
                                  tokens, fallback)
        return ExpertHessians(inp, mid, tokens, None)
