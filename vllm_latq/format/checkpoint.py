"""A latq checkpoint directory opened for reading, and the plain transformers model of its
dequantized weights (what ``latq-eval`` measures). Full checks are :mod:`.validate`'s job."""
from __future__ import annotations

import fnmatch
import hashlib
import os
from pathlib import Path

import torch

from .. import hf_model
from ..bounded_io import MAX_JSON_BYTES, OpenedDir, parse_json
from ..model_config import check_config
from ..errors import FormatError, is_resource_error
from ..progress import step
from .files import AUX_PATTERNS, CONFIG_FILE, INDEX_FILE, MANIFEST_FILE, SINGLE_FILE, STATS_FILE, check_no_links_out
from .manifest import check_digest, json_sha256, manifest_digest, read_manifest
from .writer import MAX_AUX_BYTES
from .layer import dequantize_layer, split_name
from .rotation import unrotate
from .safetensors_file import SafetensorsFile
from .spec import parse_quantization_config


def checkpoint_dir(name: str | os.PathLike, revision: str | None = None) -> Path:
    """The directory of checkpoint ``name``: local, or a hub id's snapshot in the local cache (offline)."""
    p = Path(name).expanduser()
    if p.is_dir():
        return p
    from huggingface_hub import try_to_load_from_cache
    try:
        hit = try_to_load_from_cache(str(name), CONFIG_FILE, revision=revision)
    except Exception as e:  # noqa: BLE001  (an id the hub's rules refuse)
        raise FormatError(f"not a directory, nor a model hub id ({type(e).__name__}: {e})", file=str(name)) from None
    if not isinstance(hit, str):
        raise FormatError("not a local directory, and not in the local Hugging Face cache: latq verifies a checkpoint "
                          "before it is served and downloads nothing, so download it whole first (hf download "
                          f"{name}) or pass its directory", file=str(name))
    return Path(hit).parent


def is_latq_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a ``config.json`` with latq's ``quantization_config``."""
    p = Path(path)
    if not p.is_dir() or not os.path.lexists(p / CONFIG_FILE):
        return False
    qc = hf_model.config_dict(p).get("quantization_config")
    return isinstance(qc, dict) and qc.get("quant_method") == "latq"


