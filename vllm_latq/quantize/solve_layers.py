"""Solving a decoder block: each linear by the method's solver on its weight and Hessian
(:func:`solve_linear`), encoded with its stats record, then the experts one at a time. It reads
as one process: the :class:`~.ranks.Scheduler` decides which rank solves what and returns the
results in order."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch

from .. import hf_model
from .. import format as fmt
from ..progress import bar
from ..algorithms.e8 import e8
from ..algorithms.hptq import hptq, hrtn
from ..algorithms.lattice import relative_error
from ..algorithms.result import QuantResult
from ..algorithms.solvers import babai, gptq, rtn
from ..algorithms.ssqr import ssqr
from ..format.rotation import Rotation
from .calibrate import SharedHessians
from .hessian import Hessian
from .moe import MoeInputs
from .ranks import Job, RoundJobs, Scheduler, solve_cost
from .rotate import rotated_problem, serve_rotated

log = logging.getLogger("vllm_latq.quantize")

Solve = Callable[..., QuantResult]   # solve(method, W, H, name, **kw) -> QuantResult
SOLVERS = {"ssqr": ssqr, "hptq": hptq, "gptq": gptq, "rtn": rtn, "hrtn": hrtn, "babai": babai, "e8": e8}
# solvers that read the weight a few rows at a time in fp32: given it in its stored dtype, so an
# uncalibrated run never holds an fp32 copy of a matrix (the others get one)
ROW_READERS = {"rtn"}


def solve(method: str, W: torch.Tensor, H: torch.Tensor, name: str, **kw) -> QuantResult:
    """Run one solver (a name from ``format.METHODS``) → QuantResult with CPU tensors."""
    res = SOLVERS[method](W if method in ROW_READERS else W.float(), H, name=name, **kw)
    for f in ("z", "stored_q", "scales", "order", "bound", "codes"):
        v = getattr(res, f)
        if isinstance(v, torch.Tensor):
            setattr(res, f, v.cpu())
    if res.outliers is not None:
        o = res.outliers
        o.crow, o.col, o.val = o.crow.cpu(), o.col.cpu(), o.val.cpu()
    if res.coded_scales is not None:
        res.coded_scales = res.coded_scales.to("cpu")
    res.info = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in res.info.items()}
    return res


@dataclass(frozen=True)
class LayerSolver:
    """How a run solves each linear: ``method`` with its ``solver_kwargs`` through ``solve``;
    ``on_layer(name, W, H, result)`` is told of each (tests); ``rotation``: each solved in its
    rotated frame (``--rotate``). Called as ``(name, W, hessian, extra=None)``: :func:`solve_linear`."""
    method: str
    solver_kwargs: dict
    solve: Solve = solve
    on_layer: Callable | None = None
    rotation: Rotation | None = None

    def __call__(self, name: str, W: torch.Tensor, hessian: Hessian | None, extra: dict | None = None):
        return solve_linear(name, W, hessian, self, extra)


def solve_linear(name: str, W: torch.Tensor, hessian: Hessian | None, solver: LayerSolver,
                 extra: dict | None = None) -> tuple[QuantResult, dict, dict]:
    """Linear ``name``, its weight ``W`` and accumulated ``hessian`` (None: an uncalibrated method)
    → (the solver's result, its checkpoint tensors named ``<name>.<suffix>``, its stats record,
    with ``extra``: an expert's routing). The record is logged. A rotated run solves, encodes and
    records ``(W·R, Rᵀ·H·R)`` (the same error, so the same certificate) and returns ``Q·Rᵀ``."""
    signs = None
    if solver.rotation is not None:
        W, hessian, signs = rotated_problem(W, hessian, solver.rotation)
        extra = {**(extra or {}), "rotation_block": signs.numel()}
    H = hessian.H if hessian is not None else None
    res = solver.solve(solver.method, W, H, name, **solver.solver_kwargs)
    kind = fmt.kind_of(solver.method)
    t = fmt.encode_layer(res, kind)
    record = layer_stats(name, W, H, res, t, kind)
    record["hessian_tokens"] = hessian.n if hessian is not None else 0
    record.update(extra or {})
    log.info(log_line(record))
    if solver.on_layer is not None:
        solver.on_layer(name, W, H, res)
    if signs is not None:
        serve_rotated(res, signs)
    return res, {f"{name}.{sfx}": v for sfx, v in t.items()}, record


@dataclass
class Solved:
    """What solving produced, as every rank receives it: the dequantized weights to put into the
    block (where → q; None: not written back), the checkpoint tensors, the stats records in order."""
    weights: list = field(default_factory=list)
    tensors: dict = field(default_factory=dict)
    records: list = field(default_factory=list)

    def add(self, where, q: torch.Tensor | None, tensors: dict, record: dict) -> None:
        self.weights.append((where, q))
        self.tensors.update(tensors)
        self.records.append(record)

    def portable(self) -> "Solved":
        """This result with its weights in host memory, to travel to another rank."""
        return Solved([(w, None if q is None else q.cpu()) for w, q in self.weights], self.tensors, self.records)


@dataclass
class Stage:
    """What one solve of a block takes on: ``linears`` (model name → module), ``experts`` ({experts
    module: {checkpoint name: where its weight lives}}; {}: none, or not yet), their ``hessians``
    (None: an uncalibrated method) and ``quantize(name, W, hessian, extra=None)`` (a
    :class:`LayerSolver`, or one wrapped to solve another problem: target correction, folded columns)."""
    linears: dict[str, torch.nn.Linear]
    experts: dict[str, dict[str, hf_model.ExpertLinear]]
    hessians: SharedHessians | None
    quantize: Callable


@dataclass(frozen=True)
class SolveSetup:
    """What every block's solve reads: the source's exact weights (``weight(name)`` of a linear,
    ``expert_weight(name)`` of an expert's), their checkpoint ``names``, the block's ``dtype`` and
    ``device``, ``write_back`` (the dequantized weights go into the block: forwards follow), the
    experts' calibration options and the ``scheduler``."""
    weight: Callable[[str], torch.Tensor]
    expert_weight: Callable[[str], torch.Tensor]
    names: hf_model.CheckpointNames
    dtype: torch.dtype
    device: torch.device
    write_back: bool
    moe_min_tokens: int
    moe_route_all: bool
    scheduler: Scheduler
    progress: bool = False


@torch.no_grad()
def solve_block(block: torch.nn.Module, block_name: str, desc: str, stage: Stage, setup: SolveSetup) -> Solved:
    """Quantize ``stage``'s linears of ``block`` (the module named ``block_name``; ``desc`` in logs),
    each on its exact source weight (fp32 when calibrated, even where the forwards run in a
    narrower dtype), then its experts (:func:`expert_jobs`), and put the dequantized weights into
    the block, so that its outputs are the quantized block's → the tensors and records, in order.
    Each Hessian is released once the last linear sharing it is solved."""
    within = partial(_within, block_name)
    hessians = stage.hessians
    jobs = [Job(setup.names.module(name), solve_cost(*m.weight.shape), partial(_linear_job, name, stage, setup),
                partial(hessians.done, name) if hessians is not None else None)
            for name, m in stage.linears.items()]
    rounds = [expert_jobs(block.get_submodule(within(module)), module, parts,
                          hessians.moe[within(module)] if hessians is not None else None, stage.quantize, setup)
              for module, parts in stage.experts.items()]
    out = Solved()
    for solved in bar(setup.scheduler.solve(jobs, rounds, desc), f"{desc}: quantizing", setup.progress, unit="layer",
                      total=len(jobs) + sum(r.count for r in rounds)):
        _take(solved, out, block, within, setup.device)
        del solved   # before the next solve: where the block's dtype is fp32, its weight is the solution itself
    return out


def _take(solved: Solved, out: Solved, block: torch.nn.Module, within: Callable[[str], str], device) -> None:
    """One job's dequantized weights into ``block``, its tensors and records into ``out``."""
    for where, q in solved.weights:
        if q is not None:
            _put(block, within, where, q.to(device))
    out.tensors.update(solved.tensors)
    out.records += solved.records


def _linear_job(name: str, stage: Stage, setup: SolveSetup) -> Solved:
    hessian = stage.hessians.of[name] if stage.hessians is not None else None
    W = _exact(setup.weight(name), setup.device, stage.hessians is not None)
    res, t, record = stage.quantize(setup.names.module(name), W, hessian)
    # returning drops the fp32 weight and solution: held through the next solve, up_proj's
    # would live through down_proj's
    return Solved([(name, _written_back(res, setup))], t, [record])


def expert_jobs(experts: torch.nn.Module, module: str, parts: dict[str, hf_model.ExpertLinear],
                inputs: MoeInputs | None, quantize: Callable, setup: SolveSetup) -> RoundJobs:
    """The experts of the experts module ``experts`` (named ``module``), one job each: expert e's
    Hessians (:meth:`~.moe.MoeInputs.expert_hessians`, from its routed ``inputs``; None:
    uncalibrated), then each of its linears ``parts`` (checkpoint name → slice of a fused
    parameter) solved on its exact source weight."""
    if inputs is not None:
        _log_routing(module, inputs, setup)
    order = sorted(parts.items(), key=lambda kv: (kv[1].expert, _role(kv[1]), kv[1].rows.start))
    cost = _expert_cost(experts, parts)

    def prepare(e: int):
        return None if inputs is None else inputs.expert_hessians(e, setup.moe_min_tokens, setup.moe_route_all)

    def job(e: int, hs) -> Job:
        linears = [(name, x) for name, x in order if x.expert == e]
        return Job(_common_prefix([name for name, _ in linears]), cost,
                   partial(_expert_job, e, linears, hs, quantize, setup))
    return RoundJobs(module, experts.gate_up_proj.shape[0], cost, prepare, job)


def _expert_job(e: int, linears: list, hs, quantize: Callable, setup: SolveSetup) -> Solved:
    out = Solved()
    for name, x in linears:
        W = _exact(setup.expert_weight(name), setup.device, hs is not None)
        extra = {"expert": e} if hs is None else {"expert": e, "expert_tokens": hs.tokens, "moe_fallback": hs.fallback}
        res, t, record = quantize(name, W, None if hs is None else (hs.inp, hs.mid)[_role(x)], extra=extra)
        out.add(x, _written_back(res, setup), t, record)
        del W, res, t
    return out


def _log_routing(module: str, inputs: MoeInputs, setup: SolveSetup) -> None:
    counts, tokens = inputs.routed_tokens(), inputs.total_tokens()
    starved = [e for e, n in enumerate(counts) if n < setup.moe_min_tokens]
    log.info("%s: %d tokens × top-%d routed, per expert %d..%d; %s", module, tokens,
             sum(counts) // max(tokens, 1), min(counts), max(counts),
             "every token through every expert (route_all)" if setup.moe_route_all else
             f"{len(starved)} experts below {setup.moe_min_tokens} tokens blended with all tokens: {starved}")


def _within(block_name: str, name: str) -> str:
    """A model name → its name in the block ``block_name``."""
    return name[len(block_name) + 1:]


def _role(x: hf_model.ExpertLinear) -> int:
    """0: an expert's gate/up projection (fed the hidden state), 1: its down projection."""
    return hf_model.EXPERT_PARAMS.index(x.param.rpartition(".")[2])


def _common_prefix(names: list[str]) -> str:
    return ".".join(os.path.commonprefix([n.split(".") for n in names]))


def _exact(W: torch.Tensor, device, calibrated: bool) -> torch.Tensor:
    """A source weight on ``device``: in fp32 for a calibrated solve (its error statistics and
    target correction compute on it), else as stored (:func:`solve` gives each solver its dtype)."""
    return W.to(device=device, dtype=torch.float32 if calibrated else W.dtype)


def _written_back(res: QuantResult, setup: SolveSetup) -> torch.Tensor | None:
    """The dequantized weight the block computes with from now on (None: no forwards follow)."""
    return res.q.to(device=setup.device, dtype=setup.dtype) if setup.write_back else None


def _expert_cost(experts: torch.nn.Module, parts: dict[str, hf_model.ExpertLinear]) -> int:
    """One expert's solve cost: its linears' (every expert of a module has the same shapes)."""
    shapes = [(len(range(*x.rows.indices(P.shape[1]))), P.shape[2])
              for x in parts.values() if x.expert == 0 for P in [experts.get_parameter(x.param.rpartition(".")[2])]]
    return sum(solve_cost(*rc) for rc in shapes)


def _put(block: torch.nn.Module, within: Callable[[str], str], where: str | hf_model.ExpertLinear,
         q: torch.Tensor) -> None:
    """A dequantized weight into ``block``: linear ``where``'s, or an expert's slice of its fused
    parameter (``within``: a model name → its name in the block)."""
    if isinstance(where, str):
        hf_model.set_tensor(block, within(f"{where}.weight"), q)
    else:
        block.get_parameter(within(where.param)).data[where.expert, where.rows] = q


def layer_stats(name, W, H, res, t, kind) -> dict:
    """Per-layer record for latq_stats.json (deterministic: no timings), computed where ``W``
    and ``H`` are (``res`` holds CPU tensors). Without a Hessian (uncalibrated methods) there
    is no output error to report: ``rel_error`` is None. ``cert``: over the rows the bound covers."""
    rel = relative_error(W, res.q, H) if H is not None else None
    cert, overloads = None, res.info.get("overloads")
    if res.bound is not None:
        err = res.error(W, H)
        ratio = err / res.bound.to(err.device).clamp_min(1e-300)
        if overloads is not None:
            ratio = ratio[(overloads == 0).to(ratio.device)]
        cert = ratio.max().item() if ratio.numel() else None
    st = fmt.layer_stats(t, kind, tuple(W.shape))
    record = {"name": name, "method": res.method, "shape": list(W.shape), "bits": st["bits"],
              "solver_bits": float(res.bits_per_weight), "outlier_rate": st["outlier_rate"],
              "rel_error": rel, "cert": cert,
              "damp": res.damp, "alpha": res.info.get("alpha")}
    if overloads is not None:
        record["overloads"] = int(overloads.sum())
    return record


def log_line(s: dict) -> str:
    cert = f"{s['cert']:.3f}" if s["cert"] is not None else "—"
    rel = f"{s['rel_error']:.3e}" if s["rel_error"] is not None else "—"
    routed = "" if s.get("expert_tokens") is None else f", {s['expert_tokens']} routed tokens" + (
        f" ({s['moe_fallback']})" if s["moe_fallback"] else "")
    over = "" if s.get("overloads") is None else f", {s['overloads']} overloaded blocks"
    return (f"{s['name']}: {s['method']} {s['bits']:.3f} bits/w, outliers {100 * s['outlier_rate']:.3f}%, "
            f"rel.err {rel}, cert {cert}{over}{routed}")
