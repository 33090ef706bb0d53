"""The source model: where it is, its tensors (read one at a time) and which of them are quantized."""
from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ..bounded_io import MAX_JSON_BYTES, copy_regular, read_json
from ..format.files import INDEX_FILE, SINGLE_FILE
from ..format.writer import aux_files, copy_aux_files
from ..format.safetensors_file import SafetensorsFile, StoredTensor
from .. import hf_model
from ..errors import FormatError
from ..model_config import check_architecture, check_config
from .. import data

log = logging.getLogger("vllm_latq.quantize")


def resolve_model(spec: str | os.PathLike, progress: bool = True) -> Path:
    """An HF model directory for ``spec``: a directory, a ``.gguf`` file or a reference name (converted once)."""
    s = str(spec)
    if s in data.MODELS:
        return data.model_dir(s, progress)
    p = Path(s).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise FileNotFoundError(f"GGUF file not found: {p}")
        return data.cached_conversion(p.resolve(), data.cache_dir() / "converted", p.stem, progress=progress)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"{p} has no config.json: not a Hugging Face model directory")
        return p
    raise FileNotFoundError(f"model {s!r}: not a Hugging Face model directory, a .gguf file, or one of "
                            f"{sorted(data.MODELS)}")


class SourceWeights:
    """Tensors of a safetensors HF directory, read one at a time into memory the caller owns.
    Not memory-mapped: a mapped file's pages stay resident until it closes, so RSS would grow to the model."""

    def __init__(self, d: Path):
        idx = d / INDEX_FILE
        if os.path.lexists(idx):
            index = read_json(idx)
            wm = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(wm, dict) or not all(isinstance(f, str) and Path(f).name == f for f in wm.values()):
                raise FormatError("weight_map must map tensor names to shard file names in this directory",
                                  file=str(idx))
            files = sorted(set(wm.values()))
        elif (d / SINGLE_FILE).is_file():
            files = [SINGLE_FILE]
        else:
            raise FileNotFoundError(f"{d}: no safetensors weights (only safetensors sources are supported; "
                                    "convert .bin checkpoints with transformers first)")
        self.handles = {f: SafetensorsFile(d / f) for f in files}
        self.where = {k: f for f, h in self.handles.items() for k in h.names()}

    def names(self) -> list[str]:
        return list(self.where)

    def get(self, name: str) -> torch.Tensor:
        return self.handles[self.where[name]].get(name)

    def stored(self, name: str) -> StoredTensor:
        """The tensor as stored, to be copied into a checkpoint by pieces."""
        return self.handles[self.where[name]].stored(name)

    def get_rows(self, name: str, index: int, rows: slice) -> torch.Tensor:
        """``tensor[index, rows]`` of a 3-D tensor, read without the rest of it."""
        return self.handles[self.where[name]].get_rows(name, index, rows)

    def same(self, a: str, b: str) -> bool:
        """Whether tensors ``a`` and ``b`` hold the same dtype, shape and bytes (compared by pieces)."""
        fa, fb = self.handles[self.where[a]], self.handles[self.where[b]]
        if (fa.dtype(a), fa.shape(a)) != (fb.dtype(b), fb.shape(b)):
            return False
        return all(bytes(x) == bytes(y) for x, y in zip(fa.pieces(a), fb.pieces(b)))


