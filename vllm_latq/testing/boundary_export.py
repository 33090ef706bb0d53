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


def export_name(bits: int, rotation: int = 0) -> str:
    """The name of an export under the exports' root (``latq…`` beside it: its latq checkpoint)."""
    return f"export{bits}" + (f"-rot{rotation}" if rotation else "")


def tiny_block_export(root: Path, bits: int, rotation: int = 0) -> Path:
    """``root/export…``: one tiny Llama block (``SIZES``, shared by every export under ``root``),
    ``latq-quantize --method rtn --bits BITS --group-size 64`` (``rotation``: with ``--rotate
    hadamard`` at that largest block), then ``latq-export``; the latq checkpoint beside it."""
    from ..commands import export
    from ..quantize.pipeline import QuantizeOptions, quantize_model
    from .tiny_models import make_tiny_model
    root = Path(root)
    src = root / "src"
    if not (src / "config.json").exists():
        make_tiny_model(src, "llama", layers=1, **SIZES)
    name = export_name(bits, rotation)
    latq = root / name.replace("export", "latq")
    quantize_model(src, latq, QuantizeOptions(method="rtn", bits=bits, group_size=GROUP, nsamples=2, seqlen=16,
                                              quantize_lm_head=False, rotate="hadamard" if rotation else "none"),
                   progress=False)
    if rotation:   # the block cap is a format field; the option always writes the default cap
        assert json.loads((latq / "config.json").read_text())["quantization_config"]["rotation"]["max_block"] \
            == rotation
    export.export_checkpoint(latq, root / name)
    return root / name


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

    from ..format.checkpoint import Checkpoint
    export_dir = Path(export_dir)
    cfg = json.loads((export_dir / "config.json").read_text())
    quant = CompressedTensorsConfig.from_config(cfg["quantization_config"])
    _as_llama_sets_it(quant)
    tensors = {n: t for f in sorted(export_dir.glob("*.safetensors")) for n, t in load_file(f).items()
               if n.startswith(PREFIX)}
    latq = export_dir.parent / export_dir.name.replace("export", "latq")
    deq, rot = latq_weights(latq), Checkpoint(latq).spec.rotation
    out, built, layers = {}, {}, _layers(cfg)
    with reference_kernel_last(reference), fresh_transforms():
        # as vLLM loads a model: every layer built and loaded, then each processed (layers of one
        # transform size share its tensor, scaled once, after the last load)
        for leaf, (cls, kw, cin) in layers.items():
            prefix = f"{PREFIX}.{leaf}"
            try:
                built[leaf] = cls(**kw, bias=False, quant_config=quant, params_dtype=dtype, prefix=prefix)
            except (ValueError, NotImplementedError) as e:   # no kernel for the width; a transform at TP > 1
                out[leaf] = {"ok": False, "refusal": f"{type(e).__name__}: " + " ".join(str(e).split())}
                continue
            parts = {shard: {s: tensors[f"{PREFIX}.{m}.{s}"] for s in ("weight_packed", "weight_scale", "weight_shape")}
                     for m, shard in MODULES[leaf]}
            bl.load_parts(built[leaf], parts)
            _load_transforms(built[leaf], tensors, leaf)
        for leaf, layer in built.items():
            layer.quant_method.process_weights_after_loading(layer)
        for leaf, layer in built.items():
            cls, kw, cin = layers[leaf]
            weights = {shard: {"weight": deq[f"{PREFIX}.{m}"]} for m, shard in MODULES[leaf]}
            out[leaf] = _compare_layer(layer, cls, kw, cin, dtype, weights, None if rot is None else rot.signs(cin))
    return out


def _as_llama_sets_it(quant) -> None:
    """The fused layers' parts, as vLLM's Llama hands them to its quantization config when the
    model is built (``SupportsQuant``): a transform targets ``q_proj``, the layer is ``qkv_proj``."""
    from vllm.model_executor.models.llama import LlamaForCausalLM
    quant.packed_modules_mapping.update(LlamaForCausalLM.packed_modules_mapping)


@contextlib.contextmanager
def fresh_transforms():
    """vLLM's ``HadamardTransform`` scales each transform tensor once per process, remembered by
    data pointer: a worker building several models would find a new tensor at a freed one's address
    already "scaled". Forget them around a block, as a fresh vLLM process starts."""
    from vllm.model_executor.layers.quantization.compressed_tensors.transform.module import HadamardTransform
    HadamardTransform.scaled_data_ptrs.clear()
    try:
        yield
    finally:
        HadamardTransform.scaled_data_ptrs.clear()


def _load_transforms(layer, tensors: dict, leaf: str) -> None:
    """Each input transform's weight through its parameter's loader, as vLLM's model loader maps the
    checkpoint's ``<module>.<scheme>_input.weight`` onto the fused layer (with its shard id)."""
    for name, module in layer.named_children():
        if not name.endswith("_input"):
            continue
        p = module.weight
        for m, shard in MODULES[leaf]:
            t = tensors[f"{PREFIX}.{m}.{name}.weight"]
            p.weight_loader(p, t) if shard is None else p.weight_loader(p, t, shard)


def _compare_layer(layer, cls, kw, cin: int, dtype, deq: dict, signs: torch.Tensor | None) -> dict:
    """``layer``'s output against the same vLLM layer unquantized (fp32) holding ``deq`` (latq's
    served weights, Q·Rᵀ where rotated: vLLM then rotates x by its transform, two more roundings)."""
    from ..format import rotation

    def unquantized(weights):
        ref = cls(**kw, bias=False, quant_config=None, params_dtype=torch.float32, prefix="reference")
        bl.load_parts(ref, weights)
        ref.quant_method.process_weights_after_loading(ref)
        return ref
    x = torch.randn(5, cin, generator=torch.Generator().manual_seed(7)).to(dtype)
    y = layer(x)[0]
    want = unquantized(deq)(x.float())[0]
    if signs is None:
        scale = unquantized({s: {"weight": w["weight"].abs()} for s, w in deq.items()})(x.float().abs())[0]
    else:          # |x|·|R|·|Q|ᵀ with Q = (Q·Rᵀ)·R the integers' frame
        q = {s: {"weight": rotation.rotate(w["weight"].double(), signs).float().abs()} for s, w in deq.items()}
        scale = unquantized(q)(x.float().abs() @ rotation.matrix(signs, cin).abs().float())[0]
    rec = bl.compare(y, want, dtype, scale, cin, type(layer.scheme.kernel).__name__, 3 if signs is None else 5)
    return {**rec, "transforms": sorted(n for n, _ in layer.named_children() if n.endswith("_input"))}


def export_case(case) -> dict:
    """A ``boundary_layers.Case`` of layer "export" (or "export-reference": the reference kernel
    appended) → its record: every layer of the block (:func:`export_block`)."""
    path = Path(case.export) / export_name(case.bits, case.rotation)
    layers = export_block(str(path), bl.DTYPES[case.dtype], reference=case.layer == "export-reference")
    return {"ok": True, "layers": layers}
