"""Tiny random-weight causal LMs of the tested model types, saved as Hugging Face directories
(SmolLM2's tokenizer), and the quantization options that keep runs on them fast."""
from __future__ import annotations

import torch

# Per model type, what its tiny config needs beside the common sizes (tests/quantize/test_model_architectures.py
# lists which of them are tested how). "gemma3" is the text-only gemma3_text.
TINY_CONFIGS = {
    "llama": dict(head_dim=20), "mistral": dict(head_dim=20, sliding_window=None), "qwen2": {},  # q/k/v biases
    "qwen3": dict(head_dim=20), "gemma": dict(head_dim=32), "gemma2": dict(head_dim=32, sliding_window=16),
    "gemma3": dict(head_dim=32, sliding_window=16),  # sliding and full attention layers get different masks
    "phi3": dict(pad_token_id=None), "olmo": {}, "olmo2": {}, "olmo3": dict(sliding_window=16),
    "granite": {}, "stablelm": dict(partial_rotary_factor=0.5), "starcoder2": dict(sliding_window=None),
    "cohere": {}, "glm": dict(head_dim=20, partial_rotary_factor=0.5, pad_token_id=None),
    "glm4": dict(head_dim=20, partial_rotary_factor=0.5, pad_token_id=None), "smollm3": dict(pad_token_id=None), "exaone4": dict(sliding_window=16), "helium": dict(head_dim=20), "seed_oss": dict(head_dim=20),
    "arcee": dict(head_dim=20), "apertus": dict(head_dim=20), "ernie4_5": dict(head_dim=20),
    "gpt_neox": dict(rotary_pct=0.5), "falcon": dict(new_decoder_architecture=True, num_kv_heads=2),
    "phi": dict(partial_rotary_factor=0.5), "gpt_bigcode": dict(n_embd=80, n_layer=None, n_head=4),
    "opt": dict(ffn_dim=144, word_embed_proj_dim=80), "bloom": dict(n_head=4), "gptj": dict(n_embd=80, rotary_dim=10),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48),
    "qwen3_moe": dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=40, head_dim=20),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40,
                      shared_expert_intermediate_size=48),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2, intermediate_size=48),
    "gpt2": dict(n_embd=80, n_head=4),  # Conv1D linears: refused
    "gpt_oss": dict(num_local_experts=4, head_dim=20),  # transposed experts with biases: refused
}


GEMMA_NORMS = ("gemma", "gemma2", "gemma3")  # their norms scale by 1 + w


def make_tiny_model(out, arch: str = "llama", layers: int = 2, dtype=torch.bfloat16, seed: int = 0, **sizes):
    """A tiny random-weight causal LM of model type ``arch`` saved as an HF dir with SmolLM2's tokenizer.
    hidden 80 / intermediate 144 end in a ragged group at g64 and pad the 32-column tile."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from vllm_latq import data
    tok = AutoTokenizer.from_pretrained(data.model_dir("smollm2-135m"))
    extra = dict(TINY_CONFIGS[arch])
    common = dict(dict(vocab_size=len(tok), hidden_size=80, intermediate_size=144, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, bos_token_id=tok.bos_token_id,
                  eos_token_id=tok.eos_token_id, tie_word_embeddings=True), **sizes)
    if "n_layer" in extra or arch in ("gpt2",):
        extra["n_layer"] = layers
    if arch in ("gemma2", "gemma3", "olmo3", "exaone4"):
        extra["layer_types"] = (["sliding_attention", "full_attention"] * layers)[:layers]
    config = AutoConfig.for_model("gemma3_text" if arch == "gemma3" else arch, **{**common, **extra, **sizes})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    torch.manual_seed(seed)  # after construction: the init's draws do not matter
    with torch.no_grad():
        for name, p in model.named_parameters():  # deterministic, well-scaled random weights
            norm = p.dim() == 1 and ("norm" in name or "ln" in name) and name.endswith("weight")
            p.copy_(torch.randn(p.shape) * 0.05 + (1.0 if norm and arch not in GEMMA_NORMS else 0.0))
    model.to(dtype).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def make_word_level_model(root, **sizes):
    """(model dir, calibration text file) under ``root``: a 2-block Llama (hidden 256, intermediate
    720: a ragged 64-group; ``sizes`` change them) with a word-level tokenizer of 256 words and Zipf-distributed
    text, all built here: no data package (a bare GPU machine has none; :func:`make_tiny_model` needs SmolLM2's)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    words = [f"w{i}" for i in range(253)]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{wd: i + 3 for i, wd in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    model_dir = root / "model"
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(model_dir)
    cfg = LlamaConfig(**{**dict(vocab_size=len(vocab), hidden_size=256, intermediate_size=720, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=64, bos_token_id=1,
                                eos_token_id=2, tie_word_embeddings=True), **sizes})
    model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05 + (1.0 if "norm" in name else 0.0))
    model.to(torch.bfloat16).save_pretrained(model_dir)
    zipf = 1.0 / torch.arange(1, len(words) + 1, dtype=torch.float64)      # word frequencies as in text
    ids = torch.multinomial(zipf, 6000, replacement=True, generator=g)
    (root / "calib.txt").write_text(" ".join(words[i] for i in ids.tolist()))
    return model_dir, root / "calib.txt"


# calibration small enough for tiny models: these checkpoints test the structure, not the accuracy
TINY_CALIB = dict(nsamples=4, seqlen=64)
# the output head stays in the model dtype: these checkpoints test the blocks (the head quantized by
# default is tests/quantize/test_lm_head.py's subject; pass quantize_lm_head to change it)
TINY_OPTS = dict(group_size=64, **TINY_CALIB, quantize_lm_head=False)
