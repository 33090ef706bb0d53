"""``LatqConfig``: vLLM's view of a latq checkpoint's ``quantization_config`` (method ``latq``).

Detected without ``--quantization``; a mismatched ``--quantization`` fails before any weight is read."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
from typing import Any

import torch
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase

from .. import format as fmt
from ..bounded_io import MAX_JSON_BYTES, file_sha256
from ..env import EnvError
from ..errors import FormatError, is_resource_error, resource_limit
from ..format.checkpoint import checkpoint_dir
from ..format.files import MANIFEST_FILE
from ..format.manifest import DIGEST_ENV, expected_digest_from_env
from ..format.safetensors_file import SafetensorsFile
from ..format.served_copy import DIGEST_KEY
from ..format.validate import verify_for_serving
from .names import LOAD_FORMAT, checkpoint_module, vllm_module

def content_key(path: str, extra: str = "") -> str:
    """sha256 of the checkpoint's JSON files and shard headers (every tensor's sha256): a key by content."""
    h = hashlib.sha256(f"{extra};".encode())
    for name in sorted(os.listdir(path)):
        f = os.path.join(path, name)
        if name.endswith(".safetensors"):
            h.update(f"{name}:{SafetensorsFile(f).header_sha256};".encode())
        elif name.endswith(".json"):
            h.update(f"{name}:{file_sha256(f, limit=MAX_JSON_BYTES, name=name)};".encode())
    return h.hexdigest()


# vLLM fuses these HF modules into one layer; modules_not_converted names the HF modules.
DEFAULT_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


@functools.cache
def _moe_layer_types() -> tuple[type, ...]:
    """vLLM's layer classes that ask for a MoE method: ``RoutedExperts`` (≥ 0.32), ``FusedMoE``."""
    from vllm.model_executor.layers import fused_moe
    return tuple(c for c in (getattr(fused_moe, n, None) for n in ("RoutedExperts", "FusedMoE"))
                 if isinstance(c, type))


class LatqCheckpointRefused(RuntimeError):
    """The checkpoint is refused (one line naming it, the file and why).
    Not a ValueError: pydantic would fold it into a ValidationError headed by its own words."""


class LatqEnvironmentRefused(RuntimeError):
    """A ``LATQ_*`` environment variable's value is refused (one line naming it and the values it takes)."""


class LatqResourceLimit(RuntimeError):
    """A limit of the machine (``ulimit -n``, ``-v``) reached while checking the checkpoint: one line naming it."""


