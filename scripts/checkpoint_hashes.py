"""The sha256 of every file of checkpoints of tiny random models, over the methods and options
a change to the pipeline or the solvers could touch: run it on two trees and compare the JSON
to show that a change keeps the checkpoints byte-identical.

    PYTHONPATH=/path/to/main   python scripts/checkpoint_hashes.py before.json
    PYTHONPATH=/path/to/branch python scripts/checkpoint_hashes.py after.json
    cmp before.json after.json

The wide Llama (intermediate 600) takes GPTQ's triangular inverse past its 256-column leaf.
One torch thread: BLAS reductions, hence checkpoints, depend on the thread count.
"""
from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

import torch


RUNS = {  # name: (model, options)
    "ssqr": ("llama", dict(method="ssqr")), "hptq": ("llama", dict(method="hptq")),
    "gptq": ("llama", dict(method="gptq")), "rtn": ("llama", dict(method="rtn")),
    "ssqr-target-correction": ("llama", dict(method="ssqr", target_correction=True)),
    "ssqr-column-scales": ("llama", dict(method="ssqr", column_scales="norm")),
    "ssqr-head": ("llama", dict(method="ssqr", quantize_lm_head=True)),
    "ssqr-wide": ("wide", dict(method="ssqr")), "hptq-wide": ("wide", dict(method="hptq")),
    "moe-ssqr-blend": ("moe", dict(method="ssqr", moe_min_tokens=48)),
    "moe-ssqr-route-all": ("moe", dict(method="ssqr", moe_route_all=True)), "moe-hptq": ("moe", dict(method="hptq")),
}


def main(out: str) -> None:
    from vllm_latq.testing.tiny_models import TINY_OPTS, make_tiny_model
    import vllm_latq
    from vllm_latq.quantize.pipeline import QuantizeOptions, quantize_model

    torch.set_num_threads(1)
    print(f"vllm_latq from {Path(vllm_latq.__file__).parent}", file=sys.stderr)
    hashes = {}
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        models = {"llama": make_tiny_model(t / "llama", "llama"),
                  "wide": make_tiny_model(t / "wide", "llama", hidden_size=320, intermediate_size=600),
                  "moe": make_tiny_model(t / "moe", "qwen3_moe", layers=1)}
        for name, (model, opts) in RUNS.items():
            d = quantize_model(models[model], t / name, QuantizeOptions(**TINY_OPTS, **opts), progress=False)
            hashes[name] = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}
            print(name, file=sys.stderr)
    Path(out).write_text(json.dumps(hashes, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
