"""The peer and control solvers the study sets against our GPTQ: the IST-DASLab reference column
loop, our GPTQ in fp64, with the damping moved, or given another implementation's scales (each a
``solve=`` for the pipeline), and llm-compressor's GPTQ run in its own environment."""
from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path

import torch

from bench import peer_llmcompressor
from vllm_latq.testing.gptq_loop import reference_gptq   # the readable reference loop lives with the tests
from vllm_latq import data

log = logging.getLogger("latq.study")

PEER_SCRIPT = Path(peer_llmcompressor.__file__).resolve()


# ============================================================================ our pipeline, another solver

def gptq_replaced(tag: str, solve):
    """A ``solve=`` for ``quantize_model``: the pipeline's per-layer solver with its GPTQ replaced
    by ``solve``, called as ``solve(ours, method, W, H, name, **kw)`` (``ours``: the pipeline's
    own). Every replacement is of GPTQ: another method is refused by name."""
    from vllm_latq.quantize.pipeline import solve as ours

    def replaced(method, W, H, name, **kw):
        if method != "gptq":
            raise ValueError(f"the {tag} solver replaces GPTQ only, not {method} ({name})")
        return solve(ours, method, W, H, name, **kw)
    return replaced


def peer_solve(ours, method, W, H, name, **kw):
    """The pipeline's GPTQ with every integer chosen by :func:`reference_gptq` instead (same
    scales, order and damping as ours: equal settings), for a whole-model peer perplexity."""
    from vllm_latq.algorithms.scales import expand
    res = ours(method, W, H, name, **kw)
    S = expand(res.scales, res.group_size, tuple(W.shape)).float()
    z = reference_gptq(W.cpu().float(), H.cpu(), S, res.order, res.bits, res.damp)
    res.z, res.q = z.to(res.z.dtype), (z.float() * S).to(res.q.dtype)
    return res


def fp64_solve(ours, method, W, H, name, **kw):
    """The control for the peer comparison: our GPTQ as usual, but computed in fp64 (the same
    scales, order, damping and algorithm; only the rounding of intermediate floats differs),
    so a few integers change — how far perplexity moves from that alone."""
    res32 = ours(method, W, H, name, **kw)
    return ours(method, W.double(), H.double(), name, scales=res32.scales, **kw)


def damped_solve(factor: float):
    """A control: our GPTQ with the damping scaled by ``factor`` (1 ± 10⁻⁴ is no change of any
    meaning — the damping is a heuristic 1 % — but it flips a few integers in some layers)."""
    def solve(ours, method, W, H, name, **kw):
        return ours(method, W, H, name, **{**kw, "damp": kw["damp"] * factor})
    return solve


