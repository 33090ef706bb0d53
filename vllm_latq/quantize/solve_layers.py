"""Solving one linear: the method's solver on its weight and Hessian, the result encoded
into the layer's checkpoint tensors, and its record for ``latq_stats.json`` and the log.

``solve(method, W, H, name, **kw) -> QuantResult`` is the pipeline's per-layer solver call;
:func:`~.pipeline.quantize_model` takes another through its ``solve=`` argument (the study
wraps it to swap GPTQ implementations).
"""
from __future__ import annotations

import logging
from functools import partial
from typing import Callable

import torch

from .. import hf_model
from .. import format as fmt
from .calibrate import SharedHessians
from .hessian import CrossCovariance, Hessian, qronos_target
from ..algorithms.hptq import hptq, hrtn
from ..algorithms.lattice import relative_error
from .moe import MoeInputs
from ..algorithms.result import QuantResult
from ..algorithms.solvers import babai, gptq, rtn
from . import ranks
from .ranks import SINGLE, World
from ..algorithms.ssqr import ssqr

log = logging.getLogger("vllm_latq.quantize")

Solve = Callable[..., QuantResult]   # solve(method, W, H, name, **kw) -> QuantResult
SOLVERS = {"ssqr": ssqr, "hptq": hptq, "gptq": gptq, "rtn": rtn, "hrtn": hrtn, "babai": babai}
# solvers that read the weight a few rows at a time in fp32: given it in its stored dtype, so an
# uncalibrated run never holds an fp32 copy of a matrix (the others get one)
ROW_READERS = {"rtn"}


def solve(method: str, W: torch.Tensor, H: torch.Tensor, name: str, **kw) -> QuantResult:
    """Run one solver (a name from ``format.METHODS``) → QuantResult with CPU tensors."""
    res = SOLVERS[method](W if method in ROW_READERS else W.float(), H, name=name, **kw)
    for f in ("z", "stored_q", "scales", "order", "bound"):
        v = getattr(res, f)
        if isinstance(v, torch.Tensor):
            setattr(res, f, v.cpu())
    if res.outliers is not None:
        o = res.outliers
        o.crow, o.col, o.val = o.crow.cpu(), o.col.cpu(), o.val.cpu()
    return res


def quantize_linear(name: str, W: torch.Tensor, hessian: Hessian | None, *, method: str, solver_kwargs: dict,
                    solve: Solve, stats: list, on_layer: Callable | None,
                    extra: dict | None = None) -> tuple[QuantResult, dict]:
    """Solve linear ``name`` (weight ``W``, its accumulated ``hessian``, None for uncalibrated
    methods), append its stats record (with ``extra``: an expert's routing) to ``stats`` and
    log it, call ``on_layer(name, W, H, result)`` → (result, its checkpoint tensors named
    ``<name>.<suffix>``)."""
    H = hessian.H if hessian is not None else None
    res = solve(method, W, H, name, **solver_kwargs)
    kind = fmt.kind_of(method)
    t = fmt.encode_layer(res, kind)
    s = layer_stats(name, W, H, res, t, kind)
    s["hessian_tokens"] = hessian.n if hessian is not None else 0
    s.update(extra or {})
    stats.append(s)
    log.info(log_line(s))
    if on_layer is not None:
        on_layer(name, W, H, res)
    return res, {f"{name}.{sfx}": v for sfx, v in t.items()}


def target_corrected(quantize: Callable, cross: dict[str, CrossCovariance], damp: float) -> Callable:
    """``quantize(name, W, hessian)`` solving each linear named in ``cross`` against its corrected
    target ``W′`` (:func:`~.hessian.qronos_target`) instead of ``W``; its stats (``rel_error``,
    ``cert``) are then those of the problem against ``W′``: ‖X̃(Q − W′)ᵀ‖. Others (experts) unchanged."""
    def corrected(name, W, hessian, **kw):
        if name not in cross:
            return quantize(name, W, hessian, **kw)
        return quantize(name, qronos_target(W, hessian.H, cross[name].C, damp), hessian, **kw)
    return corrected


