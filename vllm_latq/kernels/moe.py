"""Routed experts through the latq kernels: the mixture-of-experts forward of one layer,
``y_t = Σ_k p_tk · W2_e(act(W13_e x_t))`` with each expert's linears prepared by their own
kernel, by one of three paths (:func:`experts_forward`), its states carried through the custom
op ``latq::moe_experts`` (:func:`flatten` / :func:`unflatten`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from . import graphs, selector
from .base import LatqKernel
from .rotated import RotatedKernel, RotatedState, rotate_activations

GATED = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh")}
UNGATED = {"silu_no_mul": F.silu, "gelu_no_mul": F.gelu,
           "gelu_tanh_no_mul": lambda u: F.gelu(u, approximate="tanh"), "relu2_no_mul": lambda u: F.relu(u).square()}
ACTIVATIONS = (*GATED, *UNGATED)   # vLLM's MoEActivation values served here


def activate(h: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) · up`` on ``h = [gate | up]`` (gated, vLLM's ``*_and_mul``), else ``act(h)``."""
    if activation in GATED:
        gate, up = h.chunk(2, dim=-1)
        return GATED[activation](gate) * up
    if activation in UNGATED:
        return UNGATED[activation](h)
    raise ValueError(f"latq: MoE activation {activation!r} is not supported (supported: {list(ACTIVATIONS)})")


@dataclass
class Expert:
    """One expert's two prepared latq linears."""
    w13: tuple[type[LatqKernel], Any]    # (kernel, state): [hidden] → [2·I] (gated) or [I]
    w2: tuple[type[LatqKernel], Any]     # (kernel, state): [I] → [hidden]


def _run(linear: tuple[type[LatqKernel], Any], x: torch.Tensor) -> torch.Tensor:
    kernel, state = linear
    return kernel.apply(state, x)


def expert_mlp(e: Expert, x: torch.Tensor, activation: str) -> torch.Tensor:
    return _run(e.w2, activate(_run(e.w13, x), activation))


@dataclass
class Stacked:
    """The experts' projections stacked for the grouped kernel (``triton_moe.StackedTriton``); of
    rotated experts, the signs of each projection's input rotation (one for all experts)."""
    w13: Any
    w2: Any
    w13_signs: torch.Tensor | None = None
    w2_signs: torch.Tensor | None = None


def _inner(linear: tuple[type[LatqKernel], Any]) -> tuple[Any, torch.Tensor | None]:
    """(the kernel's own state, the rotation's signs or None) of a prepared linear."""
    kernel, state = linear
    return (state.inner, state.signs) if issubclass(kernel, RotatedKernel) else (state, None)


def _rotation_reason(signs: list) -> str | None:
    if any(s is None for s in signs) != all(s is None for s in signs):
        return "some experts' inputs are rotated and some not"
    if signs[0] is not None and any(not torch.equal(s, signs[0]) for s in signs):
        return "the experts' inputs are rotated differently"
    return None


def stack_experts(experts: list[Expert]) -> tuple[Stacked | None, str | None]:
    """(stacks, None) and the experts' states rebound to views of them (weights stored once),
    or (None, why the stacked path cannot run these experts). Rotated experts are stacked by
    their kernels' states, the rotation applied once per projection around the grouped kernel."""
    try:
        from .triton import grouped_moe as triton_moe
    except ImportError as e:
        return None, f"Triton is not importable ({e})"
    for stem in ("w13", "w2"):
        states, signs = zip(*(_inner(getattr(ex, stem)) for ex in experts))
        why = triton_moe.stack_reason(list(states)) or _rotation_reason(list(signs))
        if why is not None:
            return None, f"{stem}: {why}"
    stacks, rotations = [], []
    for stem in ("w13", "w2"):
        states, signs = zip(*(_inner(getattr(ex, stem)) for ex in experts))
        st, views = triton_moe.stack(list(states))
        for ex, v in zip(experts, views):
            kernel = getattr(ex, stem)[0]
            setattr(ex, stem, (kernel, v if signs[0] is None else RotatedState(v, signs[0])))
        stacks.append(st)
        rotations.append(signs[0])
    return Stacked(*stacks, *rotations), None


def compile_stacked(stacked: Stacked, act_dtype: torch.dtype) -> None:
    """Compile the grouped kernel of both stacks for every row block (``triton_moe.compile_all``)."""
    from .triton import grouped_moe as triton_moe
    for st in (stacked.w13, stacked.w2):
        triton_moe.compile_all(st, act_dtype)


def choose_path(x: torch.Tensor, topk: int, stacked: Stacked | None) -> str:
    """``stacked``, or the other path by ``triton_moe.path_times``: ``masked`` for a batch vLLM may
    capture (its warm-up too, so the capture runs only what the warm-up prepared), else ``host``."""
    other = "masked" if graphs.may_be_captured(x.device, x.shape[0]) else "host"
    if stacked is None:
        return other
    from .triton import grouped_moe as triton_moe
    t = triton_moe.path_times(x.shape[0], topk, stacked.w13, stacked.w2, x.device)
    return "stacked" if t["stacked"] <= t[other] else other


