"""Solving one linear: the method's solver on its weight and Hessian, the result encoded
into the layer's checkpoint tensors, and its record for ``latq_stats.json`` and the log.

``solve(method, W, H, name, **kw) -> QuantResult`` is the pipeline's per-layer solver call;
:func:`~.pipeline.quantize_model` takes another through its ``solve=`` argument (the study
wraps it to swap GPTQ implementations).
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from .. import hf_model
from .. import format as fmt
from .calibrate import SharedHessians
from .hessian import Hessian
from .hptq import hptq, hrtn
from .lattice import layer_error
from .result import QuantResult
from .solvers import babai, gptq, rtn
from .source import Source
from .ssqr import ssqr

log = logging.getLogger("vllm_latq.quantize")

Solve = Callable[..., QuantResult]   # solve(method, W, H, name, **kw) -> QuantResult
SOLVERS = {"ssqr": ssqr, "hptq": hptq, "gptq": gptq, "rtn": rtn, "hrtn": hrtn, "babai": babai}


def solve(method: str, W: torch.Tensor, H: torch.Tensor, name: str, **kw) -> QuantResult:
    """Run one solver (a name from ``format.METHODS``) → QuantResult with CPU tensors."""
    res = SOLVERS[method](W, H, name=name, **kw)
    for f in ("z", "q", "scales", "order", "bound"):
        v = getattr(res, f)
        if isinstance(v, torch.Tensor):
            setattr(res, f, v.cpu())
    if res.outliers is not None:
        o = res.outliers
        o.crow, o.col, o.val = o.crow.cpu(), o.col.cpu(), o.val.cpu()
    return res


def quantize_linear(name: str, W: torch.Tensor, hessian: Hessian | None, *, method: str, solver_kwargs: dict,
                    solve: Solve, stats: list, on_layer: Callable | None) -> tuple[QuantResult, dict]:
    """Solve linear ``name`` (weight ``W``, its accumulated ``hessian``, None for uncalibrated
    methods), append its stats record to ``stats`` and log it, call ``on_layer(name, W, H,
    result)`` → (result, its checkpoint tensors named ``<name>.<suffix>``)."""
    H = hessian.H if hessian is not None else None
    res = solve(method, W, H, name, **solver_kwargs)
    kind = fmt.kind_of(method)
    t = fmt.encode_layer(res, kind)
    s = layer_stats(name, W, H, res, t, kind)
    s["hessian_tokens"] = hessian.n if hessian is not None else 0
    stats.append(s)
    log.info(log_line(s))
    if on_layer is not None:
        on_layer(name, W, H, res)
    return res, {f"{name}.{sfx}": v for sfx, v in t.items()}


@torch.no_grad()
def solve_block(src: Source, i: int, linears: dict, hessians: SharedHessians | None, quantize: Callable, device,
                progress: bool) -> dict[str, torch.Tensor]:
    """Quantize the ``linears`` of block ``i`` with ``quantize(name, W, hessian)``, each on its
    exact source weight (fp32, even when the forwards run in a narrower dtype), and put the
    dequantized weights into the block, so its outputs are the quantized block's → the
    block's quantized tensors."""
    from tqdm.auto import tqdm
    shard: dict[str, torch.Tensor] = {}
    for name in tqdm(linears, desc=f"block {i}: quantizing", unit="layer", disable=not progress, leave=False):
        W = src.weights.get(f"{name}.weight").to(device=device, dtype=torch.float32)
        res, t = quantize(name, W, hessians.of[name] if hessians is not None else None)
        shard.update(t)
        hf_model.set_tensor(src.net, f"{name}.weight", res.q.to(device=device, dtype=src.dtype))
    return shard


def layer_stats(name, W, H, res, t, kind) -> dict:
    """Per-layer record for latq_stats.json (deterministic: no timings), computed where ``W``
    and ``H`` are (``res`` holds CPU tensors). Without a Hessian (uncalibrated methods) there
    is no output error to report: ``rel_error`` is None."""
    rel = None
    if H is not None:
        num = layer_error(W, res.q.to(W.device), H).sum().item()
        den = layer_error(W, torch.zeros_like(W), H).sum().item()
        rel = num / den if den > 0 else 0.0
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
    return (f"{s['name']}: {s['method']} {s['bits']:.3f} bits/w, outliers {100 * s['outlier_rate']:.3f}%, "
            f"rel.err {rel}, cert {cert}")
