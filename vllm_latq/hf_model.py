"""The Hugging Face model helpers the pipeline, the readers and the validator share: read
``config.json``, build a model on the meta device, walk its decoder blocks and linears, and
swap tensors in and out. The walk is structural (no list of model types or module names):
:func:`check_supported` refuses, before any calibration, what it cannot handle."""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from .format.errors import FormatError
from .format.files import CONFIG_FILE

class UnsupportedModelError(ValueError):
    """The model has a construct the pipeline cannot walk block by block (the message names
the module and why)."""


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


def empty_model(config, dtype: torch.dtype = torch.float32):
    """The causal LM of ``config`` with every parameter on the meta device."""
    from transformers import AutoModelForCausalLM

    with params_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def _num_layers(config) -> int | None:
    n = getattr(config.get_text_config() if hasattr(config, "get_text_config") else config, "num_hidden_layers", None)
    return n if isinstance(n, int) else None


def _block_lists(model) -> list[tuple[str, torch.nn.ModuleList]]:
    """The outermost ``nn.ModuleList``s of ``num_hidden_layers`` modules of one class."""
    n = _num_layers(model.config)
    found = []
    for name, m in model.named_modules():
        if (isinstance(m, torch.nn.ModuleList) and len(m) == n and len({type(b) for b in m}) == 1
                and not any(name.startswith(f + ".") for f, _ in found)):
            found.append((name, m))
    return found


def decoder_layers(model) -> tuple[str, torch.nn.ModuleList]:
    """(prefix, layers) of the decoder blocks, found structurally: the outermost
    ``nn.ModuleList`` of ``config.num_hidden_layers`` modules of one class, e.g.
    ``("model.layers", ...)``, ``("transformer.h", ...)``, ``("gpt_neox.layers", ...)``."""
    found = _block_lists(model)
    if len(found) != 1:
        what = "no" if not found else f"{len(found)} ({', '.join(n for n, _ in found)})"
        raise UnsupportedModelError(
            f"{type(model).__name__}: {what} nn.ModuleList of {_num_layers(model.config)} blocks of one class "
            "(config.num_hidden_layers): cannot find the decoder blocks")
    return found[0]


def final_norm(model, prefix: str) -> str:
    """The final norm's module name: the child of the blocks' parent whose parameters are all
    1-D (``model.norm``, ``transformer.ln_f``, ``model.decoder.final_layer_norm``, ...); of
    several, the one registered after the blocks (Bloom's embedding norm comes before)."""
    parent_name, _, attr = prefix.rpartition(".")
    parent = model.get_submodule(parent_name)
    kids = [(n, m) for n, m in parent.named_children() if n != attr]
    if any(isinstance(m, torch.nn.Linear) for _, m in kids):
        raise UnsupportedModelError(
            f"{type(model).__name__}: {parent_name or type(model).__name__} has a linear outside its blocks "
            f"({[n for n, m in kids if isinstance(m, torch.nn.Linear)]}): the output head's input is not the "
            "final norm's output")
    norms = [n for n, m in kids if (ps := list(m.parameters())) and all(p.dim() == 1 for p in ps)]
    order = [n for n, _ in parent.named_children()]
    if len(norms) > 1:
        norms = [n for n in norms if order.index(n) > order.index(attr)]
    if len(norms) != 1:
        raise UnsupportedModelError(
            f"{type(model).__name__}: {parent_name or type(model).__name__} has {len(norms) or 'no'} norm-like "
            f"children {norms} beside its blocks: cannot tell the final norm, the output head's input")
    return f"{parent_name}.{norms[0]}" if parent_name else norms[0]


def check_supported(model) -> tuple[str, torch.nn.ModuleList]:
    """The early structural check (before any tensor is read): a causal LM whose decoder blocks
    are found and hold only ``nn.Linear`` weights (quantized) and 1-D parameters (kept).
    Raises :class:`UnsupportedModelError` naming the module and why → (prefix, layers)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    mt = getattr(model.config, "model_type", None)
    name = type(model).__name__
    if MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(mt) != name or model.get_output_embeddings() is None:
        raise UnsupportedModelError(f"{name} (model_type {mt!r}) is not the causal LM of its model type, with an "
                                    "output head")
    prefix, layers = decoder_layers(model)
    for i, block in enumerate(layers):  # mixture-of-experts first: its router is not a linear either
        for n, m in block.named_modules():
            where = f"{prefix}.{i}.{n}" if n else f"{prefix}.{i}"
            if isinstance(m, torch.nn.ModuleList) and any(isinstance(x, torch.nn.Linear) for x in m.modules()):
                raise UnsupportedModelError(f"{where} ({type(m).__name__} of {len(m)} {type(m[0]).__name__}): a list of "
                                            "experts in a decoder block; mixture-of-experts is issue 20's next step")
            for pn, p in m.named_parameters(recurse=False):
                if p.dim() >= 3:
                    raise UnsupportedModelError(
                        f"{where}.{pn} ({type(m).__name__}, shape {list(p.shape)}): 3-D expert weights in a decoder "
                        "block; mixture-of-experts is issue 20's next step")
        for n, m in block.named_modules():
            for pn, p in m.named_parameters(recurse=False):
                if p.dim() == 2 and not isinstance(m, torch.nn.Linear):
                    raise UnsupportedModelError(
                        f"{prefix}.{i}.{n} is a {type(m).__name__} with a 2-D weight {pn} {list(p.shape)}, not an "
                        "nn.Linear: the pipeline quantizes nn.Linear only and would silently keep it")
    return prefix, layers


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
