"""latq-export's checkpoint under *stock* vLLM across the CUDA boundary: a tiny Llama block
quantized by latq and exported, read by vLLM's own ``CompressedTensorsConfig`` (no plugin) on
vLLM's real layers with the stubbed GPU, against the same layers holding latq's dequantized
weights; a width vLLM refuses is recorded as refused (docs/KERNELS.md)."""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from . import boundary_layers as bl

SIZES = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
GROUP = 64
PREFIX = "model.layers.0"
# vLLM layer → (checkpoint modules and their shard ids)
MODULES = {"self_attn.qkv_proj": (("self_attn.q_proj", "q"), ("self_attn.k_proj", "k"), ("self_attn.v_proj", "v")),
           "self_attn.o_proj": (("self_attn.o_proj", None),),
           "mlp.gate_up_proj": (("mlp.gate_proj", 0), ("mlp.up_proj", 1)),
           "mlp.down_proj": (("mlp.down_proj", None),)}


def tiny_block_export(root: Path, bits: int) -> Path:
    """``root/export{bits}``: one tiny Llama block (``SIZES``, shared by every width under
    ``root``), ``latq-quantize --method rtn --bits BITS --group-size 64``, then ``latq-export``; the
    latq checkpoint beside it (``root/latq{bits}``)."""
    from ..commands import export
    from ..quantize.pipeline import QuantizeOptions, quantize_model
    from .tiny_models import make_tiny_model
    root = Path(root)
    src = root / "src"
    if not (src / "config.json").exists():
        make_tiny_model(src, "llama", layers=1, **SIZES)
    quantize_model(src, root / f"latq{bits}", QuantizeOptions(method="rtn", bits=bits, group_size=GROUP, nsamples=2,
                                                              seqlen=16, quantize_lm_head=False), progress=False)
    export.export_checkpoint(root / f"latq{bits}", root / f"export{bits}")
    return root / f"export{bits}"


def _layers(cfg: dict) -> dict:
    """vLLM layer → (constructor, its arguments, input size) for the export's config."""
    from vllm.model_executor.layers import linear as L
    h, heads, kv, d, inter = (cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                               "head_dim", "intermediate_size"))
    return {"self_attn.qkv_proj": (L.QKVParallelLinear, dict(hidden_size=h, head_size=d, total_num_heads=heads,
                                                             total_num_kv_heads=kv), h),
            "self_attn.o_proj": (L.RowParallelLinear, dict(input_size=heads * d, output_size=h,
                                                           input_is_parallel=False), heads * d),
            "mlp.gate_up_proj": (L.MergedColumnParallelLinear, dict(input_size=h, output_sizes=[inter, inter]), h),
            "mlp.down_proj": (L.RowParallelLinear, dict(input_size=inter, output_size=h, input_is_parallel=False),
                              inter)}


@contextlib.contextmanager
def reference_kernel_last(on: bool):
    """``testing.wna16``'s reference kernel appended to the current platform's mixed-precision
    kernels for the block (``on``), removed after: later cases see vLLM's own list."""
    if not on:
        yield
        return
    from vllm.model_executor.kernels import linear
    from vllm.platforms import current_platform

    from .wna16 import reference_kernel
    kernels = linear._POSSIBLE_KERNELS.setdefault(current_platform._enum, [])
    kernels.append(reference_kernel())
    try:
        yield
    finally:
        kernels.remove(reference_kernel())


def latq_weights(latq: Path) -> dict[str, torch.Tensor]:
    """The latq checkpoint's quantized layers dequantized by latq's own reader, by module."""
    from ..format.checkpoint import Checkpoint
    return {n.removesuffix(".weight"): w for n, w in Checkpoint(latq).dequantized_tensors() if n.startswith(PREFIX)}


def export_block(export_dir: str, dtype: torch.dtype, reference: bool = False) -> dict:
    """Every layer of the export's block under stock vLLM → {layer: record}: the kernel class,
    the error over the kernel's rounding bound, or vLLM's refusal."""
    from safetensors.torch import load_file
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig)
    export_dir = Path(export_dir)
    cfg = json.loads((export_dir / "config.json").read_text())
    quant = CompressedTensorsConfig.from_config(cfg["quantization_config"])
    tensors = {n: t for f in sorted(export_dir.glob("*.safetensors")) for n, t in load_file(f).items()
               if n.startswith(PREFIX)}
    deq = latq_weights(export_dir.parent / export_dir.name.replace("export", "latq"))
    out = {}
    with reference_kernel_last(reference):
        for leaf, (cls, kw, cin) in _layers(cfg).items():
            prefix = f"{PREFIX}.{leaf}"
            try:
                layer = cls(**kw, bias=False, quant_config=quant, params_dtype=dtype, prefix=prefix)
            except ValueError as e:        # vLLM's scheme finds no kernel for the width
                out[leaf] = {"ok": False, "refusal": " ".join(str(e).split())}
                continue
            parts = {shard: {s: tensors[f"{PREFIX}.{m}.{s}"] for s in ("weight_packed", "weight_scale", "weight_shape")}
                     for m, shard in MODULES[leaf]}
            bl.load_parts(layer, parts)
            layer.quant_method.process_weights_after_loading(layer)
            weights = {shard: {"weight": deq[f"{PREFIX}.{m}"]} for m, shard in MODULES[leaf]}
            out[leaf] = _compare_layer(layer, cls, kw, cin, dtype, weights)
    return out


def _compare_layer(layer, cls, kw, cin: int, dtype, deq: dict) -> dict:
    """``layer``'s output against the same vLLM layer unquantized (fp32) holding ``deq``."""
    def unquantized(weights):
        ref = cls(**kw, bias=False, quant_config=None, params_dtype=torch.float32, prefix="reference")
        bl.load_parts(ref, weights)
        ref.quant_method.process_weights_after_loading(ref)
        return ref
    x = torch.randn(5, cin, generator=torch.Generator().manual_seed(7)).to(dtype)
    y = layer(x)[0]
    want = unquantized(deq)(x.float())[0]
    scale = unquantized({s: {"weight": w["weight"].abs()} for s, w in deq.items()})(x.float().abs())[0]
    return bl.compare(y, want, dtype, scale, cin, type(layer.scheme.kernel).__name__)


def export_case(case) -> dict:
    """A ``boundary_layers.Case`` of layer "export" (or "export-reference": the reference kernel
    appended) → its record: every layer of the block (:func:`export_block`)."""
    path = Path(case.export) / f"export{case.bits}"
    layers = export_block(str(path), bl.DTYPES[case.dtype], reference=case.layer == "export-reference")
    return {"ok": True, "layers": layers}