class Checkpoint:
    """A latq checkpoint directory opened for reading, its files once (``files``: headers parsed, tensors on demand);
    ``expect_digest`` checked first. Once ``checked``, every tensor and sealed file is verified again as read."""

    def __init__(self, path: str | os.PathLike, expect_digest: str | None = None):
        self.path = Path(path)
        if not self.path.is_dir():
            raise FormatError("not a directory" if self.path.exists() else "no such directory", file=str(self.path))
        check_no_links_out(self.path)
        self.files = OpenedDir(self.path)
        self._manifest: dict | None = None
        if expect_digest is not None:   # first: nothing else of another checkpoint matters
            check_digest(self.manifest, expect_digest)
        self.checked = False
        self.config = self._config()
        check_config(self.config)
        if "quantization_config" not in self.config:
            raise FormatError("no quantization_config: not a latq checkpoint", file=CONFIG_FILE)
        self.spec = parse_quantization_config(self.config["quantization_config"], file=CONFIG_FILE)
        self.shards: dict[str, SafetensorsFile] = {}
        self.where: dict[str, str] = {}  # tensor -> shard file name
        self._read_index()

    @property
    def manifest(self) -> dict:
        """``latq_manifest.json``, read once (its form checked)."""
        if self._manifest is None:
            self._manifest = read_manifest(self.files)
        return self._manifest

    @property
    def digest(self) -> str:
        return manifest_digest(self.manifest)

    def _config(self) -> dict:
        name = str(self.path / CONFIG_FILE)
        try:
            d = self.files.read_json(CONFIG_FILE, display=name)
        except FileNotFoundError:
            raise FormatError("missing (not a model directory?)", file=name) from None
        if not isinstance(d, dict):
            raise FormatError("not a JSON object", file=name)
        return d

    def _shard(self, name: str) -> SafetensorsFile:
        return SafetensorsFile(self.path / name, file=self.files.file(name))

    def _read_index(self) -> None:
        if self.files.exists(INDEX_FILE):   # a FIFO or device in its place is refused by the reader, naming it
            index = self.files.read_json(INDEX_FILE)
            wm = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
                raise FormatError("weight_map must map tensor names to shard file names", file=INDEX_FILE)
            for shard in sorted(set(wm.values())):
                if Path(shard).name != shard or not shard.endswith(".safetensors"):
                    raise FormatError(f"invalid shard file name {shard!r}", file=INDEX_FILE)
                if not self.files.exists(shard):
                    raise FormatError(f"shard {shard} listed in the index is missing", file=INDEX_FILE)
                self.shards[shard] = self._shard(shard)
            for name, shard in wm.items():
                if name not in self.shards[shard]:
                    raise FormatError(f"listed in {INDEX_FILE} but not in the file", file=shard, tensor=name)
            for shard, f in self.shards.items():
                for name in f.names():
                    if wm.get(name) != shard:
                        raise FormatError(f"not listed under this file in {INDEX_FILE}", file=shard, tensor=name)
            self.where = dict(wm)
        elif self.files.exists(SINGLE_FILE):
            f = self.shards[SINGLE_FILE] = self._shard(SINGLE_FILE)
            self.where = {n: SINGLE_FILE for n in f.names()}
        else:
            raise FormatError(f"no {INDEX_FILE} and no {SINGLE_FILE}", file=str(self.path))

    def sealed_bytes(self, name: str, limit: int = MAX_AUX_BYTES) -> bytes:
        """File ``name``'s bytes; once ``checked``, refused unless those the manifest seals."""
        data = self.files.read(name, limit)
        if self.checked:
            if name == STATS_FILE:
                ok = json_sha256(parse_json(data, name=name)) == self.manifest[STATS_FILE]
            else:
                ok = hashlib.sha256(data).hexdigest() == self.manifest["files"].get(name)
            if not ok:
                raise FormatError(f"differs from the file verified (sha256 in {MANIFEST_FILE}): changed after the "
                                  "check", file=name)
        return data

    def aux_files(self) -> list[str]:
        """The tokenizer, chat-template and generation files held (:data:`~.files.AUX_PATTERNS`)."""
        return sorted(n for n in self.files.held() if any(fnmatch.fnmatchcase(n, p) for p in AUX_PATTERNS))

    def write_aux_files(self, out: Path) -> list[str]:
        """Write :meth:`aux_files` (:meth:`sealed_bytes`) into directory ``out`` → their names."""
        names = self.aux_files()
        for n in names:
            (out / n).write_bytes(self.sealed_bytes(n))
        return names

    # ---------------------------------------------------------------- structure

    def layers(self) -> dict[str, dict[str, str]]:
        """{quantized module: {suffix: tensor name}} in file order."""
        out: dict[str, dict[str, str]] = {}
        for name in self.where:
            s = split_name(name)
            if s is not None:
                out.setdefault(s[0], {})[s[1]] = name
        return out

    def plain_names(self) -> list[str]:
        return [n for n in self.where if split_name(n) is None]

    def tensor(self, name: str, verify: bool | None = None) -> torch.Tensor:
        """Tensor ``name``, its bytes checked as read with ``verify`` (default: once ``checked``)."""
        return self.shards[self.where[name]].get(name, verify=self.checked if verify is None else verify)

    def stored(self, name: str):
        """Tensor ``name`` to copy by pieces, checked as copied once ``checked``."""
        return self.shards[self.where[name]].stored(name, verify=self.checked)

    def layer_tensors(self, module: str, verify: bool | None = None) -> dict[str, torch.Tensor]:
        return {sfx: self.tensor(n, verify) for sfx, n in self.layers()[module].items()}

    def layer_file(self, module: str) -> str:
        return self.where[next(iter(self.layers()[module].values()))]

    def hf_config(self):
        return hf_model.hf_config(self.config)

    def empty_model(self, dtype: torch.dtype = torch.float32):
        """The model of ``config.json`` on the meta device (FormatError if it cannot be built)."""
        config = self.hf_config()
        try:
            return hf_model.empty_model(config, dtype)
        except FormatError:
            raise
        except Exception as e:  # transformers/torch raise many kinds on a bad config
            if is_resource_error(e):   # a limit of the machine, not a bad checkpoint
                raise
            raise FormatError(f"cannot build the model: {type(e).__name__}: {e}", file=CONFIG_FILE) from None

    def stats(self) -> dict:
        try:
            st = parse_json(self.sealed_bytes(STATS_FILE, MAX_JSON_BYTES), name=STATS_FILE)
        except FileNotFoundError:
            raise FormatError("missing", file=STATS_FILE) from None
        if not isinstance(st, dict) or not isinstance(st.get("layers"), list):
            raise FormatError('must be an object with a "layers" list', file=STATS_FILE)
        _check_stats_integers(st)
        return st

    def checkpoint_names(self, model) -> hf_model.CheckpointNames:
        """How ``model`` is named here (per-expert layers, renamed tensors)."""
        try:
            return hf_model.checkpoint_names(model)
        except hf_model.UnsupportedModelError as e:
            raise FormatError(str(e), file=CONFIG_FILE) from None

    def dequantized_tensors(self, dtype: torch.dtype = torch.float32):
        """Yield ``(name, tensor)``: quantized layers dequantized (a rotated checkpoint's rotated back,
        ``Q·Rᵀ``), the rest cast to ``dtype``."""
        spec = self.spec
        model = self.empty_model(dtype)
        ck_names = self.checkpoint_names(model)
        for module, names in self.layers().items():
            shape = linear_shape(model, module, self.where[next(iter(names.values()))], ck_names)
            t = {sfx: self.tensor(n) for sfx, n in names.items()}
            try:
                W = dequantize_layer(t, spec.kind, shape, spec.bits_of(module), spec.group_size)
            except ValueError as e:   # e.g. a Huffman chunk table that does not fit its stream
                raise FormatError(f"does not decode: {e}", file=self.where[next(iter(names.values()))],
                                  tensor=names.get("hstream" if spec.kind == "huffman" else "qweight", module)) from e
            if spec.rotation is not None:   # the stored integers quantize W·R: the layer serves Q·Rᵀ
                W = unrotate(W, spec.rotation.signs(shape[1]))
            yield f"{module}.weight", W.to(dtype)
        for name in self.plain_names():
            yield name, self.tensor(name).to(dtype)


