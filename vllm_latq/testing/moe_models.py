"""Tiny mixture-of-experts checkpoints for the MoE tests and benches: a random HF MoE, a latq
checkpoint of it as the quantizer writes it, and its dequantized weights as the reference."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from vllm_latq import format as fmt
from vllm_latq.testing.checkpoints import write_checkpoint

ARCHS = {   # model type → (config entries, expert projections, router module)
    "qwen3_moe": (dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, head_dim=32,
                       norm_topk_prob=True), ("gate_proj", "up_proj", "down_proj"), "mlp.gate"),
    "mixtral": (dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64),
                ("w1", "w3", "w2"), "block_sparse_moe.gate"),
    "olmoe": (dict(num_experts=4, num_experts_per_tok=2, intermediate_size=64), ("gate_proj", "up_proj", "down_proj"),
              "mlp.gate"),
    # a shared expert (a plain MLP, quantized) beside the routed ones, scaled by its own sigmoid gate (kept)
    "qwen2_moe": (dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                       shared_expert_intermediate_size=64, norm_topk_prob=False), ("gate_proj", "up_proj", "down_proj"),
                  "mlp.gate"),
}
DENSE = ("q_proj", "k_proj", "v_proj", "o_proj")


def make_moe_model(out: Path, arch: str, *, layers: int = 2, hidden: int = 64, seed: int = 0, **config) -> Path:
    """A tiny random-weight MoE of model type ``arch`` (fp32); ``config`` overrides entries of ``ARCHS``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from vllm_latq import data
    tok = AutoTokenizer.from_pretrained(data.model_dir("smollm2-135m"))
    extra = {**ARCHS[arch][0], **config}
    cfg = AutoConfig.for_model(arch, vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers,
                               num_attention_heads=hidden // 32, num_key_value_heads=1, max_position_embeddings=512,
                               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                               tie_word_embeddings=False, **extra)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                continue   # norms keep 1
            std = 0.5 if cfg.vocab_size in p.shape else 2.0 / p.shape[-1] ** 0.5
            if name.endswith(".mlp.gate.weight"):   # the router (transformers' names, all three types)
                std *= 4   # decisive routing, as trained routers have: fewer near-ties for bf16 to flip
            p.copy_(torch.randn(p.shape, generator=g) * std)
    model.save_pretrained(out)   # per-expert tensors on disk (transformers splits its fused 3-D experts)
    tok.save_pretrained(out)
    return out


def ssqr_like(W: torch.Tensor, bits: int, group: int, seed: int):
    """RTN integers with ~0.5 % forced outliers (exact weights, fp16) as a dense-kind result."""
    import dataclasses

    from vllm_latq.algorithms import rtn
    from vllm_latq.algorithms.result import CSR
    res = rtn(W, bits=bits, group_size=group)
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(W.numel(), dtype=torch.bool)
    mask[torch.randperm(W.numel(), generator=g)[:max(2, W.numel() // 200)]] = True
    mask = mask.view(W.shape)
    return dataclasses.replace(res, z=torch.where(mask, 0, res.z), outliers=CSR.from_mask(mask, W.half()))


def make_moe_checkpoint(src: Path, out: Path, method: str, *, bits: int = 4, group: int = 32,
                        target_bits: float = 3.25) -> tuple[Path, Path]:
    """(latq checkpoint, HF dir of its dequantized weights) of the tiny MoE ``src``, by ``method``'s kind."""
    from safetensors.torch import load_file, save_file

    from vllm_latq.algorithms import hrtn, rtn
    cfg = json.loads((src / "config.json").read_text())
    _, projections, router = ARCHS[cfg["model_type"]]
    kind = fmt.kind_of(method)
    sd = load_file(src / "model.safetensors")
    tensors, deq, routers, shapes = {}, {}, [], {}
    for i, (name, t) in enumerate(sorted(sd.items())):
        module = name.removesuffix(".weight")
        if module.endswith("." + router):
            routers.append(module)
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in (*projections, *DENSE):
            res = (hrtn(t, target_bits=target_bits) if kind == "huffman" else
                   rtn(t, bits=bits, group_size=group) if method == "rtn" else ssqr_like(t, bits, group, i))
            layer = fmt.encode_layer(res, kind)
            tensors.update({f"{module}.{k}": v.contiguous() for k, v in layer.items()})
            deq[name] = fmt.dequantize_layer(layer, kind, tuple(t.shape), bits, group)
            shapes[module] = tuple(t.shape)
        else:
            tensors[name] = deq[name] = t
    qc = fmt.quantization_config(method, bits=bits if kind == "dense" else None,
                                 group_size=group if kind == "dense" else None,
                                 outlier_rate=0.01 if method == "ssqr" else None,
                                 target_bits=target_bits if kind == "huffman" else None,
                                 order="natural", damp=0.01, modules_not_converted=sorted(routers))
    deq_dir = out.with_name(out.name + "-deq")
    for d in (out, deq_dir):   # the tokenizer files first: the checkpoint's seal covers them
        d.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
                shutil.copy(f, d / f.name)
    write_checkpoint(out, tensors, {**cfg, "quantization_config": qc}, shapes, source=src.name)
    save_file(deq, str(deq_dir / "model.safetensors"), metadata={"format": "pt"})
    (deq_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return out, deq_dir


def moe_reference(x, topk_weights, topk_ids, experts, activation="silu", on_input=False) -> torch.Tensor:
    """The MoE forward token by token, slot by slot, in fp32 (the definition); ``experts``: each expert's
    full-precision (w13, w2); expert −1 skipped."""
    act = {"silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu}[activation]
    out = torch.zeros(x.shape[0], experts[0][1].shape[0])
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            if e < 0:
                continue
            p = float(topk_weights[t, k])
            xt = x[t].float() * (p if on_input else 1.0)
            g, u = (experts[e][0] @ xt).chunk(2)
            out[t] += (1.0 if on_input else p) * (experts[e][1] @ (act(g) * u))
    return out


def hf_reference(deq_dir: Path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(deq_dir, dtype=torch.float32).eval()
