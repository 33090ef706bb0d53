"""Mixture-of-experts in vLLM (issue 20): the latq experts method, its custom op and loader, and
vLLM end to end on tiny random Qwen3-MoE, Mixtral and OLMoE checkpoints.

The checkpoints are written here (:func:`make_moe_checkpoint`) in the contract the quantizer
writes: one latq layer per expert and projection under the model's per-expert names, the
router unquantized and listed in ``modules_not_converted``; the expert integers are RTN with a
few forced outliers (dense kind) or HRTN (huffman kind). The reference is transformers on the
same model with every quantized weight replaced by its dequantized value (``format``'s one
definition)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from vllm_latq import format as fmt
from vllm_latq.kernels import moe, ops
from vllm_latq.kernels.reference import dequantize, random_weight

from . import vllm_helpers as h

ARCHS = {   # model type → (config entries, expert projections, router module)
    "qwen3_moe": (dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, head_dim=32,
                       norm_topk_prob=True), ("gate_proj", "up_proj", "down_proj"), "mlp.gate"),
    "mixtral": (dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64),
                ("w1", "w3", "w2"), "block_sparse_moe.gate"),
    "olmoe": (dict(num_experts=4, num_experts_per_tok=2, intermediate_size=64), ("gate_proj", "up_proj", "down_proj"),
              "mlp.gate"),
}
DENSE = ("q_proj", "k_proj", "v_proj", "o_proj")


# ============================================================================ tiny checkpoints

def make_moe_model(out: Path, arch: str, *, layers: int = 2, seed: int = 0) -> Path:
    """A tiny random-weight MoE of model type ``arch`` (fp32, SmolLM2's tokenizer, head_dim 32
    for vLLM's CPU attention); weights scaled so that greedy output varies."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from vllm_latq import data
    tok = AutoTokenizer.from_pretrained(data.model_dir("smollm2-135m"))
    extra, _, _ = ARCHS[arch]
    cfg = AutoConfig.for_model(arch, vocab_size=len(tok), hidden_size=64, num_hidden_layers=layers,
                               num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                               tie_word_embeddings=False, **extra)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                continue   # norms keep 1
            std = 0.5 if cfg.vocab_size in p.shape else 2.0 / p.shape[-1] ** 0.5
            p.copy_(torch.randn(p.shape, generator=g) * std)
    model.save_pretrained(out)   # per-expert tensors on disk (transformers splits its fused 3-D experts)
    tok.save_pretrained(out)
    return out


def _ssqr_like(W: torch.Tensor, bits: int, group: int, seed: int):
    """RTN integers with ~0.5 % forced outliers (exact weights, fp16) as a dense-kind result."""
    import dataclasses

    from vllm_latq.quantize import rtn
    from vllm_latq.quantize.result import CSR
    res = rtn(W, bits=bits, group_size=group)
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(W.numel(), dtype=torch.bool)
    mask[torch.randperm(W.numel(), generator=g)[:max(2, W.numel() // 200)]] = True
    mask = mask.view(W.shape)
    return dataclasses.replace(res, z=torch.where(mask, 0, res.z), outliers=CSR.from_mask(mask, W.half()))


def make_moe_checkpoint(src: Path, out: Path, method: str, *, bits: int = 4, group: int = 32,
                        target_bits: float = 3.25) -> tuple[Path, Path]:
    """(latq checkpoint, HF dir of its dequantized weights) of the tiny MoE ``src``: every expert
    projection and attention linear quantized (``method``: ``ssqr`` → dense kind, ``hptq`` →
    huffman kind), routers listed in ``modules_not_converted``."""
    from safetensors.torch import load_file, save_file

    from vllm_latq.quantize import hrtn
    cfg = json.loads((src / "config.json").read_text())
    _, projections, router = ARCHS[cfg["model_type"]]
    kind = fmt.kind_of(method)
    sd = load_file(src / "model.safetensors")
    tensors, deq, routers = {}, {}, []
    for i, (name, t) in enumerate(sorted(sd.items())):
        module = name.removesuffix(".weight")
        if module.endswith("." + router):
            routers.append(module)
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in (*projections, *DENSE):
            res = _ssqr_like(t, bits, group, i) if kind == "dense" else hrtn(t, target_bits=target_bits)
            layer = fmt.encode_layer(res, kind)
            tensors.update({f"{module}.{k}": v.contiguous() for k, v in layer.items()})
            deq[name] = fmt.dequantize_layer(layer, kind, tuple(t.shape), bits, group)
        else:
            tensors[name] = deq[name] = t
    qc = fmt.quantization_config(method, bits=bits if kind == "dense" else None,
                                 group_size=group if kind == "dense" else None,
                                 outlier_rate=0.01 if method == "ssqr" else None,
                                 target_bits=target_bits if kind == "huffman" else None,
                                 order="natural", damp=0.01, modules_not_converted=sorted(routers))
    for d, sdict, extra in ((out, tensors, {"quantization_config": qc}), (out.with_name(out.name + "-deq"), deq, {})):
        d.mkdir(parents=True, exist_ok=True)
        save_file(sdict, str(d / "model.safetensors"), metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps({**cfg, **extra}, indent=2))
        for f in src.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
                shutil.copy(f, d / f.name)
    return out, out.with_name(out.name + "-deq")


def hf_reference(deq_dir: Path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(deq_dir, dtype=torch.float32).eval()


# ============================================================================ the experts' forward (no engine)

E, H, INTER, TOPK = 4, 64, 96, 2


def _experts(kernel_name: str, seed: int = 0) -> tuple[list[moe.Expert], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Random latq experts prepared by ``kernel_name`` and their fp32 dequantized weights."""
    from vllm_latq.kernels.selector import kernels
    kernel = next(k for k in kernels() if k.name == kernel_name)
    experts, dense = [], []
    for e in range(E):
        w13 = random_weight(2 * INTER, H, 4, 0.01, group=32, seed=seed + 2 * e, fp16_values=True)
        w2 = random_weight(H, INTER, 3, 0.02, group=32, seed=seed + 2 * e + 1, fp16_values=True)
        experts.append(moe.Expert((kernel, kernel.prepare(w13)), (kernel, kernel.prepare(w2))))
        dense.append((dequantize(w13), dequantize(w2)))
    return experts, dense


def _reference(x, topk_weights, topk_ids, dense, activation="silu", on_input=False):
    """The MoE forward token by token, slot by slot, in fp32 (the definition)."""
    act = {"silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu}[activation]
    out = torch.zeros(x.shape[0], H)
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            if e < 0:
                continue
            p = float(topk_weights[t, k])
            xt = x[t].float() * (p if on_input else 1.0)
            g, u = (dense[e][0] @ xt).chunk(2)
            out[t] += (1.0 if on_input else p) * (dense[e][1] @ (act(g) * u))
    return out


def _routing(T: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    logits = torch.randn(T, E, generator=g)
    w, ids = logits.softmax(-1).topk(TOPK, -1)
    return x, (w / w.sum(-1, keepdim=True)), ids.int()


@pytest.mark.parametrize("kernel,dtype,tol", [("reference", torch.float32, 1e-5), ("cpu", torch.bfloat16, 3e-2),
                                              ("bf16", torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("T", [1, 5, 33])
def test_experts_forward_equals_reference(kernel, dtype, tol, T):
    """Grouped by expert (eager and through the custom op) and all-experts-masked (the
    CUDA-graph path) equal the token-by-token definition; a −1 expert (another rank's) is
    skipped; the routing weight on the input (top-1 models) too."""
    experts, dense = _experts(kernel)
    x, w, ids = _routing(T, T)
    ids[0, 1] = -1
    want = _reference(x, w, ids, dense)
    xd = x.to(dtype)
    scale = want.abs().max()
    got = [moe.experts_forward(xd, w, ids, experts, "silu"),
           moe.experts_forward(xd, w, ids, experts, "silu", grouped=False),
           ops.moe_op()(xd, w, ids, *moe.flatten(experts), "silu", False)]
    for y in got:
        assert y.dtype == dtype and y.shape == (T, H)
        assert (y.float() - want).abs().max() <= tol * scale
    top1 = ids[:, :1].clone()
    want1 = _reference(x, w[:, :1], top1, dense, "gelu", on_input=True)
    got1 = moe.experts_forward(xd, w[:, :1].contiguous(), top1, experts, "gelu", weights_on_input=True)
    assert (got1.float() - want1).abs().max() <= tol * want1.abs().max()


def test_moe_op_opcheck_and_flatten_roundtrip():
    """The op's schema, fake and registration pass torch.library.opcheck; flatten/unflatten
    keeps every expert's kernel and state."""
    experts, _ = _experts("cpu")
    tensors, ints = moe.flatten(experts)
    back = moe.unflatten(tensors, ints)
    assert [(a.w13[0], a.w2[0]) for a in back] == [(a.w13[0], a.w2[0]) for a in experts]
    assert all(torch.equal(a.w13[1].packed, b.w13[1].packed) for a, b in zip(back, experts))
    x, w, ids = _routing(6, 1)
    torch.library.opcheck(ops.moe_op(), (x.bfloat16(), w, ids, tensors, ints, "silu", False),
                          test_utils=("test_schema", "test_faketensor"))
    with pytest.raises(ValueError, match="activation 'swigluoai' is not supported"):
        moe.activate(torch.zeros(2, 4), "swigluoai")
