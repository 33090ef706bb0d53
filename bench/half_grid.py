"""Whole-model perplexity of the half-integer grid ``s·(z + ½)``, a lever the
format does not store: the pipeline runs as the study runs it (same calibration, same forwards),
every solver gets ``offset``, and its dequantized weights ``q`` (inliers on the shifted grid,
outliers exact) are written into the model that is then evaluated by the study's protocol
(``latq-eval``'s windows). The checkpoint the run writes lacks the offset and is discarded:
``--offset 0`` is the control, the perplexity of that checkpoint (``tests/bench/test_bench_half_grid.py``).

    python -m bench.half_grid smollm2-135m --method ssqr --bits 2 --offset 0.5
    python -m bench.half_grid gemma3-270m --method gptq --bits 2 --offset 0 0.5

The last line is ``HEADLINE key=value ...`` (one ``ppl_offset<o>`` per offset).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch



def quantized_weights(model: str, opts, offset: float, results: dict | None = None) -> dict[str, torch.Tensor]:
    """{linear's module name: its dequantized weight} of a pipeline run whose solvers put the
    inliers on ``s·(z + offset)``; ``results`` (if given) receives each solver's result."""
    from vllm_latq.quantize.pipeline import quantize_model
    from vllm_latq.quantize.solve_layers import solve as default_solve

    weights = {}

    def solve(method, W, H, name, **kw):
        res = default_solve(method, W, H, name, offset=offset, **kw)
        weights[name] = res.q.clone()
        if results is not None:
            results[name] = res
        return res

    with tempfile.TemporaryDirectory() as tmp:
        quantize_model(model, Path(tmp) / "ck", opts, solve=solve, validate=False)
    return weights


def perplexity(model: str, weights: dict[str, torch.Tensor], seqlen: int, nwindows: int) -> dict:
    """The study's perplexity (fp32 compute, the eval windows) of ``model`` with ``weights`` in place."""
    from vllm_latq import data
    from vllm_latq.commands.evaluate import load_for_eval

    m, tok, _ = load_for_eval(model)
    for name, q in weights.items():
        lin = m.get_submodule(name)
        if lin.weight.shape != q.shape:
            raise ValueError(f"{name}: solver weight {tuple(q.shape)} vs model {tuple(lin.weight.shape)}")
        lin.weight.data.copy_(q)
    windows = data.eval_windows(tok, seqlen=seqlen, nwindows=nwindows, docs=data.read_documents("wiki", "eval"))
    return data.perplexity(m, windows, progress=False)


def main(argv=None) -> int:
    from vllm_latq.quantize.pipeline import QuantizeOptions

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--method", choices=("gptq", "ssqr"), default="ssqr")
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--outlier-rate", type=float, default=0.01)
    ap.add_argument("--offset", type=float, nargs="+", default=[0.5])
    ap.add_argument("--nsamples", type=int, default=128, help="calibration sequences (the study's 128)")
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--eval-seqlen", type=int, default=512)
    ap.add_argument("--nwindows", type=int, default=64)
    a = ap.parse_args(argv)
    kw = {"outlier_rate": a.outlier_rate} if a.method == "ssqr" else {}
    opts = QuantizeOptions(method=a.method, bits=a.bits, group_size=a.group_size, nsamples=a.nsamples,
                           seqlen=a.seqlen, quantize_lm_head=False, **kw)   # the lever is the blocks
    head = {"model": a.model, "method": a.method, "bits": a.bits, "group_size": a.group_size}
    for off in a.offset:
        t0 = time.time()
        r = perplexity(a.model, quantized_weights(a.model, opts, off), a.eval_seqlen, a.nwindows)
        print(json.dumps({**head, "offset": off, "ppl": r["ppl"], "windows": r["windows"],
                          "seconds": round(time.time() - t0, 1)}), flush=True)
        head[f"ppl_offset{off:g}"] = round(r["ppl"], 3)
    print("HEADLINE " + " ".join(f"{k}={v}" for k, v in head.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