# the stats file's integers, per layer: 64.0 == 64 in Python, so a float would pass the comparisons
STATS_INTEGERS = ("group_size", "rotation_block", "hessian_tokens", "overloads", "expert", "expert_tokens")


def _check_stats_integers(st: dict) -> None:
    """Refuse a JSON number other than an integer where the stats file means one, naming the layer."""
    if "format_version" in st and type(st["format_version"]) is not int:
        raise FormatError(f"format_version must be a JSON integer, got {st['format_version']!r}", file=STATS_FILE)
    for s in st["layers"]:
        if not isinstance(s, dict):
            continue
        shape = s.get("shape")
        bad = [(k, "a JSON integer") for k in STATS_INTEGERS if s.get(k) is not None and type(s[k]) is not int]
        if shape is not None and not (isinstance(shape, list) and all(type(d) is int for d in shape)):
            bad.append(("shape", "a list of JSON integers"))
        if bad:
            raise FormatError(f"{bad[0][0]} must be {bad[0][1]}, got {s[bad[0][0]]!r}", file=STATS_FILE,
                              tensor=s.get("name") if isinstance(s.get("name"), str) else None)


def linear_shape(model, module: str, file: str, names: hf_model.CheckpointNames) -> tuple[int, int]:
    """``(out, in)`` of the linear (or expert's linear) stored as ``module``; else FormatError."""
    x = names.experts.get(module)
    if x is not None:
        return x.rows.stop - x.rows.start, model.get_parameter(x.param).shape[2]
    try:
        m = model.get_submodule(names.model_key(f"{module}.weight").removesuffix(".weight"))
    except AttributeError:
        m = None
    if not isinstance(m, torch.nn.Linear):
        raise FormatError(f"quantized tensors for {module}, which is not a linear layer of the model",
                          file=file, tensor=module)
    return m.out_features, m.in_features


def load_dequantized_model(path: "str | os.PathLike | Checkpoint", dtype: torch.dtype = torch.float32, device="cpu",
                           progress: bool = False):
    """A plain transformers model holding the format's dequantized weights (no kernel); ``path``: or a Checkpoint."""
    ck = path if isinstance(path, Checkpoint) else Checkpoint(path)
    model = ck.empty_model(dtype)
    names = ck.checkpoint_names(model)
    expected = set(model.state_dict())
    filled: dict[str, int] = {}
    with step(f"loading {ck.path} dequantized to {str(dtype).removeprefix('torch.')}", progress,
              total=len(ck.layers()) + len(ck.plain_names()), unit="tensor") as advance:
        for name, t in ck.dequantized_tensors(dtype):
            _place(model, names, expected, filled, ck, name, t.to(device))
            advance(1)
    partial = sorted(p for p, n in filled.items() if n != len(names.of_param(p)))
    if partial:
        raise FormatError(f"experts parameters with some experts' layers missing: {partial[:3]}", file=str(ck.path))
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        raise FormatError(f"missing tensors: {missing[:5]}{' ...' if len(missing) > 5 else ''}", file=str(ck.path))
    return model.to(device).eval()


def _place(model, names: hf_model.CheckpointNames, expected: set[str], filled: dict[str, int], ck: Checkpoint,
           name: str, t: torch.Tensor) -> None:
    """Checkpoint tensor ``name`` into ``model``: its parameter, or its expert's rows (counted in ``filled``)."""
    x = names.experts.get(name.removesuffix(".weight"))
    if x is not None:
        if model.get_parameter(x.param).device.type == "meta":
            hf_model.set_tensor(model, x.param, torch.empty(model.get_parameter(x.param).shape, dtype=t.dtype,
                                                            device=t.device))
        model.get_parameter(x.param).data[x.expert, x.rows] = t
        filled[x.param] = filled.get(x.param, 0) + 1
        return
    key = names.model_key(name)
    if key not in expected:
        raise FormatError("not a parameter of the model", file=ck.where.get(name), tensor=name)
    hf_model.set_tensor(model, key, t)