def _exact(W: torch.Tensor, device, calibrated: bool) -> torch.Tensor:
    """A source weight on ``device``: in fp32 for a calibrated solve (its error statistics and
    target correction compute on it), else as stored (:func:`solve` gives each solver its dtype)."""
    return W.to(device=device, dtype=torch.float32 if calibrated else W.dtype)


def _owners(linears: dict, world: World, busy: list[int] | None = None) -> dict[str, int]:
    """Which rank solves each linear: balanced by solve cost, ``busy``: what each rank already
    solves beside them (:func:`~.ranks.assign_by_cost`); rank 0 alone without ranks."""
    if not world.distributed:
        return {n: 0 for n in linears}
    costs = {n: ranks.solve_cost(*m.weight.shape) for n, m in linears.items()}
    owner = ranks.assign_by_cost(costs, world, busy)
    return {n: owner[n] for n in linears}


def _expert_cost(experts: torch.nn.Module, parts: dict[str, hf_model.ExpertLinear]) -> int:
    """One expert's solve cost: its linears' (every expert of a module has the same shapes)."""
    shapes = [(len(range(*x.rows.indices(P.shape[1]))), P.shape[2])
              for x in parts.values() if x.expert == 0 for P in [experts.get_parameter(x.param.rpartition(".")[2])]]
    return sum(ranks.solve_cost(*rc) for rc in shapes)


def _solve_here(quantize: Callable, name: str, W, hessian, stats: list, world: World, **kw):
    """``quantize`` on this rank → (result, tensors, the stats records it appended, taken
    out of ``stats``: they are put back in the linears' order once every rank's are shared)."""
    n0 = len(stats)
    try:
        res, t = quantize(name, W, hessian, **kw)
    except Exception as e:
        if not world.distributed:
            raise
        raise RuntimeError(f"layer {name}: {type(e).__name__}: {e}") from e
    records = stats[n0:]
    del stats[n0:]
    return res, t, records


def _put(block: torch.nn.Module, within: Callable[[str], str], where: str | hf_model.ExpertLinear,
         q: torch.Tensor) -> None:
    """A dequantized weight into ``block``: linear ``where``'s, or an expert's slice of its fused
    parameter (``within``: a model name → its name in the block)."""
    if isinstance(where, str):
        hf_model.set_tensor(block, within(f"{where}.weight"), q)
    else:
        block.get_parameter(within(where.param)).data[where.expert, where.rows] = q


def _meet(jobs: dict, owner: dict, where: str, put: Callable, device, shard: dict, stats: list,
          world: World) -> None:
    """Run this rank's ``jobs`` (key → ``job()`` → ([(where, dequantized weight to share)],
    checkpoint tensors, stats records)), then take every rank's results in ``owner``'s order:
    the weights solved elsewhere into the block (``put``), the tensors into ``shard``, the records
    into ``stats``."""
    mine = {}
    with ranks.together(where, world):
        for key, job in jobs.items():
            if owner[key] == world.rank:
                mine[key] = job()
    for key, (weights, t, records) in ranks.share(mine, owner, world).items():
        for at, q in weights if owner[key] != world.rank else ():
            if q is not None:
                put(at, q.to(device))
        shard.update(t)
        stats.extend(records)


