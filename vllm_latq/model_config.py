"""A model's ``config.json`` read within bounds and checked (sizes, forward floats, architecture)
before anything is built from it; the quantizer, every reader and the plugin read it here."""
from __future__ import annotations

import math
from pathlib import Path

from . import bounded_io
from .errors import FormatError

CONFIG_FILE = "config.json"   # a Hugging Face model's (and so a checkpoint's) config

# The sizes a config.json may declare, (lowest, highest): generous for any real model (a 405B
# model has 126 layers, 16384 hidden, 128256 vocabulary), small enough that building its model on
# the meta device (real rotary buffers, per-layer modules) and checking shapes stay cheap.
SIZE_LIMITS = {
    **dict.fromkeys(("num_hidden_layers", "n_layer"), (1, 1024)),
    **dict.fromkeys(("hidden_size", "n_embd"), (1, 1 << 17)),
    **dict.fromkeys(("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"), (1, 1 << 20)),
    "vocab_size": (1, 1 << 22),
    **dict.fromkeys(("num_attention_heads", "num_key_value_heads", "n_head"), (1, 1024)),
    "head_dim": (1, 1 << 12),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok"), (0, 1 << 12)),
    **dict.fromkeys(("max_position_embeddings", "n_positions"), (1, 1 << 24)),
}

# The floating-point fields a forward computes with, (low, high] (low exclusive: an epsilon of 0
# divides by zero, a rotary base of 0 gives NaN), wherever they sit (rope_parameters nests them).
VALUE_LIMITS = {
    **dict.fromkeys(("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps", "rms_norm_epsilon"),
                    (0.0, 1.0)),
    **dict.fromkeys(("rope_theta", "rotary_emb_base"), (0.0, 1e12)),
    **dict.fromkeys(("partial_rotary_factor", "rotary_pct"), (0.0, 1.0)),
    **dict.fromkeys(("factor", "attention_factor", "beta_fast", "beta_slow", "low_freq_factor", "high_freq_factor"),
                    (0.0, 1e6)),
    **dict.fromkeys(("final_logit_softcapping", "attn_logit_softcapping", "logit_scale", "query_pre_attn_scalar",
                     "embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"),
                    (0.0, 1e6)),
}


def config_dict(path: str | Path) -> dict:
    """``config.json`` of a model or checkpoint directory as a dict (FormatError if unreadable or unbounded)."""
    f = Path(path) / CONFIG_FILE
    try:
        d = bounded_io.read_json(f)
    except FileNotFoundError:
        raise FormatError("missing (not a model directory?)", file=str(f)) from None
    if not isinstance(d, dict):
        raise FormatError("not a JSON object", file=str(f))
    return d


def check_config(cfg: dict, *, file: str = CONFIG_FILE) -> None:
    """Refuse, naming the field, a size outside :data:`SIZE_LIMITS` or a float outside :data:`VALUE_LIMITS`.
    Nested objects are checked too, but ``quantization_config`` (the format's)."""
    _check_fields(cfg, file, "")
    heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    if _is_int(heads) and _is_int(kv) and kv and heads % kv:
        raise FormatError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}", file=file)


def _check_fields(cfg: dict, file: str, prefix: str) -> None:
    for k, v in cfg.items():
        if isinstance(v, dict) and k != "quantization_config":
            _check_fields(v, file, f"{prefix}{k}.")
        elif k in SIZE_LIMITS and isinstance(v, float):   # a size is a JSON integer: 128.0 is not one
            raise FormatError(f"{prefix}{k} is {v!r}, expected an integer", file=file)
        elif k in SIZE_LIMITS and _is_int(v):
            lo, hi = SIZE_LIMITS[k]
            if not lo <= v <= hi:
                raise FormatError(f"{prefix}{k} is {v}, expected an integer in [{lo}, {hi}]", file=file)
        elif k in VALUE_LIMITS and v is not None:
            lo, hi = VALUE_LIMITS[k]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and lo < v <= hi):
                raise FormatError(f"{prefix}{k} is {v!r}, expected a number in ({lo:g}, {hi:g}]", file=file)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_positions(config, seqlen: int, option: str, where: str) -> None:
    """Refuse ``option``'s ``seqlen`` past the positions of ``config`` (read from ``where``)."""
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, int) and seqlen > positions:
        raise ValueError(f"{option} {seqlen} is longer than the model's {positions} positions "
                         f"(max_position_embeddings of {where})")


def check_architecture(cfg: dict, model_class: str, *, file: str = CONFIG_FILE) -> None:
    """Refuse ``architectures`` other than ``[model_class]``: vLLM would serve a class not checked."""
    archs = cfg.get("architectures")
    if archs is not None and archs != [model_class]:
        raise FormatError(f"architectures is {archs!r}, but model_type {cfg.get('model_type')!r} builds "
                          f"{model_class}: vLLM would run the class architectures names (set it to "
                          f"[{model_class!r}] if that is the model)", file=file)
