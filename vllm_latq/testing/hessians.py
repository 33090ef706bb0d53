"""Real SmolLM2-135M layers with Hessians of real calibration text (cached), for solver tests and benches."""
from __future__ import annotations

import torch

REAL_NSEQ, REAL_SEQLEN = 8, 512


REAL_LAYERS = ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj",
               "model.layers.1.self_attn.o_proj", "model.layers.1.mlp.up_proj")


def real_layer_hessians() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """name → (W fp32, H fp64) for ``REAL_LAYERS`` of SmolLM2-135M on Wikipedia calibration text (cached)."""
    from filelock import FileLock
    from safetensors.torch import load_file

    from vllm_latq import data
    from vllm_latq.bounded_io import file_sha256

    mdir = data.model_dir("smollm2-135m")   # named by its GGUF's sha256; the text by its own: a key by content
    text = file_sha256(data.text_file("wiki"))[:12]
    path = data.cache_dir() / f"test_hessians_{mdir.name}_{text}_{REAL_NSEQ}x{REAL_SEQLEN}.safetensors"
    with FileLock(str(path) + ".lock"):   # parallel test workers: one computes, the others wait for it
        if not path.exists():
            _compute(mdir, path)
    t = load_file(str(path))
    return {n: (t[n + ".W"], t[n + ".H"]) for n in REAL_LAYERS}


def _compute(mdir, path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_latq import data
    from vllm_latq.quantize.hessian import linear_hessians
    tok = AutoTokenizer.from_pretrained(mdir)
    model = AutoModelForCausalLM.from_pretrained(mdir, dtype=torch.float32).eval()
    mods = {n: m for n, m in model.named_modules() if n in REAL_LAYERS}
    layers = linear_hessians(model, mods, data.calibration_batches(tok, nsamples=REAL_NSEQ, seqlen=REAL_SEQLEN))
    tensors = {}
    for n in REAL_LAYERS:
        W, H = layers[n]
        tensors[n + ".W"], tensors[n + ".H"] = W.contiguous(), H.contiguous()
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp))
    tmp.replace(path)
