"""The Hugging Face model helpers the pipeline, the readers and the validator share: read
``config.json``, build a model on the meta device, walk its decoder blocks and linears, and
swap tensors in and out. The architecture allow-list lives here, next to the walk it gates."""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from .format.errors import FormatError
from .format.files import CONFIG_FILE

SUPPORTED_MODEL_TYPES = {
    "llama": "Llama-style (LlamaForCausalLM: SmolLM2, Llama 2/3)",
    "qwen2": "Qwen2 (Qwen2ForCausalLM)",
    "qwen3": "Qwen3 (Qwen3ForCausalLM)",
    "gemma3_text": "Gemma3 text-only (Gemma3ForCausalLM)",
}


class UnsupportedModelError(ValueError):
    """The model's architecture is not one the pipeline knows how to walk block by block."""


@contextlib.contextmanager
def params_on_meta():
    """Create parameters on the meta device (no memory, no init), buffers for real: the
    non-persistent buffers (rotary inv_freq, Gemma's embed_scale) are computed in ``__init__``
    and are not in any checkpoint."""
    orig = torch.nn.Module.register_parameter

    def register(self, name, param):
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=False)
        orig(self, name, param)

    torch.nn.Module.register_parameter = register
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = orig


def model_dtype(config: dict) -> str:
    """The dtype a ``config.json`` dict declares (``dtype``, or the older ``torch_dtype``;
    "float32" when neither is set), e.g. "bfloat16"."""
    return str(config.get("dtype") or config.get("torch_dtype") or "float32")


def config_dict(path: Path) -> dict:
    """``config.json`` of a model/checkpoint dir as a dict (FormatError if unreadable)."""
    f = Path(path) / CONFIG_FILE
    try:
        d = json.loads(f.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FormatError("missing (not a model directory?)", file=str(f)) from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise FormatError(f"not valid JSON ({e})", file=str(f)) from None
    if not isinstance(d, dict):
        raise FormatError("not a JSON object", file=str(f))
    return d


def hf_config(cfg: dict, *, file: str = CONFIG_FILE):
    """A transformers config from a config dict, with any ``quantization_config`` dropped."""
    from transformers import CONFIG_MAPPING

    cfg = {k: v for k, v in cfg.items() if k != "quantization_config"}
    mt = cfg.get("model_type")
    if not isinstance(mt, str) or mt not in CONFIG_MAPPING:
        raise FormatError(f"unknown model_type {mt!r}", file=file)
    try:
        return CONFIG_MAPPING[mt].from_dict(cfg)
    except Exception as e:  # transformers raises many kinds on a bad config
        raise FormatError(f"transformers rejects the config: {type(e).__name__}: {e}", file=file) from None


def check_supported(config) -> None:
    mt = getattr(config, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        hint = " (the multimodal Gemma3 is not supported; use a text-only Gemma3ForCausalLM)" if mt == "gemma3" else ""
        arch = ", ".join(getattr(config, "architectures", None) or []) or "?"
        raise UnsupportedModelError(
            f"unsupported architecture {arch} (model_type {mt!r}){hint}; latq supports: "
            + "; ".join(f"{k} = {v}" for k, v in SUPPORTED_MODEL_TYPES.items()))


def empty_model(config, dtype: torch.dtype = torch.float32):
    """The causal LM of ``config`` with every parameter on the meta device."""
    from transformers import AutoModelForCausalLM

    with params_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def decoder_layers(model) -> tuple[str, torch.nn.ModuleList]:
    """(prefix, layers) of the decoder blocks, e.g. ``("model.layers", ModuleList)``."""
    check_supported(model.config)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise UnsupportedModelError(f"{type(model).__name__}: no decoder block list at model.layers")
    return "model.layers", layers


def block_linears(layer: torch.nn.Module, prefix: str) -> dict[str, torch.nn.Linear]:
    """Every ``nn.Linear`` inside one decoder block, full names, in module order."""
    return {f"{prefix}.{n}": m for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}


def set_tensor(model: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    """Replace parameter or buffer ``name`` (dotted) by ``value``."""
    mod_name, _, leaf = name.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    if leaf in mod._parameters:
        mod._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)
    elif leaf in mod._buffers:
        mod._buffers[leaf] = value
    else:
        raise KeyError(f"{type(model).__name__} has no parameter or buffer {name}")


def to_meta(module: torch.nn.Module) -> None:
    """Free a module's parameters (back to the meta device)."""
    for m in module.modules():
        for k, p in m._parameters.items():
            if p is not None:
                m._parameters[k] = torch.nn.Parameter(p.to("meta"), requires_grad=False)
