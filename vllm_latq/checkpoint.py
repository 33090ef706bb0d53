"""The latq checkpoint directory: shards, index, ``config.json``, stats — write, read,
validate (``latq-inspect``) and dequantize. ``docs/FORMAT.md`` is the prose version.

A checkpoint is a Hugging Face model directory::

    config.json                     the model's config + quantization_config (format.py)
    model-00001-of-000NN.safetensors  one shard per decoder block, then one for the rest
    model.safetensors.index.json    {"metadata": {"total_size"}, "weight_map": {tensor: shard}}
    latq_stats.json                 per-layer bits, outlier rate, error, certificate
    tokenizer*, generation_config.json, ...   copied from the source model

Per-layer tensors are defined in :mod:`vllm_latq.format`; every other tensor (embeddings,
norms, biases, lm_head) keeps its original name, shape and dtype. Each shard's safetensors
metadata holds ``latq_sha256``: a JSON object {tensor name: sha256 of its bytes}.

Reading goes through :class:`SafetensorsFile`, a strict parser of the safetensors layout
that raises :class:`~vllm_latq.format.FormatError` (naming the file and tensor) on any
inconsistency instead of the library's panics, so a corrupted file can never crash or
hang a reader.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import shutil
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from . import format as fmt
from .format import FormatError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
STATS_FILE = "latq_stats.json"
CONFIG_FILE = "config.json"
CHECKSUM_KEY = "latq_sha256"
# Files copied verbatim from the source model (tokenizer, chat template, generation defaults).
AUX_PATTERNS = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
                "chat_template*", "generation_config.json")
MAX_HEADER = 100 << 20  # a safetensors header larger than this is corrupt

SUPPORTED_MODEL_TYPES = {
    "llama": "Llama-style (LlamaForCausalLM: SmolLM2, Llama 2/3)",
    "qwen2": "Qwen2 (Qwen2ForCausalLM)",
    "qwen3": "Qwen3 (Qwen3ForCausalLM)",
    "gemma3_text": "Gemma3 text-only (Gemma3ForCausalLM)",
}


class UnsupportedModelError(ValueError):
    """The model's architecture is not one the pipeline knows how to walk block by block."""


