"""The Hugging Face model helpers: read ``config.json``, build on the meta device, walk blocks and linears.

The walk is structural, with no list of model types (docs/ARCHITECTURE.md, "Models")."""
from __future__ import annotations

import bisect
import contextlib
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import FormatError, is_resource_error
from .model_config import CONFIG_FILE, config_dict  # noqa: F401  (read through here by the pipeline and readers)

# The most bytes of tables (rotary positions, causal masks) building a model on the meta device may
# compute for real: a real model's are a few MiB (GPT-J 6B: 15 MiB; StarCoder's 8192² mask: 64 MiB).
BUILD_BUFFER_BUDGET = 256 << 20


class UnsupportedModelError(ValueError):
    """The model has a construct the pipeline cannot walk block by block (the message names it)."""


@contextlib.contextmanager
def params_on_meta():
    """Parameters on the meta device; buffers for real (rotary inv_freq is in no checkpoint)."""
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
    """The dtype a ``config.json`` dict declares (``dtype`` or ``torch_dtype``; default "float32")."""
    return str(config.get("dtype") or config.get("torch_dtype") or "float32")


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
        if is_resource_error(e):
            raise
        raise FormatError(f"transformers rejects the config: {type(e).__name__}: {e}", file=file) from None


def empty_model(config, dtype: torch.dtype = torch.float32):
    """The causal LM of ``config`` with every parameter on the meta device."""
    from transformers import AutoModelForCausalLM

    check_build_budget(config, dtype)
    with params_on_meta(), _beside_vllm(config):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def check_build_budget(config, dtype: torch.dtype = torch.float32) -> None:
    """Refuse a config whose built model would hold over :data:`BUILD_BUFFER_BUDGET` bytes of buffers,
    sized on a meta build before the real one allocates them (GPT-J's position table, causal masks)."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"), _beside_vllm(config):
            dry = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except Exception:  # noqa: BLE001  (the real build raises it, with its own message)
        return
    n = sum(b.numel() * b.element_size() for b in dry.buffers())
    if n > BUILD_BUFFER_BUDGET:
        raise FormatError(f"building this model computes {n / 2**20:.0f} MiB of tables (position tables and masks, "
                          f"from its positions and layers) before any weight is read, more than the "
                          f"{BUILD_BUFFER_BUDGET >> 20} MiB a real model needs: refused", file=CONFIG_FILE)


@contextlib.contextmanager
def _beside_vllm(config):
    """Build under a stand-in vLLM config: vLLM's Transformers backend patches transformers' classes."""
    if "vllm.config" not in sys.modules:
        yield
        return
    from types import SimpleNamespace

    from vllm.config import CompilationConfig, CompilationMode, set_current_vllm_config

    stand_in = SimpleNamespace(compilation_config=CompilationConfig(mode=CompilationMode.NONE),
                               model_config=SimpleNamespace(hf_config=config))
    with set_current_vllm_config(stand_in):
        yield


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
    """(prefix, layers) of the decoder blocks, e.g. ``("model.layers", ...)``."""
    found = _block_lists(model)
    if len(found) != 1:
        what = "no" if not found else f"{len(found)} ({', '.join(n for n, _ in found)})"
        raise UnsupportedModelError(
            f"{type(model).__name__}: {what} nn.ModuleList of {_num_layers(model.config)} blocks of one class "
            "(config.num_hidden_layers): cannot find the decoder blocks")
    return found[0]


def final_norm(model, prefix: str) -> str:
    """The final norm's module name (``model.norm``, ``transformer.ln_f``, ...)."""
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
    """Refuse, before any tensor is read, a model the pipeline cannot walk → (prefix, layers)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    mt = getattr(model.config, "model_type", None)
    name = type(model).__name__
    if MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(mt) != name or model.get_output_embeddings() is None:
        raise UnsupportedModelError(f"{name} (model_type {mt!r}) is not the causal LM of its model type, with an "
                                    "output head")
    prefix, layers = decoder_layers(model)
    for i, block in enumerate(layers):
        where = lambda n: f"{prefix}.{i}.{n}" if n else f"{prefix}.{i}"  # noqa: E731
        for n, m in block.named_modules():  # mixture-of-experts first: its router is not a linear either
            if isinstance(m, torch.nn.ModuleList) and any(isinstance(x, torch.nn.Linear) for x in m.modules()):
                raise UnsupportedModelError(
                    f"{where(n)} ({type(m).__name__} of {len(m)} {type(m[0]).__name__}): a list of expert modules in a "
                    "decoder block (a remote-code layout); the pipeline takes transformers' fused 3-D experts")
        for n, m in expert_modules(block).items():
            check_experts(m, where(n))
        gates = moe_gates(block)
        for n, m in block.named_modules():
            for pn, p in m.named_parameters(recurse=False):
                if p.dim() == 2 and not isinstance(m, torch.nn.Linear) and n not in gates:
                    raise UnsupportedModelError(
                        f"{where(n)} is a {type(m).__name__} with a 2-D weight {pn} {list(p.shape)}, not an "
                        "nn.Linear: the pipeline quantizes nn.Linear only and would silently keep it")
    return prefix, layers


def block_linears(layer: torch.nn.Module, prefix: str) -> dict[str, torch.nn.Linear]:
    """Every ``nn.Linear`` of one decoder block but the routers' gates, full names, in module order."""
    gates = moe_gates(layer)
    return {f"{prefix}.{n}": m for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear) and n not in gates}