@torch.no_grad()
def solve_block(block: torch.nn.Module, block_name: str, desc: str, linears: dict[str, torch.nn.Linear],
                experts: dict[str, dict[str, hf_model.ExpertLinear]], hessians: SharedHessians | None,
                quantize: Callable, *, weight: Callable[[str], torch.Tensor],
                expert_weight: Callable[[str], torch.Tensor], names: hf_model.CheckpointNames, dtype: torch.dtype,
                device, progress: bool, stats: list, moe_min_tokens: int = 128, moe_route_all: bool = False,
                write_back: bool = True, world: World = SINGLE) -> dict[str, torch.Tensor]:
    """Quantize the ``linears`` of ``block`` (the module named ``block_name``; ``desc`` in logs)
    with ``quantize(name, W, hessian)``, each on its exact source weight ``weight(name)`` (fp32
    when calibrated, even when the forwards run in a narrower ``dtype``), then its ``experts``
    (:func:`solve_experts`; {}: none, or not yet), and put the dequantized weights into the block,
    so its outputs are the quantized block's (``write_back=False``: no forwards follow, the block
    stays unloaded) → the block's quantized tensors, by checkpoint name (``names``). Each Hessian is
    released as soon as the last linear sharing it is solved. With several ranks each linear is
    solved on one (:func:`_owners`) and its result shared with all; ``stats`` gets the records in
    order. When the experts leave ranks idle in their first round, the linears are solved in that
    round on those ranks (balanced by cost with the round's experts), not in a round of their own."""
    from tqdm.auto import tqdm
    within = lambda name: name[len(block_name) + 1:]  # noqa: E731  (a model name → its name in the block)
    put = partial(_put, block, within)
    first = next(iter(experts), None)
    module = block.get_submodule(within(first)) if first else None
    rounds = ranks.expert_rounds(module.gate_up_proj.shape[0], world) if first else None
    joined = world.distributed and rounds is not None and len(rounds[0]) < world.size
    busy = [_expert_cost(module, experts[first]) if r in rounds[0].values() else 0 for r in range(world.size)] \
        if joined else None
    owner = _owners(linears, world, busy)
    last_user = {id(hessians.of[n]): n for n in linears if owner[n] == world.rank} if hessians is not None else {}
    if hessians is not None:   # the Hessians only other ranks use
        for name in linears:
            if name in hessians.of and id(hessians.of[name]) not in last_user:
                hessians.release(name)
    bar = tqdm(total=len(linears), desc=f"{desc}: quantizing", unit="layer", disable=not progress, leave=False)

    def job(name):
        W = _exact(weight(name), device, hessians is not None)
        res, t, records = _solve_here(quantize, names.module(name), W,
                                      hessians.of[name] if hessians is not None else None, stats, world)
        q = res.q.to(device=device, dtype=dtype) if write_back else None
        if q is not None:
            put(name, q)
        if hessians is not None and last_user[id(hessians.of[name])] == name:
            hessians.release(name)
        bar.update()
        # returning drops the fp32 weight and solution: held through the next solve, up_proj's
        # would live through down_proj's
        return [(name, q.cpu() if q is not None and world.distributed else None)], t, records
    jobs = {name: partial(job, name) for name in linears}
    shard: dict[str, torch.Tensor] = {}
    if not joined:
        _meet(jobs, owner, desc, put, device, shard, stats, world)
    for name, parts in experts.items():
        inputs = hessians.moe[within(name)] if hessians is not None else None
        shard.update(solve_experts(block.get_submodule(within(name)), name, parts, inputs, quantize, expert_weight,
                                   dtype, device, moe_min_tokens, moe_route_all, progress, stats, write_back, world,
                                   put, (jobs, owner, desc) if joined and name == first else None))
    bar.close()
    return shard