# ============================================================================ safetensors

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
_ITEMSIZE = {k: torch.empty(0, dtype=v).element_size() for k, v in _DTYPES.items()}


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw little-endian bytes safetensors stores for ``t``."""
    t = t.detach().cpu().contiguous()
    if t.numel() == 0:
        return b""
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(tensor_bytes(t)).hexdigest()


_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


def write_safetensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor],
                      metadata: dict[str, str] | None = None) -> None:
    """Write a safetensors file with a ``latq_sha256`` checksum table in the metadata,
    atomically (``path.part`` then rename).

    Our own serializer, because the safetensors library orders the metadata keys by a
    randomized hash map: here the header is compact JSON with sorted keys, tensors are laid
    out contiguously in name order and the header is space-padded to 8 bytes, so the bytes
    depend only on the tensors and the metadata (and the library reads the file as usual)."""
    path = Path(path)
    tensors = {k: v.detach().cpu().contiguous() for k, v in sorted(tensors.items())}
    meta = {"format": "pt", **(metadata or {})}
    meta[CHECKSUM_KEY] = json.dumps({k: sha256(v) for k, v in tensors.items()}, sort_keys=True,
                                    separators=(",", ":"))
    header: dict = {"__metadata__": dict(sorted(meta.items()))}
    off = 0
    for k, v in tensors.items():
        if v.dtype not in _DTYPE_NAMES:
            raise TypeError(f"{k}: dtype {v.dtype} cannot be stored")
        n = v.numel() * v.element_size()
        header[k] = {"dtype": _DTYPE_NAMES[v.dtype], "shape": list(v.shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    part = path.with_name(path.name + ".part")
    with part.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for v in tensors.values():
            f.write(tensor_bytes(v))
    os.replace(part, path)


@dataclass(frozen=True)
class _Entry:
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


class SafetensorsFile:
    """A strict reader of one ``.safetensors`` file. The header is parsed and checked at
    construction (sizes, dtypes, shapes, offsets in range and non-overlapping); tensors are
    read on demand. Every problem is a :class:`FormatError` naming the file (and tensor)."""

    def __init__(self, path: str | os.PathLike, display: str | None = None):
        self.path = Path(path)
        self.name = display or self.path.name
        try:
            size = self.path.stat().st_size
            with self.path.open("rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise self._err(f"truncated: {size} bytes, too short for a safetensors header")
                (n,) = struct.unpack("<Q", head)
                if n > min(MAX_HEADER, size - 8):
                    raise self._err(f"header length {n} exceeds the file ({size} bytes): truncated or corrupt")
                raw = f.read(n)
        except OSError as e:
            raise self._err(f"cannot read: {e}") from None
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise self._err(f"header is not valid JSON ({e})") from None
        if not isinstance(header, dict):
            raise self._err("header is not a JSON object")
        self.data_start = 8 + n
        self.data_len = size - self.data_start
        meta = header.pop("__metadata__", {})
        if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
            raise self._err("__metadata__ must map strings to strings")
        self.metadata: dict[str, str] = meta
        self.entries: dict[str, _Entry] = {}
        for name, e in header.items():
            self.entries[name] = self._entry(name, e)
        spans = sorted((e.begin, e.end, k) for k, e in self.entries.items() if e.end > e.begin)
        for (b0, e0, k0), (b1, e1, k1) in zip(spans, spans[1:]):
            if b1 < e0:
                raise self._err(f"data of tensors {k0} and {k1} overlap", k1)
        self._checksums: dict[str, str] | None = None

    def _err(self, what: str, tensor: str | None = None) -> FormatError:
        return FormatError(what, file=self.name, tensor=tensor)

    def _entry(self, name: str, e) -> _Entry:
        if not isinstance(e, dict):
            raise self._err("header entry is not an object", name)
        dtype, shape, offs = e.get("dtype"), e.get("shape"), e.get("data_offsets")
        if dtype not in _DTYPES:
            raise self._err(f"unsupported dtype {dtype!r}", name)
        if (not isinstance(shape, list) or len(shape) > 8
                or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**40 for d in shape)):
            raise self._err(f"invalid shape {shape!r}", name)
        if (not isinstance(offs, list) or len(offs) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)):
            raise self._err(f"invalid data_offsets {offs!r}", name)
        begin, end = offs
        nbytes = math.prod(shape) * _ITEMSIZE[dtype]
        if not 0 <= begin <= end:
            raise self._err(f"invalid data_offsets {offs!r}", name)
        if end - begin != nbytes:
            raise self._err(f"shape {tuple(shape)} {dtype} needs {nbytes} bytes, data_offsets span {end - begin}",
                            name)
        if end > self.data_len:
            raise self._err(f"truncated: data ends at byte {end}, the file holds {self.data_len} data bytes", name)
        return _Entry(dtype, tuple(shape), begin, end)

    # ---------------------------------------------------------------- access

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def names(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name].shape

    def dtype(self, name: str) -> torch.dtype:
        return _DTYPES[self.entries[name].dtype]

    def raw(self, name: str) -> bytes:
        e = self.entries[name]
        try:
            with self.path.open("rb") as f:
                f.seek(self.data_start + e.begin)
                b = f.read(e.end - e.begin)
        except OSError as err:
            raise self._err(f"cannot read: {err}", name) from None
        if len(b) != e.end - e.begin:
            raise self._err("truncated while reading", name)
        return b

    def get(self, name: str) -> torch.Tensor:
        """The tensor (a fresh CPU tensor that owns its memory)."""
        if name not in self.entries:
            raise self._err("missing", name)
        e = self.entries[name]
        dtype = _DTYPES[e.dtype]
        b = self.raw(name)
        if not b:
            return torch.empty(e.shape, dtype=dtype)
        return torch.frombuffer(bytearray(b), dtype=torch.uint8).view(dtype).reshape(e.shape)

    @property
    def checksums(self) -> dict[str, str] | None:
        """{tensor: sha256} from the metadata, or None when the file has none."""
        if self._checksums is None and CHECKSUM_KEY in self.metadata:
            try:
                c = json.loads(self.metadata[CHECKSUM_KEY])
            except ValueError:
                c = None
            if not isinstance(c, dict) or not all(isinstance(v, str) for v in c.values()):
                raise self._err(f"metadata {CHECKSUM_KEY} is not a JSON object of hex digests")
            self._checksums = c
        return self._checksums

    def verify(self, name: str) -> None:
        """Raise unless the tensor's bytes match its recorded sha256 (no-op without checksums)."""
        sums = self.checksums
        if sums is None:
            return
        if name not in sums:
            raise self._err(f"no checksum recorded in {CHECKSUM_KEY}", name)
        if hashlib.sha256(self.raw(name)).hexdigest() != sums[name]:
            raise self._err("sha256 mismatch: the tensor's bytes are corrupted", name)