def given_scales_solve(scales: dict):
    """Our GPTQ with each layer's scales given (``{layer name: [out, ngroups]}``, rounded to the
    fp16 our checkpoints store: llm-compressor's bf16 scales are exact there), the rest ours."""
    from vllm_latq.algorithms.scales import to_fp16_grid

    def solve(ours, method, W, H, name, **kw):
        if name not in scales:
            raise KeyError(f"no given scales for layer {name} (have {len(scales)} layers, e.g. {next(iter(scales))})")
        S = scales[name]
        want = (W.shape[0], -(-W.shape[1] // kw["group_size"]))
        if tuple(S.shape) != want:
            raise ValueError(f"{name}: given scales are {tuple(S.shape)}, group size {kw['group_size']} needs {want}")
        return ours(method, W, H, name, **{**kw, "scales": to_fp16_grid(S.float(), f"{name} scale")})
    return solve


# configuration tag → the solve that replaces the pipeline's GPTQ for it
SOLVERS = {"peer": peer_solve, "fp64": fp64_solve, "damp-up": damped_solve(1 + 1e-4),
           "damp-down": damped_solve(1 - 1e-4), "damp-up2": damped_solve(1 + 1e-3),
           "damp-down2": damped_solve(1 - 1e-3)}


def solve_for(cfg, src: Path):
    """The ``solve=`` that quantizes configuration ``cfg`` of the model in ``src``, or None for
    the pipeline's own (llm-compressor's scales are computed here, in its environment)."""
    if cfg.tag == "llmc-scales":
        kw = cfg.kwargs
        return gptq_replaced(cfg.tag, given_scales_solve(llmc_scales(src, kw["bits"], kw["group_size"])))
    return gptq_replaced(cfg.tag, SOLVERS[cfg.tag]) if cfg.tag in SOLVERS else None


def peer_compare(W, H, bits: int, group_size: int) -> dict:
    """Our GPTQ vs :func:`reference_gptq` on one layer at equal settings → identical-integer
    fraction and error ratio (ours / reference)."""
    from vllm_latq.algorithms import gptq
    from vllm_latq.algorithms.lattice import layer_error
    from vllm_latq.algorithms.scales import expand
    ours = gptq(W, H, bits=bits, group_size=group_size, order="act")
    S = expand(ours.scales, ours.group_size, tuple(W.shape)).float()
    z_ref = reference_gptq(W, H, S, ours.order, bits, ours.damp)
    e_ours = layer_error(W, ours.q, H, ours.damp).sum().item()
    e_ref = layer_error(W, z_ref.float() * S, H, ours.damp).sum().item()
    return {"same_int": float((z_ref == ours.z).float().mean()), "err_ratio": e_ours / e_ref}


# ============================================================================ llm-compressor

def run_peer(args: list, what: str) -> None:
    """Run bench/peer_llmcompressor.py with ``args`` in llm-compressor's environment (built on first
    use); a failure raises naming ``what`` with the command's last lines."""
    # -P: the script's folder (bench/, whose kernels.py transformers would take for the `kernels`
    # package) stays off the peer environment's import path
    cmd = [str(peer_llmcompressor.ensure_env(data.cache_dir(), log.info)), "-P", str(PEER_SCRIPT), *map(str, args)]
    peer_llmcompressor.run_checked(cmd, f"llm-compressor on {what}")


def llmc_scales(src: Path, bits: int, group_size: int) -> dict:
    """``{linear name: scale}`` as llm-compressor's GPTQ chooses them for the model in ``src``."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "scales.pt"
        run_peer(["scales", src, bits, group_size, out], f"the scales of {src.name}")
        return torch.load(out)


def quantize_llmc(cfg, st, src: Path, ck: Path, progress: bool = True) -> tuple[list[dict], float]:
    """llm-compressor's GPTQ of ``cfg`` into ``ck`` (a plain HF directory of its dequantized
    weights), in its own environment, on the calibration sequences our pipeline uses (settings
    ``st``) → ([], seconds): clipped GPTQ has no certificate."""
    from transformers import AutoTokenizer
    kw = cfg.kwargs
    calib = ck.with_name(cfg.slug + ".calib.pt")
    calib.parent.mkdir(parents=True, exist_ok=True)
    torch.save(data.calibration_batches(AutoTokenizer.from_pretrained(src), nsamples=st.nsamples, seqlen=st.seqlen),
               calib)
    t0 = time.time()
    try:
        run_peer([src, calib, ck, "--bits", kw["bits"], "--group-size", kw["group_size"]], f"{cfg.model} {cfg.label}")
    finally:
        calib.unlink()
    return [], round(time.time() - t0, 1)


def llmc_compare(layers: dict, bits: int, group_size: int) -> dict:
    """llm-compressor's GPTQ on the same layers as ours, in its environment (one call for all):
    its solver given our scales (identical-integer fraction, error ratio) and its whole layer path
    (its observer's scales, bf16 weights: error ratio, median scale ratio) → {key: {...}}."""
    from vllm_latq.algorithms import gptq
    from vllm_latq.algorithms.lattice import layer_error
    from vllm_latq.algorithms.scales import expand
    ours = {k: gptq(W, H, bits=bits, group_size=group_size, order="act") for k, (W, H) in layers.items()}
    with tempfile.TemporaryDirectory() as d:
        inp, out = Path(d) / "layers.pt", Path(d) / "llmc.pt"
        torch.save({"bits": bits, "group_size": group_size,
                    "layers": {k: {"W": W.float(), "H": H.float(), "S": ours[k].scales.float(), "damp": ours[k].damp}
                               for k, (W, H) in layers.items()}}, inp)
        run_peer(["layers", inp, out], f"the layer comparison ({bits} bits)")
        theirs = torch.load(out)
    r = {}
    for k, (W, H) in layers.items():
        o, t = ours[k], theirs[k]
        S = expand(o.scales, o.group_size, tuple(W.shape)).float()
        e = layer_error(W, o.q, H, o.damp).sum().item()
        r[k] = {"same_int": float((torch.round(t["q_given"] / S) == o.z).float().mean()),
                "err_ratio": layer_error(W, t["q_given"], H, o.damp).sum().item() / e,
                "err_ratio_own": layer_error(W, t["q_own"], H, o.damp).sum().item() / e,
                "scale_ratio": float((t["scales_own"] / o.scales.float()).median()),
                "rtn_fallback": t["rtn_fallback"]}
    return r
