"""Real weights and real-data Hessians for the theorem tests, cached under the cache dir."""
from __future__ import annotations

import torch
from safetensors.torch import load_file, save_file

NSEQ, SEQLEN = 8, 512
LAYERS = ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj",
          "model.layers.1.self_attn.o_proj", "model.layers.1.mlp.up_proj")


def real_layer_hessians() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """name → (W [out, in] fp32, H [in, in] fp64) for ``LAYERS`` of SmolLM2-135M."""
    from vllm_latq import data
    from vllm_latq.quantize.hessian import hook_linears

    path = data.cache_dir() / f"test_hessians_smollm2_{NSEQ}x{SEQLEN}.safetensors"
    if not path.exists():
        from transformers import AutoModelForCausalLM, AutoTokenizer
        mdir = data.model_dir("smollm2-135m")
        tok = AutoTokenizer.from_pretrained(mdir)
        model = AutoModelForCausalLM.from_pretrained(mdir, dtype=torch.float32).eval()
        mods = {n: m for n, m in model.named_modules() if n in LAYERS}
        hs, handles = hook_linears(mods)
        with torch.no_grad():
            for seq in data.calibration_batches(tok, nsamples=NSEQ, seqlen=SEQLEN):
                model(seq[None])
        for h in handles:
            h.remove()
        tensors = {}
        for n in LAYERS:
            tensors[n + ".W"] = mods[n].weight.detach().float().contiguous()
            tensors[n + ".H"] = hs[n].H.contiguous()
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp))
        tmp.replace(path)
    t = load_file(str(path))
    return {n: (t[n + ".W"], t[n + ".H"]) for n in LAYERS}