@torch.no_grad()
def solve_experts(experts: torch.nn.Module, module: str, parts: dict[str, hf_model.ExpertLinear],
                  inputs: MoeInputs | None, quantize: Callable, expert_weight: Callable[[str], torch.Tensor],
                  dtype: torch.dtype, device, min_tokens: int, route_all: bool, progress: bool, stats: list,
                  write_back: bool = True, world: World = SINGLE, put: Callable | None = None,
                  linears: tuple[dict, dict, str] | None = None) -> dict:
    """Quantize the experts of the experts module ``experts`` (named ``module``): expert e's Hessians
    (:meth:`~.moe.MoeInputs.expert_hessians`, from its routed inputs; None uncalibrated), then
    each of its linears ``parts`` (checkpoint name → slice of a fused parameter) on its exact
    source weight ``expert_weight(name)``, its dequantized weight (in ``dtype``) written into its
    slice of the fused parameter. Experts go in rounds of at most one per rank
    (:func:`~.ranks.expert_rounds`): the round's Hessians summed over every rank's tokens, each
    rank solving its expert, the results shared. ``put(where, q)`` writes a weight solved
    elsewhere (the block's, :func:`solve_block`); the first round also runs ``linears`` (the
    block's jobs, their owners and its description)."""
    from tqdm.auto import tqdm
    leaf = lambda x: x.param.rpartition(".")[2]  # noqa: E731  (the fused parameter's name in ``experts``)
    role = lambda x: hf_model.EXPERT_PARAMS.index(leaf(x))  # noqa: E731  (0: gate/up, 1: down)

    def put_expert(x, q):
        experts.get_parameter(leaf(x)).data[x.expert, x.rows] = q
    put = put or put_expert
    num_experts = experts.gate_up_proj.shape[0]
    if inputs is not None:
        counts = inputs.routed_tokens(world)
        starved = [e for e, n in enumerate(counts) if n < min_tokens]
        tokens = ranks.sum_counts([inputs.num_tokens], world)[0]
        log.info("%s: %d tokens × top-%d routed, per expert %d..%d; %s", module, tokens,
                 sum(counts) // max(tokens, 1), min(counts), max(counts),
                 "every token through every expert (route_all)" if route_all else
                 f"{len(starved)} experts below {min_tokens} tokens blended with all tokens: {starved}")
    order = sorted(parts.items(), key=lambda kv: (kv[1].expert, role(kv[1]), kv[1].rows.start))
    shard: dict[str, torch.Tensor] = {}
    bar = tqdm(total=num_experts, desc=f"{module}: experts", unit="expert", disable=not progress, leave=False)

    def job(e, hs):
        weights, tensors, records = [], {}, []
        for name, x in (kv for kv in order if kv[1].expert == e):
            W = _exact(expert_weight(name), device, inputs is not None)
            extra = {"expert": e} if hs is None else {"expert": e, "expert_tokens": hs.tokens,
                                                      "moe_fallback": hs.fallback}
            res, t, recs = _solve_here(quantize, name, W, None if hs is None else (hs.inp, hs.mid)[role(x)],
                                       stats, world, extra=extra)
            q = res.q.to(device=device, dtype=dtype) if write_back else None
            if q is not None:
                put(x, q)
            weights.append((x, q.cpu() if q is not None and world.distributed else None))
            tensors.update(t)
            records += recs
            del W, res, t, q
        return weights, tensors, records
    for k, owner in enumerate(ranks.expert_rounds(num_experts, world)):
        jobs = {}
        for e in owner:   # collective: every rank sums every expert's Hessians of the round
            hs = inputs.expert_hessians(e, min_tokens, route_all, world) if inputs is not None else None
            if owner[e] == world.rank:
                jobs[e] = partial(job, e, hs)
        hs = None
        where = f"{module}, experts {min(owner)}..{max(owner)}"
        if k == 0 and linears is not None:   # the block's linears first, as one process orders its records
            jobs, owner, where = {**linears[0], **jobs}, {**linears[1], **owner}, f"{linears[2]} and {where}"
        _meet(jobs, owner, where, put, device, shard, stats, world)
        bar.update(sum(isinstance(e, int) for e in owner))
        jobs = None
    bar.close()
    return shard


def layer_stats(name, W, H, res, t, kind) -> dict:
    """Per-layer record for latq_stats.json (deterministic: no timings), computed where ``W``
    and ``H`` are (``res`` holds CPU tensors). Without a Hessian (uncalibrated methods) there
    is no output error to report: ``rel_error`` is None."""
    rel = relative_error(W, res.q, H) if H is not None else None
    cert = None
    if res.bound is not None:
        err = res.error(W, H)
        cert = (err / res.bound.to(err.device).clamp_min(1e-300)).max().item()
    st = fmt.layer_stats(t, kind, tuple(W.shape))
    return {"name": name, "method": res.method, "shape": list(W.shape), "bits": st["bits"],
            "solver_bits": float(res.bits_per_weight), "outlier_rate": st["outlier_rate"],
            "rel_error": rel, "cert": cert,
            "damp": res.damp, "alpha": res.info.get("alpha")}


def log_line(s: dict) -> str:
    cert = f"{s['cert']:.3f}" if s["cert"] is not None else "—"
    rel = f"{s['rel_error']:.3e}" if s["rel_error"] is not None else "—"
    routed = "" if s.get("expert_tokens") is None else f", {s['expert_tokens']} routed tokens" + (
        f" ({s['moe_fallback']})" if s["moe_fallback"] else "")
    return (f"{s['name']}: {s['method']} {s['bits']:.3f} bits/w, outliers {100 * s['outlier_rate']:.3f}%, "
            f"rel.err {rel}, cert {cert}{routed}")
