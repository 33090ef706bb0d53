"""The source model: where it is (a directory, a ``.gguf`` file, a reference name), its
tensors (read one at a time from its safetensors) and what the pipeline does with each —
the decoder blocks' linears are quantized, the rest is kept as it is.

The model itself is built on the meta device (:func:`open_source`): a block's weights are
loaded just before it is calibrated and dropped after it is written.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..format.files import INDEX_FILE, SINGLE_FILE
from ..format.safetensors_file import SafetensorsFile
from .. import hf_model
from .. import data

log = logging.getLogger("vllm_latq.quantize")


def resolve_model(spec: str | os.PathLike) -> Path:
    """An HF model directory for ``spec``: a directory with config.json, a ``.gguf`` file
    (converted once into ``cache_dir()/converted``), or a name from ``data.MODELS``."""
    s = str(spec)
    if s in data.MODELS:
        return data.model_dir(s)
    p = Path(s).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise FileNotFoundError(f"GGUF file not found: {p}")
        st = p.resolve().stat()
        key = hashlib.sha256(f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]
        out = data.cache_dir() / "converted" / f"{p.stem}-{key}"
        if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
            return out
        from filelock import FileLock
        out.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(out) + ".lock"):
            if not ((out / "config.json").is_file() and any(out.glob("*.safetensors"))):
                log.info("converting %s to a Hugging Face directory in %s (once)", p, out)
                data.convert_gguf(p, out)
        return out
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"{p} has no config.json: not a Hugging Face model directory")
        return p
    raise FileNotFoundError(f"model {s!r}: not a Hugging Face model directory, a .gguf file, or one of "
                            f"{sorted(data.MODELS)}")


class SourceWeights:
    """Tensors of a safetensors HF directory, read one at a time into memory the caller owns.
    Not memory-mapped: pages of a mapped file stay in the process's resident set until the
    file is closed, so reading a model block by block through maps grows RSS to the model's size."""

    def __init__(self, d: Path):
        idx = d / INDEX_FILE
        if idx.is_file():
            files = sorted(set(json.loads(idx.read_text())["weight_map"].values()))
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


@dataclass
class Source:
    """A source model opened for quantization: its directory and config, its tensors, and
    the model built on the meta device in the calibration forwards' dtype."""
    path: Path
    raw_config: dict            # config.json as written
    config: object              # the transformers config
    weights: SourceWeights
    net: torch.nn.Module        # on the meta device until a part of it is loaded
    prefix: str                 # the decoder blocks' module name, e.g. "model.layers", "transformer.h"
    layers: torch.nn.ModuleList
    block_of: dict[str, int]    # source tensor name -> its decoder block
    expected: dict              # the model's state-dict names (keys; in the model's order)
    head: torch.nn.Module       # the output head (lm_head)
    head_names: set[str]        # module names of the head
    tied: bool                  # the head shares the input embedding's weight
    dtype: torch.dtype          # of the calibration forwards

    @property
    def nblocks(self) -> int:
        return len(self.layers)

    def block_tensors(self, i: int) -> list[str]:
        """The source tensors of decoder block ``i``."""
        return [n for n in self.weights.names() if self.block_of.get(n) == i]

    def outside_tensors(self) -> list[str]:
        """The parameters outside the blocks and the head (embeddings, final norm), which the
        capture pass needs."""
        params = dict(self.net.named_parameters())
        return [n for n in self.expected if n not in self.block_of
                and not n.rpartition(".")[0] in self.head_names and n in params]

    def load(self, names, device) -> None:
        """Load source tensors ``names`` into the model, on ``device`` in the forwards' dtype."""
        for n in names:
            hf_model.set_tensor(self.net, n, self.weights.get(n).to(device=device, dtype=self.dtype))

    def kept_block_tensors(self, i: int, linears) -> dict[str, torch.Tensor]:
        """Block ``i``'s tensors other than its quantized ``linears``' weights (norms, biases),
        in their original dtype and name."""
        return {n: self.weights.get(n) for n in self.block_tensors(i)
                if not (n.rpartition(".")[0] in linears and n.endswith(".weight"))}

    def block_linears(self, i: int) -> dict[str, torch.nn.Linear]:
        """The linears of decoder block ``i`` by full name: what the pipeline quantizes."""
        return hf_model.block_linears(self.layers[i], f"{self.prefix}.{i}")

    def modules_not_converted(self, head_name: str | None) -> list[str]:
        """The linear and embedding modules that stay unquantized: all but the blocks' linears
        (and the head ``head_name`` when it is quantized)."""
        quantized = {n for i in range(self.nblocks) for n in self.block_linears(i)} | {head_name}
        return sorted(n for n, m in self.net.named_modules()
                      if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)) and n not in quantized)


def open_source(model: str | os.PathLike, compute_dtype) -> Source:
    """Resolve ``model``, refuse an already quantized or unsupported one, and build it on the
    meta device in the dtype ``compute_dtype(config.json)`` chose; warn about source tensors
    the model does not use, refuse a source missing some it does."""
    src = resolve_model(model)
    raw_cfg = hf_model.config_dict(src)
    if "quantization_config" in raw_cfg:
        qm = raw_cfg["quantization_config"].get("quant_method", "?") if isinstance(raw_cfg["quantization_config"],
                                                                                dict) else "?"
        raise ValueError(f"{src} is already quantized (quant_method {qm!r}); start from a bf16/fp16/fp32 model")
    config = hf_model.hf_config(raw_cfg)
    cdtype = compute_dtype(raw_cfg)
    try:
        net = hf_model.empty_model(config, cdtype)
    except ValueError as e:  # transformers has no causal LM class for this config
        raise hf_model.UnsupportedModelError(f"{type(config).__name__}: no *ForCausalLM ({e})") from None
    prefix, layers = hf_model.check_supported(net)
    sources = SourceWeights(src)
    expected = dict(net.state_dict())
    head = net.get_output_embeddings()
    head_names = {n for n, m in net.named_modules() if m is head}
    tied = getattr(config, "tie_word_embeddings", False)
    missing = [n for n in expected
               if n not in sources.where and not (tied and n.rpartition(".")[0] in head_names)
               and n in dict(net.named_parameters())]
    if missing:
        raise ValueError(f"{src}: tensors of the model are missing from its safetensors files: {missing[:4]}")
    block_of = {}
    for n in sources.names():
        if n.startswith(prefix + "."):
            block_of[n] = int(n[len(prefix) + 1:].split(".")[0])
    ignored = sorted(n for n in sources.names() if n not in expected)
    if ignored:
        log.warning("ignoring %d source tensors the model does not use: %s", len(ignored), ignored[:4])
    return Source(src, raw_cfg, config, sources, net, prefix, layers, block_of, dict.fromkeys(expected), head,
                  head_names, tied, cdtype)