@dataclass
class Source:
    """A source model opened for quantization: directory, config, tensors and the model on the meta device.
    A fused expert parameter is read from per-expert or fused source tensors, whichever the source holds."""
    path: Path
    raw_config: dict            # config.json as written
    config: object              # the transformers config
    weights: SourceWeights
    net: torch.nn.Module        # on the meta device until a part of it is loaded
    prefix: str                 # the decoder blocks' module name, e.g. "model.layers", "transformer.h"
    layers: torch.nn.ModuleList
    block_of: dict[str, int]    # model key -> its decoder block
    expected: dict              # the model's state-dict names (keys; in the model's order)
    head: torch.nn.Module       # the output head (lm_head)
    head_names: set[str]        # module names of the head
    tied: bool                  # the head shares the input embedding's weight
    dtype: torch.dtype          # of the calibration forwards
    names: hf_model.CheckpointNames
    tokenizer: object = None    # the one the checkpoint carries (:func:`checkpoint_tokenizer`)

    @property
    def nblocks(self) -> int:
        return len(self.layers)

    def on_disk(self, key: str) -> str | None:
        """The source tensor holding model key ``key`` whole (its own or its checkpoint name)."""
        for n in (key, self.names.original.get(key)):
            if n in self.weights.where:
                return n
        return None

    def available(self, key: str) -> bool:
        return self.on_disk(key) is not None or (
            (parts := self.names.of_param(key)) != {} and all(f"{n}.weight" in self.weights.where for n in parts))

    def block_tensors(self, i: int) -> list[str]:
        """The model keys of decoder block ``i`` the source holds."""
        return [n for n in self.expected if self.block_of.get(n) == i and self.available(n)]

    def outside_tensors(self) -> list[str]:
        """The parameters outside the blocks and the head (embeddings, final norm), which capture needs."""
        params = dict(self.net.named_parameters())
        return [n for n in self.expected if n not in self.block_of
                and not n.rpartition(".")[0] in self.head_names and n in params]

    def load(self, names, device) -> None:
        """Load model keys ``names`` into the model on ``device`` in the forwards' dtype."""
        for n in names:
            if self.on_disk(n) is not None:
                t = self.weights.get(self.on_disk(n)).to(device=device, dtype=self.dtype)
            else:
                t = torch.empty(self.net.get_parameter(n).shape, device=device, dtype=self.dtype)
                for name, x in self.names.of_param(n).items():
                    t[x.expert, x.rows] = self.weights.get(f"{name}.weight").to(device=device, dtype=self.dtype)
            hf_model.set_tensor(self.net, n, t)

    def linear_weight(self, name: str) -> torch.Tensor:
        """The source weight ``[out, in]`` of block linear ``name`` (a model module name), as stored."""
        return self.weights.get(self.on_disk(f"{name}.weight"))

    def expert_weight(self, name: str) -> torch.Tensor:
        """The source weight ``[out, in]`` of expert linear ``name``, read alone."""
        if f"{name}.weight" in self.weights.where:
            return self.weights.get(f"{name}.weight")
        x = self.names.experts[name]
        return self.weights.get_rows(self.on_disk(x.param), x.expert, x.rows)

    def kept_tensors(self, keys, linears=(), head_name: str | None = None, stored: bool = False) -> dict:
        """Model keys ``keys`` other than the quantized weights, in their original dtype, by checkpoint name."""
        quantized = set(linears) | {head_name}
        fused = {x.param for x in self.names.experts.values()}
        keep = [n for n in keys if n not in fused and not (n.rpartition(".")[0] in quantized and n.endswith(".weight"))]
        if stored:
            return {self.names.original[n]: self.weights.stored(self.on_disk(n)) for n in keep}
        return {self.names.original[n]: self.weights.get(self.on_disk(n)) for n in keep}

    def outside_kept_tensors(self, head_name: str | None) -> dict:
        """The tensors outside the blocks (embeddings, final norm, an unquantized head), copied by pieces."""
        return self.kept_tensors([n for n in self.expected if n not in self.block_of and self.available(n)],
                                 head_name=head_name, stored=True)

    def kept_block_tensors(self, i: int, linears) -> dict[str, torch.Tensor]:
        """Block ``i``'s unquantized tensors (norms, biases, routers) by checkpoint name."""
        return self.kept_tensors(self.block_tensors(i), linears)

    def block_linears(self, i: int) -> dict[str, torch.nn.Linear]:
        """The linears of decoder block ``i`` by full name: what the pipeline quantizes."""
        return hf_model.block_linears(self.layers[i], f"{self.prefix}.{i}")

    def block_experts(self, i: int) -> dict[str, dict[str, hf_model.ExpertLinear]]:
        """{experts module: {expert linear (checkpoint name): where it lives}} of block ``i``."""
        out: dict[str, dict] = {}
        for name, x in self.names.experts.items():
            if self.block_of.get(x.param) == i:
                out.setdefault(x.experts_module, {})[name] = x
        return out

    def modules_not_converted(self, head_name: str | None) -> list[str]:
        """The modules that stay unquantized, by checkpoint name (linears, embeddings, routing gates)."""
        quantized = {n for i in range(self.nblocks) for n in self.block_linears(i)} | {head_name}
        gates = {f"{self.prefix}.{i}.{g}" for i in range(self.nblocks) for g in hf_model.moe_gates(self.layers[i])}
        return sorted(self.names.module(n) for n, m in self.net.named_modules()
                      if (isinstance(m, (torch.nn.Linear, torch.nn.Embedding)) and n not in quantized) or n in gates)