class LatqConfig(QuantizationConfig):
    """Weight-only latq (SSQR/GPTQ/RTN/Babai dense + CSR, HPTQ/HRTN Huffman) linears."""

    def __init__(self, quant_config: dict | None = None):
        super().__init__()
        if quant_config is None:
            # vLLM instantiates the class without arguments when `--quantization latq` is
            # given for a model whose config.json has no quantization_config.
            raise ValueError(
                "--quantization latq needs a latq checkpoint: the model's config.json has no "
                "quantization_config with quant_method 'latq'. Make one with `latq-quantize MODEL OUT`.")
        # the format validates; module names in it become vLLM's in apply_vllm_mapper
        self.spec: fmt.QuantSpec = fmt.parse_quantization_config(quant_config)
        self.method: str = self.spec.method
        self.kind: str = self.spec.kind
        self.bits: int | None = self.spec.bits
        self.group_size: int | None = self.spec.group_size
        self.scale_bits: int | None = self.spec.scale_bits   # dense: group scales stored as codes
        self.rotation: fmt.Rotation | None = self.spec.rotation   # every layer's input rotated
        # written by `latq-quantize --quantize-lm-head`: the checkpoint stores lm_head.* quantized
        self.lm_head_quantized: bool = self.spec.extra.get("lm_head_quantized") is True
        self.head_built = False   # vLLM built a ParallelLMHead with latq's method

    @functools.cached_property
    def load_report(self):
        """The layers of this model load, shared by its linear methods; logs the summary after the last."""
        from .load_report import LoadReport   # vLLM's layers: imported only when layers are built
        return LoadReport(self.method, self.scale_bits)

    @property
    def modules_not_converted(self) -> list[str]:
        return list(self.spec.modules_not_converted)

    @property
    def layer_bits(self) -> dict[str, int]:
        """module → inlier bits overriding ``bits``."""
        return dict(self.spec.layer_bits)

    def __repr__(self) -> str:
        return (f"LatqConfig(method={self.method}, kind={self.kind}, bits={self.bits}, "
                f"group_size={self.group_size}, scale_bits={self.scale_bits}, modules_not_converted={self.modules_not_converted})")

    # ------------------------------------------------------------------ vLLM interface

    def get_name(self) -> str:
        return "latq"

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 80  # the Triton path (bf16 tensor cores); vLLM does not ask on CPU

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # the config lives in config.json's quantization_config

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "LatqConfig":
        return cls(config)

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None):
        """Claim latq checkpoints unless another ``--quantization`` was given (vLLM reports the mismatch)."""
        method = str((hf_quant_cfg or {}).get("quant_method", "")).lower()
        if method == "latq" and user_quant in (None, "latq"):
            return "latq"
        return None

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

        check_load_format()
        prefix = checkpoint_module(prefix)
        if isinstance(layer, _moe_layer_types()):
            if not self.is_converted(prefix):
                from vllm.model_executor.layers.fused_moe import UnquantizedFusedMoEMethod
                return UnquantizedFusedMoEMethod(layer.moe_config)
            partial = [m for m in self.modules_not_converted if m.startswith(prefix + ".")]
            if partial:
                raise ValueError(f"latq checkpoint: some experts of mixture-of-experts layer {prefix} are listed in "
                                 f"modules_not_converted ({partial[:4]}); vLLM runs a layer's experts with one "
                                 "method: quantize all of them or list the whole layer")
            from .moe_method import LatqMoEMethod
            return LatqMoEMethod(self, layer.moe_config, self.load_report, prefix)
        if isinstance(layer, ParallelLMHead) and self.lm_head_quantized:
            if not self.is_converted(prefix):
                raise ValueError(f"latq checkpoint: quantization_config.lm_head_quantized is true but {prefix} is "
                                 f"listed in modules_not_converted")
            from .linear_method import LatqLinearMethod
            self.head_built = True
            return LatqLinearMethod(self, self.load_report)   # LogitsProcessor calls lm_head.quant_method.apply
        if not isinstance(layer, LinearBase):
            return None  # embeddings, an unquantized lm_head
        if not self.is_converted(prefix):
            return UnquantizedLinearMethod()
        from .linear_method import LatqLinearMethod
        return LatqLinearMethod(self, self.load_report)

    def apply_vllm_mapper(self, hf_to_vllm_mapper) -> None:
        """The spec's module names (HF) → vLLM's, mapped as their tensors are: lookups take vLLM prefixes."""
        from .loading import tensor_names
        tensor = tensor_names(self)[0]

        def mapped(modules):
            return {m: vllm_module(hf_to_vllm_mapper, m, tensor) for m in modules}
        mnc = mapped(self.modules_not_converted)
        bits = mapped(m for m, _ in self.spec.layer_bits)
        self.spec = dataclasses.replace(
            self.spec, modules_not_converted=tuple(v for v in mnc.values() if v is not None),
            layer_bits=tuple(sorted((bits[m], b) for m, b in self.spec.layer_bits if bits[m] is not None)))

    def maybe_update_config(self, model_name: str, hf_config=None, revision=None) -> None:
        """Validate the checkpoint as ``latq-eval`` does, then fingerprint its files into the HF config.
        vLLM keys its torch.compile cache on the configs; a re-quantized checkpoint must not reuse a graph."""
        qc = getattr(hf_config, "quantization_config", None)
        if not isinstance(qc, dict):
            return
        from ..kernels import selector
        try:   # the switches the workers read, refused here where vLLM shows it: not in a worker's traceback
            selector.check_environment()
            forced = selector.forced_kernel()
        except EnvError as e:
            raise LatqEnvironmentRefused(f"latq: {e}") from None
        # before vLLM reads a tensor, once per load (workers get this config pickled);
        # LATQ_NO_VERIFY skips the sha256 checks only
        served = qc.get(DIGEST_KEY)   # latq-serve's check, in the config it handed vLLM (format/served_copy.py)
        try:
            path = checkpoint_dir(model_name, revision)
            digest = verify_for_serving(path)["digest"]
            if served is not None and digest is not None and digest != served:
                raise FormatError(f"the checkpoint's digest is {digest}, not {served}, the one latq-serve checked "
                                  "and configured vLLM from: it was replaced after that check", file=MANIFEST_FILE)
            # the kernel choice decides which custom op the graph calls
            key = content_key(path, f"{selector.ENV_FORCE}={forced or ''}")
        except EnvError as e:
            raise LatqEnvironmentRefused(f"latq: {e}") from None
        except (OSError, MemoryError) as e:   # the machine's limit, not the checkpoint: named as such, in one line
            if not is_resource_error(e):
                raise
            raise LatqResourceLimit(f"latq: {resource_limit(e, f'verifying {model_name}')}") from None
        except FormatError as e:   # one line naming the checkpoint, the file and why: vLLM prints it first
            where = "" if os.path.isdir(model_name) else (
                " (checked in the local Hugging Face cache, which vLLM fills as it goes: download the whole "
                f"repository first, hf download {model_name})")
            raise LatqCheckpointRefused(f"latq: {model_name} refused: {e}{where}") from None
        qc["_latq_fingerprint"] = key[:16]
        if digest is not None:
            qc[DIGEST_KEY] = digest

    # ------------------------------------------------------------------ helpers

    def head_refusal(self, architecture: str | None) -> str | None:
        """Why the model vLLM loaded leaves this checkpoint's quantized head unserved, or None: it built no
        head with latq's method (vLLM's Cohere drops every ``lm_head`` tensor, its logits from the embedding)."""
        if not self.lm_head_quantized or self.head_built:
            return None
        from vllm.distributed import get_pp_group
        if not get_pp_group().is_last_rank:   # the head lives on the last pipeline stage
            return None
        return (f"latq: vLLM's {architecture} built no output head for this checkpoint's quantized head "
                "(quantization_config.lm_head_quantized): the head's tensors were dropped unread and the logits "
                "come from another weight; quantize with --no-quantize-lm-head to serve the model with vLLM")

    def hf_names(self, prefix: str) -> list[str]:
        """vLLM module name → the checkpoint (HF) module names it loads."""
        prefix = checkpoint_module(prefix)
        parent, _, leaf = prefix.rpartition(".")
        mapping = self.packed_modules_mapping or DEFAULT_PACKED
        subs = mapping.get(leaf)
        if not subs:
            return [prefix]
        return [f"{parent}.{s}" if parent else s for s in subs]

    def is_converted(self, prefix: str) -> bool:
        """Whether the vLLM layer ``prefix`` is latq-quantized (a fused layer's parts must agree)."""
        prefix = checkpoint_module(prefix)
        if not self.spec.is_converted(prefix):
            return False
        flags = {n: self.spec.is_converted(n) for n in self.hf_names(prefix)}
        if len(set(flags.values())) > 1:
            raise ValueError(f"latq checkpoint: the parts of fused layer {prefix} are not all quantized "
                             f"({flags}); vLLM needs one method per fused layer")
        return all(flags.values())

    def bits_of(self, prefix: str) -> int | None:
        """Inlier bits of the vLLM layer ``prefix`` (a fused layer's parts must agree)."""
        bits = {n: self.spec.bits_of(n) for n in self.hf_names(prefix)}
        if len(set(bits.values())) > 1:
            raise ValueError(f"latq checkpoint: the parts of fused layer {prefix} have different bits {bits} "
                             "(quantization_config.layer_bits); vLLM runs a fused layer as one")
        return next(iter(bits.values()))


def check_load_format() -> None:
    """Refuse a pinned digest under vLLM's own loaders, which read the files again after the check."""
    from vllm.config import get_current_vllm_config_or_none

    cfg = get_current_vllm_config_or_none()
    fmt_ = getattr(getattr(cfg, "load_config", None), "load_format", LOAD_FORMAT)
    if fmt_ != LOAD_FORMAT and expected_digest_from_env() is not None:
        raise LatqCheckpointRefused(f"latq: {DIGEST_ENV} pins the checkpoint, but --load-format {fmt_} has vLLM read "
                                    "its files again after latq checked them, unchecked: pass --load-format "
                                    f"{LOAD_FORMAT}, whose loader verifies the bytes it reads (latq-serve passes it)")