def experts_forward(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, experts: list[Expert],
                    activation: str, *, weights_on_input: bool = False, stacked: Stacked | None = None,
                    path: str | None = None) -> torch.Tensor:
    """``x`` [T, hidden], ``topk_ids`` [T, k] local expert ids (−1: not on this rank), ``topk_weights``
    [T, k] → [T, hidden] in x.dtype, summed in fp32; ``weights_on_input``: vLLM's
    ``apply_router_weight_on_input``. ``path`` (None: :func:`choose_path`): ``stacked`` (one grouped
    Triton launch per projection, no host sync), ``host`` (one GEMM per routed expert, eager) or
    ``masked`` (every expert on every token, capturable with any kernel; docs/ARCHITECTURE.md)."""
    T, k = topk_ids.shape
    path = path or choose_path(x, k, stacked)
    if path == "stacked":
        if stacked is None:
            raise ValueError("latq: the stacked MoE path needs the experts' stacks (stack_experts)")
        from .triton import grouped_moe as triton_moe
        s13, s2 = stacked.w13_signs, stacked.w2_signs
        act = (lambda h: activate(h, activation)) if s2 is None else (
            lambda h: rotate_activations(activate(h, activation), s2))
        return triton_moe.grouped_forward(x if s13 is None else rotate_activations(x, s13), topk_weights, topk_ids,
                                          stacked.w13, stacked.w2, act, weights_on_input)
    out = torch.zeros(T, x.shape[-1], dtype=torch.float32, device=x.device)
    if path == "masked":
        for e, ex in enumerate(experts):
            p = (topk_weights * (topk_ids == e)).sum(1, keepdim=True).float()    # [T, 1], 0 where not routed
            y = expert_mlp(ex, x * p.to(x.dtype) if weights_on_input else x, activation).float()
            out += y if weights_on_input else p * y
        return out.to(x.dtype)
    if path != "host":
        raise ValueError(f"latq: MoE path {path!r} (one of stacked, host, masked)")
    ids = topk_ids.reshape(-1).long()
    order = torch.argsort(ids, stable=True)                # (token, slot) pairs grouped by expert
    # pairs per expert (one host sync); the −1 pairs sort first and are skipped
    start, *counts = torch.bincount(ids + 1, minlength=len(experts) + 1).tolist()
    p_all = topk_weights.reshape(-1)
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start:start + n]
        start += n
        t = pairs // k                                     # their tokens
        p = p_all[pairs, None]
        xe = x[t]
        if weights_on_input:
            y = expert_mlp(experts[e], xe * p.to(x.dtype), activation).float()
        else:
            y = p.float() * expert_mlp(experts[e], xe, activation).float()
        out.index_add_(0, t, y)
    return out.to(x.dtype)


# ----------------------------------------------------------------------------- custom-op state

def flatten(experts: list[Expert], stacked: Stacked | None = None) -> tuple[list[torch.Tensor | None], list[int]]:
    """Experts (+ stacks) → (tensors, ints): ints = [E, then per expert and projection: kernel
    index (:func:`~.selector.kernel_index`), tensor count, int count, the kernel's ints; then 1 and
    per stack its tensor count, int count and ints, or 0 without stacks]; a stacked layer's tensors
    end with its two projections' rotation signs (None: not rotated)."""
    tensors, ints = [], [len(experts)]
    for ex in experts:
        for kernel, state in (ex.w13, ex.w2):
            t, i = kernel.flatten(state)
            tensors += t
            ints += [selector.kernel_index(kernel), len(t), len(i), *i]
    ints.append(int(stacked is not None))
    if stacked is not None:
        for st in (stacked.w13, stacked.w2):
            t, i = st.flatten()
            tensors += t
            ints += [len(t), len(i), *i]
        tensors += [stacked.w13_signs, stacked.w2_signs]
    return tensors, ints


def unflatten(tensors: list[torch.Tensor | None], ints: list[int]) -> tuple[list[Expert], Stacked | None]:
    experts, ti, ii = [], 0, 1
    for _ in range(ints[0]):
        pair = []
        for _ in range(2):
            kernel, nt, ni = selector.kernel_at(ints[ii]), ints[ii + 1], ints[ii + 2]
            pair.append((kernel, kernel.unflatten(tensors[ti:ti + nt], ints[ii + 3:ii + 3 + ni])))
            ti, ii = ti + nt, ii + 3 + ni
        experts.append(Expert(*pair))
    if not ints[ii]:
        return experts, None
    from .triton.grouped_moe import StackedTriton
    ii += 1
    stacks = []
    for _ in range(2):
        nt, ni = ints[ii], ints[ii + 1]
        stacks.append(StackedTriton.unflatten(tensors[ti:ti + nt], ints[ii + 2:ii + 2 + ni]))
        ti, ii = ti + nt, ii + 2 + ni
    return experts, Stacked(*stacks, *tensors[ti:ti + 2])
