# Triton must run in its interpreter (no GPU anywhere): set before anything imports triton.
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def real_hessians():
    """Real layer Hessians: SmolLM2-135M (real pretrained weights) on real Wikipedia
    calibration text, for layers of its first two decoder blocks. Cached on disk."""
    from tests.helpers import real_layer_hessians
    return real_layer_hessians()


# ----------------------------------------------------------------------------- tiny models
# (pipeline and checkpoint tests: tests/test_pipeline.py, tests/test_checkpoint.py)

def make_tiny_model(out, arch: str = "llama", layers: int = 2, dtype=torch.bfloat16, seed: int = 0):
    """A tiny random-weight causal LM of ``arch`` saved as an HF dir with SmolLM2's tokenizer.
    hidden 80 / intermediate 144: with group size 64 both end in a ragged group, and neither is
    a multiple of the 32-column packing tile (padding is exercised)."""
    from transformers import (AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig, GPT2Config, GPT2LMHeadModel,
                              LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM)

    from vllm_latq import data
    tok = AutoTokenizer.from_pretrained(data.model_dir("smollm2-135m"))
    common = dict(vocab_size=len(tok), hidden_size=80, intermediate_size=144, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, bos_token_id=tok.bos_token_id,
                  eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, head_dim=20))
    elif arch == "qwen2":  # q/k/v have biases
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=20))
    elif arch == "gemma3":  # sliding and full attention layers get different masks
        model = Gemma3ForCausalLM(Gemma3TextConfig(**common, head_dim=32, sliding_window=16,
                                                   layer_types=["sliding_attention", "full_attention"] * (layers // 2)
                                                   + ["sliding_attention"] * (layers % 2)))
    elif arch == "gpt2":  # unsupported
        model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=80, n_layer=layers, n_head=4))
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # deterministic, well-scaled random weights
            norm = "norm" in name and arch != "gemma3"  # Gemma's norms scale by 1 + w
            p.copy_(torch.randn(p.shape) * 0.05 + (1.0 if norm else 0.0))
    model.to(dtype).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama")


TINY_OPTS = dict(group_size=64, nsamples=4, seqlen=64)


@pytest.fixture(scope="session")
def tiny_checkpoints(tiny_llama, tmp_path_factory):
    """{method: (checkpoint dir, {layer: QuantResult})} for SSQR and HPTQ of the tiny Llama."""
    from vllm_latq.quantize.pipeline import QuantizeOptions, quantize_model
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for method in ("ssqr", "hptq"):
        results = {}
        d = quantize_model(tiny_llama, root / method, QuantizeOptions(method=method, **TINY_OPTS), progress=False,
                           on_layer=lambda name, W, H, res, r=results: r.__setitem__(name, res))
        out[method] = (d, results)
    return out