# ---------------------------------------------------------------- mixture-of-experts

EXPERT_PARAMS = ("gate_up_proj", "down_proj")  # the weights transformers' experts interface reads (integrations/moe.py)


def expert_modules(block: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The experts modules of a block by name: those holding 3-D ``[experts, out, in]`` parameters."""
    return {n: m for n, m in block.named_modules() if any(p.dim() == 3 for p in m.parameters(recurse=False))}


def check_experts(m: torch.nn.Module, where: str) -> None:
    """Refuse an experts module not fused as ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``."""
    import inspect
    shapes = {pn: list(p.shape) for pn, p in m.named_parameters(recurse=False)}
    what = f"{where} ({type(m).__name__}, parameters {shapes})"
    layout = {a: getattr(m, a, None) for a in ("has_gate", "has_bias", "is_transposed", "is_concatenated")}
    why = None
    if None in layout.values():
        why = "3-D weights outside transformers' experts interface (no has_gate/is_transposed/...): unknown dispatch"
    elif layout != {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True}:
        why = f"experts layout {layout}; the pipeline takes gated, concatenated, untransposed experts without biases"
    elif set(shapes) != set(EXPERT_PARAMS) or any(len(s) != 3 for s in shapes.values()):
        why = f"expected exactly the 3-D parameters {list(EXPERT_PARAMS)}"
    else:
        (e, two_i, h), (e2, h2, i) = shapes["gate_up_proj"], shapes["down_proj"]
        if (e, h, 2 * i) != (e2, h2, two_i) or getattr(m, "num_experts", e) != e:
            why = "gate_up_proj [E, 2I, H] and down_proj [E, H, I] do not agree"
        elif not {"hidden_states", "top_k_index"} <= set(inspect.signature(m.forward).parameters):
            why = "its forward does not take (hidden_states, top_k_index, ...): the routed tokens cannot be seen"
    if why:
        raise UnsupportedModelError(f"{what}: {why}")


def moe_gates(block: torch.nn.Module) -> set[str]:
    """The routing gates of a block's mixtures: the experts' siblings holding a 2-D weight themselves."""
    gates = set()
    for n in expert_modules(block):
        parent, _, leaf = n.rpartition(".")
        for c, m in block.get_submodule(parent).named_children():
            if c != leaf and any(p.dim() == 2 for p in m.parameters(recurse=False)):
                gates.add(f"{parent}.{c}" if parent else c)
    return gates


@dataclass(frozen=True)
class ExpertLinear:
    """One expert's linear inside a fused 3-D parameter: ``param[expert, rows]`` is its ``[out, in]``."""
    param: str          # the model's parameter, e.g. "model.layers.0.mlp.experts.gate_up_proj"
    expert: int
    rows: slice

    @property
    def experts_module(self) -> str:
        return self.param.rpartition(".")[0]


@dataclass
class CheckpointNames:
    """How a model's state dict is named in the original per-expert checkpoint (what vLLM reads)."""
    original: dict[str, str]                # model key -> checkpoint name (fused expert params excluded)
    experts: dict[str, ExpertLinear]        # checkpoint module of one expert's linear -> where it lives
    _index: dict = field(default_factory=dict, repr=False)   # lookups built once, after construction

    def module(self, name: str) -> str:
        """The checkpoint name of module ``name`` (its weight's name less ``.weight``)."""
        return self.original.get(f"{name}.weight", f"{name}.weight").removesuffix(".weight")

    def model_key(self, name: str) -> str:
        """The model key of checkpoint tensor ``name`` (itself where nothing is renamed)."""
        if "inverse" not in self._index:
            self._index["inverse"] = {v: k for k, v in self.original.items()}
        return self._index["inverse"].get(name, name)

    def of_param(self, param: str) -> dict[str, ExpertLinear]:
        """The expert linears stored in fused parameter ``param`` (none for any other key)."""
        if "params" not in self._index:
            for n, x in self.experts.items():
                self._index.setdefault("params", {}).setdefault(x.param, {})[n] = x
        return self._index.get("params", {}).get(param, {})


def checkpoint_names(model) -> CheckpointNames:
    """:class:`CheckpointNames` of ``model``, found by probing transformers' ``revert_weight_conversion``."""
    keys = list(model.state_dict(keep_vars=True).items())
    fused = {k for k, t in keys if t.dim() == 3}
    if not fused:
        return CheckpointNames({k: k for k, _ in keys}, {})
    from transformers.core_model_loading import revert_weight_conversion
    prefix, layers = decoder_layers(model)
    groups: dict[int, list] = {}
    for k, t in keys:
        rest = k[len(prefix) + 1:] if k.startswith(prefix + ".") else None
        groups.setdefault(int(rest.split(".")[0]) if rest else -1, []).append((k, t))
    names = CheckpointNames({}, {})
    for group in groups.values():
        codes, probe, base = {}, {}, 0
        for k, t in group:
            rows = t.shape[0] * t.shape[1] if k in fused else 1
            codes[k] = (base, t.shape[1] if k in fused else 1)
            probe[k] = torch.arange(base, base + rows).reshape(t.shape[0], t.shape[1], 1) if k in fused \
                else torch.tensor([base])
            base += rows
        try:
            out = revert_weight_conversion(model, probe)
        except Exception as e:  # transformers raises many kinds on a mapping it cannot revert
            if is_resource_error(e):
                raise
            raise UnsupportedModelError(f"{type(model).__name__}: transformers cannot revert its conversion mapping "
                                        f"to the original checkpoint names ({type(e).__name__}: {e})") from None
        owners = list(codes)   # in increasing code order
        bases = [codes[k][0] for k in owners]
        for name, t in out.items():
            v = t.reshape(-1)
            k = owners[bisect.bisect_right(bases, int(v[0])) - 1]
            b, nrows = codes[k]
            if k not in fused:
                if v.numel() != 1 or k in names.original:
                    raise UnsupportedModelError(f"{k}: transformers' conversion mapping for model type "
                                                f"{model.config.model_type!r} transforms it beyond a rename")
                names.original[k] = name
                continue
            e, r = divmod(int(v[0]) - b, nrows)
            if not name.endswith(".weight") or not torch.equal(v, torch.arange(int(v[0]), int(v[0]) + len(v))) \
                    or r + len(v) > nrows:
                raise UnsupportedModelError(
                    f"{k} {list(dict(group)[k].shape)}: transformers' conversion mapping for model type "
                    f"{model.config.model_type!r} gives no per-expert checkpoint layout ({name} {list(t.shape)}); "
                    "the experts cannot be stored under the names vLLM loads")
            names.experts[name.removesuffix(".weight")] = ExpertLinear(k, e, slice(r, r + len(v)))
    for k in fused:  # every row of every expert in exactly one per-expert tensor
        cover = torch.zeros(model.get_parameter(k).shape[:2], dtype=torch.int32)
        for x in names.of_param(k).values():
            cover[x.expert, x.rows] += 1
        if not bool((cover == 1).all()):
            raise UnsupportedModelError(f"{k}: the per-expert checkpoint tensors do not cover it row by row")
    return names


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