def open_source(model: str | os.PathLike, compute_dtype, progress: bool = True) -> Source:
    """Resolve ``model``, refuse a quantized or unsupported one, and build it on the meta device."""
    src = resolve_model(model, progress)
    raw_cfg = hf_model.config_dict(src)
    cfg_file = str(Path(src) / hf_model.CONFIG_FILE)
    check_config(raw_cfg, file=cfg_file)   # before building anything
    aux_files(src)   # a tokenizer file linked out of the source is refused now, not after the run
    if "quantization_config" in raw_cfg:
        qm = raw_cfg["quantization_config"].get("quant_method", "?") if isinstance(raw_cfg["quantization_config"],
                                                                                dict) else "?"
        raise ValueError(f"{src} is already quantized (quant_method {qm!r}); start from a bf16/fp16/fp32 model")
    config = hf_model.hf_config(raw_cfg, file=cfg_file)
    cdtype = compute_dtype(raw_cfg)
    try:
        net = hf_model.empty_model(config, cdtype)
    except FormatError as e:
        raise FormatError(str(e).removeprefix(f"file {hf_model.CONFIG_FILE}: "), file=cfg_file) from None
    except ValueError as e:  # transformers has no causal LM class for this config
        raise hf_model.UnsupportedModelError(f"{type(config).__name__}: no *ForCausalLM ({e})") from None
    prefix, layers = hf_model.check_supported(net)
    check_architecture(raw_cfg, type(net).__name__, file=cfg_file)
    names = hf_model.checkpoint_names(net)
    expected = dict(net.state_dict())
    head = net.get_output_embeddings()
    head_names = {n for n, m in net.named_modules() if m is head}
    tied = getattr(config, "tie_word_embeddings", False)
    block_of = {n: int(n[len(prefix) + 1:].split(".")[0]) for n in expected if n.startswith(prefix + ".")}
    source = Source(src, raw_cfg, config, SourceWeights(src), net, prefix, layers, block_of, dict.fromkeys(expected),
                    head, head_names, tied, cdtype, names)
    missing = [n for n in expected if not source.available(n) and not (tied and n.rpartition(".")[0] in head_names)
               and n in dict(net.named_parameters())]
    if missing:
        raise ValueError(f"{src}: tensors of the model are missing from its safetensors files: {missing[:4]}")
    check_shapes(source, {n: tuple(t.shape) for n, t in expected.items()}, cfg_file)
    dropped = _drop_tied_head(source) if tied else set()
    used = set(expected) | set(names.original.values()) | {f"{n}.weight" for n in names.experts} | dropped
    ignored = sorted(n for n in source.weights.names() if n not in used)
    if ignored:
        log.warning("ignoring %d source tensors the model does not use: %s", len(ignored), ignored[:4])
    source.tokenizer = checkpoint_tokenizer(src)
    return source


def _drop_tied_head(source: Source) -> set[str]:
    """A tied head's own source tensors: dropped and named if equal to the embedding, else refused → their names."""
    emb = {m: n for n, m in source.net.named_modules()}[source.net.get_input_embeddings()]
    emb_weight = source.on_disk(f"{emb}.weight")
    dropped = set()
    # only the weight is tied: a head's bias (Phi's) is its own
    for key in [n for n in source.expected if n.rpartition(".")[0] in source.head_names and n.endswith(".weight")]:
        own = source.on_disk(key)
        if own is None or own == emb_weight:
            continue
        if emb_weight is None or not source.weights.same(own, emb_weight):
            raise ValueError(f"{source.path}: config.json ties the output head to the input embedding "
                             f"(tie_word_embeddings), but the source holds its own {own}, which differs from "
                             f"{emb_weight}: transformers would keep it, vLLM and latq would use the embedding. Set "
                             f"tie_word_embeddings to false in config.json to keep this head, or remove {own} to "
                             "tie it")
        log.info("config.json ties the output head to the input embedding: dropping the source's %s (equal to %s)",
                 own, emb_weight)
        del source.expected[key]
        dropped.add(own)
    return dropped


def checkpoint_tokenizer(src: Path):
    """The tokenizer the checkpoint of ``src`` will carry, loaded as ``latq-eval`` loads it, or a refusal now."""
    with tempfile.TemporaryDirectory(prefix="latq-tokenizer-") as staged:
        copy_aux_files(src, Path(staged))
        copy_regular(src / hf_model.CONFIG_FILE, Path(staged) / hf_model.CONFIG_FILE, limit=MAX_JSON_BYTES)
        try:
            tok = data.load_tokenizer(staged)
        except ValueError as e:
            why = str(e).removeprefix(f"{staged}: ")
            raise ValueError(f"{src}: {why}; its checkpoint could not be read by latq-eval or served: add the "
                             "model's tokenizer files (tokenizer.json or tokenizer.model, tokenizer_config.json) to "
                             "it") from None
    tok.name_or_path = str(src)   # the source's tokenizer, as messages name it; not the staging copy
    return tok


def check_shapes(source: Source, shapes: dict[str, tuple], config_file: str) -> None:
    """Refuse, naming the source's config.json, a config whose model's tensors (``shapes``, by model
    key) are not the shapes its safetensors headers declare: found before any tensor is read."""
    for key, shape in shapes.items():
        stored = {n: shape for n in [source.on_disk(key)] if n is not None}
        stored |= {f"{n}.weight": (x.rows.stop - x.rows.start, shape[-1]) for n, x in source.names.of_param(key).items()}
        for name, want in stored.items():
            if name not in source.weights.where:
                continue
            f = source.weights.where[name]
            have = tuple(source.weights.handles[f].shape(name))
            if have != tuple(want):
                raise FormatError(f"describes {name} as {tuple(want)}, but {f} holds {have}: config.json does not "
                                  "match the weights", file=config_file)