# ============================================================================ models

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


# ============================================================================ reading

class Checkpoint:
    """A latq checkpoint directory opened for reading (headers only; tensors on demand)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_dir():
            raise FormatError("not a directory", file=str(self.path))
        self.config = config_dict(self.path)
        if "quantization_config" not in self.config:
            raise FormatError("no quantization_config: not a latq checkpoint", file=CONFIG_FILE)
        self.spec = fmt.parse_quantization_config(self.config["quantization_config"], file=CONFIG_FILE)
        self.shards: dict[str, SafetensorsFile] = {}
        self.where: dict[str, str] = {}  # tensor -> shard file name
        self._read_index()

    def _read_index(self) -> None:
        idx = self.path / INDEX_FILE
        if idx.is_file():
            try:
                index = json.loads(idx.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, ValueError) as e:
                raise FormatError(f"not valid JSON ({e})", file=INDEX_FILE) from None
            wm = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
                raise FormatError("weight_map must map tensor names to shard file names", file=INDEX_FILE)
            for shard in sorted(set(wm.values())):
                if Path(shard).name != shard or not shard.endswith(".safetensors"):
                    raise FormatError(f"invalid shard file name {shard!r}", file=INDEX_FILE)
                if not (self.path / shard).is_file():
                    raise FormatError(f"shard {shard} listed in the index is missing", file=INDEX_FILE)
                self.shards[shard] = SafetensorsFile(self.path / shard)
            for name, shard in wm.items():
                if name not in self.shards[shard]:
                    raise FormatError(f"listed in {INDEX_FILE} but not in the file", file=shard, tensor=name)
            for shard, f in self.shards.items():
                for name in f.names():
                    if wm.get(name) != shard:
                        raise FormatError(f"not listed under this file in {INDEX_FILE}", file=shard, tensor=name)
            self.where = dict(wm)
        elif (self.path / SINGLE_FILE).is_file():
            f = self.shards[SINGLE_FILE] = SafetensorsFile(self.path / SINGLE_FILE)
            self.where = {n: SINGLE_FILE for n in f.names()}
        else:
            raise FormatError(f"no {INDEX_FILE} and no {SINGLE_FILE}", file=str(self.path))

    # ---------------------------------------------------------------- structure

    def layers(self) -> dict[str, dict[str, str]]:
        """{quantized module: {suffix: tensor name}} in file order."""
        out: dict[str, dict[str, str]] = {}
        for name in self.where:
            s = fmt.split_name(name)
            if s is not None:
                out.setdefault(s[0], {})[s[1]] = name
        return out

    def plain_names(self) -> list[str]:
        return [n for n in self.where if fmt.split_name(n) is None]

    def tensor(self, name: str, verify: bool = False) -> torch.Tensor:
        f = self.shards[self.where[name]]
        if verify:
            f.verify(name)
        return f.get(name)

    def layer_tensors(self, module: str, verify: bool = False) -> dict[str, torch.Tensor]:
        return {sfx: self.tensor(n, verify) for sfx, n in self.layers()[module].items()}

    def layer_file(self, module: str) -> str:
        return self.where[next(iter(self.layers()[module].values()))]

    def hf_config(self):
        return hf_config(self.config)

    def empty_model(self, dtype: torch.dtype = torch.float32):
        """The model of ``config.json`` on the meta device (FormatError if it cannot be built)."""
        config = self.hf_config()
        try:
            return empty_model(config, dtype)
        except Exception as e:  # transformers/torch raise many kinds on a bad config
            raise FormatError(f"cannot build the model: {type(e).__name__}: {e}", file=CONFIG_FILE) from None

    def stats(self) -> dict:
        f = self.path / STATS_FILE
        try:
            st = json.loads(f.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise FormatError("missing", file=STATS_FILE) from None
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise FormatError(f"not valid JSON ({e})", file=STATS_FILE) from None
        if not isinstance(st, dict) or not isinstance(st.get("layers"), list):
            raise FormatError('must be an object with a "layers" list', file=STATS_FILE)
        return st

    def dequantized_tensors(self, dtype: torch.dtype = torch.float32):
        """Yield ``(name, tensor)`` of the plain model: quantized layers as ``{module}.weight``
        dequantized by :func:`format.dequantize_layer`, the rest cast to ``dtype``."""
        spec = self.spec
        model = self.empty_model(dtype)
        for module, names in self.layers().items():
            shape = _linear_shape(model, module, self.where[next(iter(names.values()))])
            t = {sfx: self.tensor(n) for sfx, n in names.items()}
            yield f"{module}.weight", fmt.dequantize_layer(t, spec.kind, shape, spec.bits_of(module), spec.group_size).to(dtype)
        for name in self.plain_names():
            yield name, self.tensor(name).to(dtype)


def _linear_shape(model, module: str, file: str) -> tuple[int, int]:
    try:
        m = model.get_submodule(module)
    except AttributeError:
        m = None
    if not isinstance(m, torch.nn.Linear):
        raise FormatError(f"quantized tensors for {module}, which is not a linear layer of the model",
                          file=file, tensor=module)
    return m.out_features, m.in_features


def load_dequantized_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32, device="cpu"):
    """A plain transformers model whose quantized linears hold ``format.dequantize_layer``'s
    weights (independent of any kernel): what ``latq-eval`` measures."""
    ck = Checkpoint(path)
    model = ck.empty_model(dtype)
    expected = set(model.state_dict())
    for name, t in ck.dequantized_tensors(dtype):
        if name not in expected:
            raise FormatError("not a parameter of the model", file=ck.where.get(name), tensor=name)
        set_tensor(model, name, t.to(device))
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        raise FormatError(f"missing tensors: {missing[:5]}{' ...' if len(missing) > 5 else ''}", file=str(path))
    return model.to(device).eval()


# ============================================================================ validation

def validate_checkpoint(path: str | os.PathLike, *, decode: bool = True, verify_checksums: bool = True,
                        progress: bool = False) -> dict:
    """Check everything about a checkpoint and return its report ``{"layers": [...], "totals":
    {...}, "spec": QuantSpec}``. Raises :class:`FormatError` naming file and tensor on the
    first problem: config, index/shard consistency, safetensors headers, checksums, every
    layer's tensors (:func:`format.validate_layer`, with ``decode`` the Huffman streams are
    decoded), the bit budget, plain tensors' shapes against a meta-device model built from
    ``config.json``, and the stats file."""
    ck = Checkpoint(path)
    spec = ck.spec
    model = ck.empty_model(torch.float32)
    try:
        decoder_layers(model)
    except UnsupportedModelError as e:
        raise FormatError(str(e), file=CONFIG_FILE) from None
    expected = dict(model.state_dict(keep_vars=True))
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()

    rank = {n: i for i, (n, _) in enumerate(model.named_modules())}
    layers = dict(sorted(ck.layers().items(), key=lambda kv: (rank.get(kv[0], len(rank)), kv[0])))
    rows, covered = [], set()
    it = layers.items()
    if progress:
        from tqdm.auto import tqdm
        it = tqdm(it, desc="validating", unit="layer", total=len(layers))
    for module, names in it:
        files = {ck.where[n] for n in names.values()}
        file = sorted(files)[0]
        if len(files) > 1:
            raise FormatError(f"tensors of one layer are split over {sorted(files)}", file=file, tensor=module)
        if f"{module}.weight" in ck.where:
            raise FormatError("stored both quantized and as a plain weight", file=file, tensor=f"{module}.weight")
        if not spec.is_converted(module):
            raise FormatError("quantized, but listed in quantization_config.modules_not_converted", file=file,
                              tensor=module)
        shape = _linear_shape(model, module, file)
        if verify_checksums:
            for n in names.values():
                ck.shards[file].verify(n)
        t = {sfx: ck.tensor(n) for sfx, n in names.items()}
        fmt.validate_layer(t, spec.kind, shape, spec.bits_of(module), spec.group_size, layer=module, file=file,
                           decode=decode)
        st = fmt.check_budget(t, spec, shape, layer=module, file=file)
        covered.add(f"{module}.weight")
        rows.append({"name": module, "kind": spec.kind, "shape": list(shape), **st})

    stray = [m for m, _ in spec.layer_bits if m not in layers]
    if stray:
        raise FormatError(f"quantization_config.layer_bits names {stray}, which are not quantized layers of the "
                          "checkpoint", file=CONFIG_FILE)

    for name in ck.plain_names():
        file = ck.where[name]
        if name not in expected:
            raise FormatError("unexpected tensor: not a parameter of the model in config.json", file=file, tensor=name)
        want = expected[name]
        f = ck.shards[file]
        if f.shape(name) != tuple(want.shape):
            raise FormatError(f"shape {f.shape(name)}, expected {tuple(want.shape)} from config.json", file=file,
                              tensor=name)
        if not f.dtype(name).is_floating_point:
            raise FormatError(f"dtype {f.dtype(name)}, expected a floating-point dtype", file=file, tensor=name)
        if verify_checksums:
            f.verify(name)
        covered.add(name)
    persistent = {n for n in expected if n not in dict(model.named_buffers())}
    missing = sorted(persistent - covered - tied)
    if missing:
        raise FormatError(f"missing tensors {missing[:4]}{' ...' if len(missing) > 4 else ''} (neither stored "
                          "nor quantized)", file=INDEX_FILE if (ck.path / INDEX_FILE).exists() else SINGLE_FILE)

    stats = {s.get("name"): s for s in ck.stats()["layers"] if isinstance(s, dict)}
    for r in rows:
        s = stats.get(r["name"])
        if s is None:
            raise FormatError("no entry for this layer", file=STATS_FILE, tensor=r["name"])
        if not isinstance(s.get("bits"), (int, float)) or abs(s["bits"] - r["bits"]) > 1e-6:
            raise FormatError(f"bits {s.get('bits')!r} disagree with the stored tensors ({r['bits']:.6f})",
                              file=STATS_FILE, tensor=r["name"])
        r["rel_error"] = s.get("rel_error")
        r["cert"] = s.get("cert")
    if set(stats) - {r["name"] for r in rows}:
        extra = sorted(set(stats) - {r["name"] for r in rows})[:3]
        raise FormatError(f"entries for layers that are not in the checkpoint: {extra}", file=STATS_FILE)
    return {"layers": rows, "totals": _totals(ck, rows, model), "spec": spec}


def _totals(ck: Checkpoint, rows: list[dict], model) -> dict:
    qparams = sum(r["shape"][0] * r["shape"][1] for r in rows)
    qbits = sum(r["bits"] * r["shape"][0] * r["shape"][1] for r in rows)
    nbytes = sum(ck.shards[ck.where[n]].entries[n].end - ck.shards[ck.where[n]].entries[n].begin for n in ck.where)
    params = sum(p.numel() for p in model.parameters())
    return {"layers": len(rows), "quantized_params": qparams,
            "bits_per_weight": qbits / qparams if qparams else 0.0,
            "outlier_rate": sum(r["outlier_rate"] * r["shape"][0] * r["shape"][1] for r in rows) / qparams
            if qparams else 0.0,
            "params": params, "tensor_bytes": nbytes, "bits_per_param_all": 8 * nbytes / params if params else 0.0}


def format_report(report: dict) -> str:
    spec: fmt.QuantSpec = report["spec"]
    budget = (f"{spec.bits}-bit g{spec.group_size}" + (f", outlier rate ≤ {spec.outlier_rate:g}"
                                                        if spec.method == "ssqr" else "")
              + "".join(f", {m} {b}-bit" for m, b in spec.layer_bits)
              if spec.kind == "dense" else f"target {spec.target_bits:g} bits/weight")
    lines = [f"latq format v{fmt.FORMAT_VERSION} · method {spec.method} ({spec.kind}) · {budget}"
             f" · order {spec.order} · damp {spec.damp}",
             f"{'layer':44s} {'shape':>11s} {'bits/w':>7s} {'outl%':>6s} {'rel.err':>9s} {'cert':>6s}"]

    def f(x, spec_):
        return format(x, spec_) if isinstance(x, (int, float)) else "—"
    for r in report["layers"]:
        shp = "x".join(map(str, r["shape"]))
        lines.append(f"{r['name']:44s} {shp:>11s} {r['bits']:7.3f} {100 * r['outlier_rate']:6.3f} "
                     f"{f(r['rel_error'], '9.2e'):>9s} {f(r['cert'], '6.3f'):>6s}")
    t = report["totals"]
    lines.append(f"total: {t['layers']} quantized layers, {t['quantized_params']:,} weights at "
                 f"{t['bits_per_weight']:.4f} bits/weight (outliers {100 * t['outlier_rate']:.3f}%); "
                 f"all tensors {t['tensor_bytes'] / 2**20:.1f} MiB = {t['bits_per_param_all']:.3f} bits/param "
                 f"over {t['params']:,} params (embeddings etc. in the model dtype)")
    return "\n".join(lines)


def inspect_main(argv=None) -> int:
    """``latq-inspect CKPT``: validate a checkpoint and print its per-layer table.
    Exit code 0 if valid, 2 with one error line naming file and tensor otherwise."""
    ap = argparse.ArgumentParser(prog="latq-inspect", description=inspect_main.__doc__)
    ap.add_argument("checkpoint")
    ap.add_argument("--no-decode", action="store_true", help="skip decoding the Huffman streams (faster)")
    ap.add_argument("--no-checksums", action="store_true", help="skip the sha256 verification")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    a = ap.parse_args(argv)
    try:
        report = validate_checkpoint(a.checkpoint, decode=not a.no_decode, verify_checksums=not a.no_checksums,
                                     progress=sys.stderr.isatty())
    except FormatError as e:
        print(f"latq-inspect: invalid checkpoint {a.checkpoint}: {e}", file=sys.stderr)
        return 2
    if a.json:
        out = {k: v for k, v in report.items() if k != "spec"}
        out["quantization_config"] = Checkpoint(a.checkpoint).config["quantization_config"]
        print(json.dumps(out, indent=2))
    else:
        print(format_report(report))
        print(f"OK: {a.checkpoint} is a valid latq checkpoint")
    return 0


# ============================================================================ writing helpers

def shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def write_json(path: Path, obj) -> None:
    """Deterministic JSON (sorted keys, 2-space indent), written atomically."""
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(part, path)


def write_index(out: Path, shards: list[str]) -> None:
    """``model.safetensors.index.json`` from the shard files' headers."""
    wm, total = {}, 0
    for s in shards:
        f = SafetensorsFile(out / s)
        for n in f.names():
            wm[n] = s
            e = f.entries[n]
            total += e.end - e.begin
    write_json(out / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": dict(sorted(wm.items()))})


def copy_aux_files(src: Path, out: Path) -> list[str]:
    """Copy tokenizer / generation / chat-template files; returns their names."""
    names = sorted({p.name for pat in AUX_PATTERNS for p in src.glob(pat) if p.is_file()})
    for n in names:
        shutil.copyfile(src / n, out / n)
    return names


def main():  # pragma: no cover - console script
    sys.exit(inspect_main())


if __name__ == "__main__":  # pragma: no cover
    main()
