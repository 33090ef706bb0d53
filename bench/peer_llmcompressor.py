"""llm-compressor's GPTQ, the accuracy study's peer implementation, in an environment of its own.

llmcompressor pins an older transformers than this project runs, so the two cannot share a
virtual environment. :func:`ensure_env` (called by ``bench/accuracy.py`` from the project's
environment) builds ``$LATQ_CACHE/peer-llmcompressor`` once, with pinned versions and the same
torch; the study then runs this file with that environment's interpreter:

    PEER_PYTHON bench/peer_llmcompressor.py SRC CALIB.pt OUT --bits 3 --group-size 128
    PEER_PYTHON bench/peer_llmcompressor.py layers IN.pt OUT.pt          # see compare_layers
    PEER_PYTHON bench/peer_llmcompressor.py scales SRC BITS GROUP OUT.pt # see model_scales

SRC is the bf16 Hugging Face directory our pipeline quantizes, CALIB.pt the calibration token
ids our pipeline uses (both see the same sequences), the settings ours (:func:`_weight_args`).
OUT is a Hugging Face directory whose linears hold llm-compressor's dequantized weights exactly
as its checkpoints deploy them (``bf16(z·s)``, stored in fp32), evaluated by the study through
the same protocol as ours; ``OUT/peer.json`` records versions, settings, seconds, the bits per
weight and a check that every weight is an integer of the grid times its group's scale.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

# the environment: llmcompressor with the transformers it accepts, and the project's torch (a CPU
# build on this machine; a bare `torch` requirement would pull a multi-GB CUDA build)
PEER_PACKAGES = ("torch==2.13.0", "llmcompressor==0.14.0.1", "compressed-tensors==0.19.0", "transformers==5.17.0")
ENV_NAME = "peer-llmcompressor"


def env_dir(cache: Path) -> Path:
    return cache / ENV_NAME


def ensure_env(cache: Path, log=print) -> Path:
    """The peer environment's python, building the environment first if it is missing or was
    built for other packages. Raises RuntimeError naming the failed command and its output."""
    d = env_dir(cache)
    py = d / "bin" / "python"
    stamp = d / "latq-packages.txt"
    want = "\n".join(PEER_PACKAGES) + "\n"
    if py.is_file() and stamp.is_file() and stamp.read_text() == want:
        return py
    log(f"building llm-compressor's environment in {d} ({', '.join(PEER_PACKAGES)}); once, about a minute")
    shutil.rmtree(d, ignore_errors=True)
    base = getattr(sys, "_base_executable", None) or sys.executable
    for cmd in ([base, "-m", "venv", str(d)],
                [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", *PEER_PACKAGES]):
        run_checked(cmd, "building llm-compressor's environment", lines=15)
    stamp.write_text(want)
    return py


def run_checked(cmd: list[str], what: str, lines: int = 20) -> None:
    """Run ``cmd``; a failure raises RuntimeError naming ``what``, the command and its last ``lines``
    lines of output."""
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        tail = "\n".join((p.stdout + p.stderr).strip().splitlines()[-lines:])
        raise RuntimeError(f"{what} failed (exit {p.returncode}): `{' '.join(cmd)}`; its last lines:\n{tail}")


def bits_per_weight(shapes, bits: int, group_size: int) -> float:
    """Stored bits per weight of llm-compressor's symmetric group format: the integers plus one
    bf16 scale per row and group (no zero points; static act-order needs no group index)."""
    total = sum(o * i for o, i in shapes)
    scales = sum(o * -(-i // group_size) for o, i in shapes)
    return (bits * total + 16 * scales) / total


def _weight_args(bits: int, group_size: int):
    """llm-compressor's quantization arguments at our settings: symmetric signed ``bits``-bit
    integers, one scale per output row and group of ``group_size`` input columns chosen by
    minimising the rounding error (llm-compressor's ``mse`` observer), static act-order (scales
    fixed per natural group before the sweep); the run around them keeps our damping (0.01 of
    mean diag H), lazy batches of 128 columns, the sequential pipeline with error propagation
    (the next block's inputs from the quantized block) and the output head untouched."""
    from compressed_tensors.quantization import QuantizationArgs
    return QuantizationArgs(num_bits=bits, type="int", symmetric=True, strategy="group", group_size=group_size,
                            observer="mse", actorder="static")


def _its_qparams(W, args) -> dict:
    """The scale and zero point llm-compressor's pipeline chooses for weight ``W`` (its ``mse`` observer)."""
    from llmcompressor.observers import Observer
    obs = Observer.load_from_registry("memoryless_mse", base_name="weight", args=args.model_copy(deep=True))
    return obs(W).get_qparams()


def quantize(src: Path, calib: Path, out: Path, bits: int, group_size: int, damp: float = 0.01) -> dict:
    import torch
    from compressed_tensors.quantization import QuantizationScheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    ids = torch.load(calib)
    if ids.ndim != 2:
        raise ValueError(f"{calib}: calibration ids must be [n, seqlen], got {tuple(ids.shape)}")
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    scheme = QuantizationScheme(targets=["Linear"], weights=_weight_args(bits, group_size))
    recipe = GPTQModifier(config_groups={"group_0": scheme}, ignore=["lm_head"], block_size=128,
                          dampening_frac=damp)
    # llm-compressor quantizes a layer whose damped Hessian fails Cholesky by RTN, with a warning:
    # record which, as that is a difference from ours (which raises the damping instead)
    fallback = []
    summary = GPTQModifier._log_rtn_fallback_summary

    def record(self):
        fallback.extend(self._rtn_fallback_module_names)
        return summary(self)
    GPTQModifier._log_rtn_fallback_summary = record
    t0 = time.time()
    try:
        oneshot(model=model, dataset=ds, recipe=recipe, max_seq_length=ids.shape[1],
                num_calibration_samples=len(ids), shuffle_calibration_samples=False, pipeline="sequential")
    finally:
        GPTQModifier._log_rtn_fallback_summary = summary
    seconds = time.time() - t0

    # the quantized linears' weights, each checked to be an integer of the grid times its scale
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    quantized, worst, outside = {}, 0.0, 0
    for name, m in model.named_modules():
        if not hasattr(m, "weight_scale"):
            continue
        W, S = m.weight.detach().float(), m.weight_scale.detach().float()
        Sx = S.repeat_interleave(group_size, dim=1)[:, : W.shape[1]]
        z = torch.round(W / Sx)
        outside += int(((z < lo) | (z > hi)).sum())
        # bf16(z·s) is z·s up to a bf16 rounding (2⁻⁸ relative); a wrong integer is off by ≥ 1/|z| ≥ 1/4
        worst = max(worst, float(((W - z * Sx).abs() / (z * Sx).abs().clamp_min(1e-30)).max()))
        quantized[name + ".weight"] = W.contiguous()
    if not quantized:
        raise RuntimeError("llm-compressor quantized no linear layer")
    shapes = [tuple(W.shape) for W in quantized.values()]
    if outside or worst > 2 ** -7:
        raise RuntimeError(f"llm-compressor's weights are not on the {bits}-bit grid: {outside} integers outside "
                           f"[{lo}, {hi}], largest relative deviation {worst:.3g}")

    # a plain HF directory: the source's tensors, with the quantized linears' weights in fp32. Only
    # the linears come from llm-compressor: it rewrites Gemma's norms (1 + w) during calibration and
    # back, which need not return the source's bf16 values
    tensors, theirs, moved = {}, model.state_dict(), []
    for f in sorted(Path(src).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                tensors[k] = quantized.pop(k) if k in quantized else h.get_tensor(k)
                if k in theirs and not torch.equal(theirs[k].float(), tensors[k].float()):
                    moved.append(float((theirs[k].float() - tensors[k].float()).abs().max()))
    if quantized:
        raise RuntimeError(f"llm-compressor quantized linears the source does not have: {sorted(quantized)[:3]}")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in Path(src).iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy2(f, tmp / f.name)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    import compressed_tensors
    import llmcompressor
    import transformers
    info = {"implementation": "llm-compressor GPTQModifier", "llmcompressor": llmcompressor.__version__,
            "compressed_tensors": compressed_tensors.__version__, "transformers": transformers.__version__,
            "torch": torch.__version__, "bits": bits, "group_size": group_size, "damp": damp, "observer": "mse",
            "actorder": "static", "block_size": 128, "pipeline": "sequential", "calibration": list(ids.shape),
            "layers": len(shapes), "bits_per_weight": bits_per_weight(shapes, bits, group_size),
            "grid_check": {"outside": outside, "max_rel_deviation": worst}, "rtn_fallback": fallback,
            "other_tensors_it_changed": {"count": len(moved), "max_abs_change": max(moved, default=0.0)},
            "quantize_seconds": round(seconds, 1)}
    (tmp / "peer.json").write_text(json.dumps(info, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return info


def compare_layers(inp: Path, out: Path) -> None:
    """Layer mode, to tell llm-compressor's solver from its scales: ``inp`` holds ``{"bits",
    "group_size", "layers": {name: {"W", "H", "S", "damp"}}}`` (fp32 weights, Hessian, our scales
    and the damping our solver used); for each layer ``out`` gets llm-compressor's GPTQ solver (``quantize_weight``) run
    with our scales (``q_given``, fp32), and its whole layer path as in its pipeline: its observer's
    scales of the bf16 weights, the solver on bf16 weights (``q_own``, ``scales_own``)."""
    import torch
    from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight

    d = torch.load(inp)
    args = _weight_args(d["bits"], d["group_size"])
    res = {}
    for name, L in d["layers"].items():
        W, H, S = L["W"].float(), L["H"].float(), L["S"].float()
        zero = torch.zeros_like(S, dtype=torch.int8)
        q_given, _, fb1 = quantize_weight(W[None].clone(), H[None].clone(), S[None], zero[None], None, args,
                                          blocksize=128, percdamp=L["damp"])
        Wb = W.bfloat16()
        qp = _its_qparams(Wb, args)
        q_own, _, fb2 = quantize_weight(Wb[None].clone(), H[None].clone(), qp["scale"][None],
                                        qp["zero_point"][None], None, args, blocksize=128, percdamp=L["damp"])
        res[name] = {"q_given": q_given[0].float(), "q_own": q_own[0].float(), "scales_own": qp["scale"].float(),
                     "rtn_fallback": bool(fb1.any() or fb2.any())}
    torch.save(res, out)


def model_scales(src: Path, bits: int, group_size: int, out: Path) -> None:
    """Scales mode: ``out`` gets ``{linear name: scale [out, ngroups] fp32}`` for every linear but the
    output head, chosen as llm-compressor's pipeline chooses them (its observer on the bf16 weights).
    The weights never change before their layer is quantized (static act-order), so these are the
    scales of its GPTQ run; the study hands them to our GPTQ to separate scale choice from the rest."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    args = _weight_args(bits, group_size)
    res = {name: _its_qparams(m.weight.detach(), args)["scale"].float() for name, m in model.named_modules()
           if isinstance(m, torch.nn.Linear) and name.split(".")[-1] != "lm_head"}
    if not res:
        raise RuntimeError(f"{src}: no linear layer to choose scales for")
    torch.save(res, out)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["layers"]:   # PEER_PYTHON bench/peer_llmcompressor.py layers IN.pt OUT.pt
        compare_layers(Path(argv[1]), Path(argv[2]))
        return 0
    if argv[:1] == ["scales"]:   # PEER_PYTHON bench/peer_llmcompressor.py scales SRC BITS GROUP OUT.pt
        model_scales(Path(argv[1]), int(argv[2]), int(argv[3]), Path(argv[4]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("calib", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--bits", type=int, required=True)
    ap.add_argument("--group-size", type=int, required=True)
    ap.add_argument("--damp", type=float, default=0.01)
    a = ap.parse_args(argv)
    info = quantize(a.src, a.calib, a.out, a.bits, a.group_size, a.damp)
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
