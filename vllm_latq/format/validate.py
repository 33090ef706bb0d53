"""Validating a whole checkpoint directory (:func:`validate_checkpoint`: config, index and
shards, checksums, every layer, the bit budget, plain tensors against the model of
``config.json``, the stats file), the vLLM plugin's call of it (:func:`verify_for_serving`) and
the per-layer report ``latq-inspect`` prints."""
from __future__ import annotations

import logging
import os
from typing import Callable

import torch

from .. import hf_model
from ..hf_model import UnsupportedModelError, decoder_layers
from ..progress import step
from ..model_config import check_architecture
from . import codebook, scale_codes
from .checkpoint import Checkpoint, linear_shape
from ..errors import FormatError
from .files import CONFIG_FILE, INDEX_FILE, SINGLE_FILE, STATS_FILE
from . import huffman
from .layer import expected_shapes, has_coded_scales, validate_layer
from .layer import MAX_WEIGHT
from .manifest import (DIGEST_ENV, NO_VERIFY_ENV, SKIPPED, expected_digest_from_env, no_verify_requested,
                       verify_manifest)
from .spec import QuantSpec, check_budget
from .swap_hook import swap_if_asked

logger = logging.getLogger("vllm.latq")   # where vLLM's log configuration shows the plugin's lines


def validate_checkpoint(path: str | os.PathLike, *, decode: bool = True, verify_checksums: bool = True,
                        progress: bool = False, expect_digest: str | None = None) -> dict:
    """Check everything about a checkpoint, shapes before bytes, and return its report
    ``{"layers", "totals", "spec", "unsealed"}`` (``unsealed``: files no loader reads that the
    manifest leaves out; ``digest``: the manifest's, None unchecked; ``checkpoint``: the
    :class:`Checkpoint` validated, its files open, to read what was verified from). Raises
    :class:`FormatError` naming file and tensor on the first problem (the checks in order:
    docs/FORMAT.md, "Validation and its errors")."""
    if expect_digest is not None and not verify_checksums:
        raise ValueError("a pinned digest needs the checks --no-verify skips: pass one or the other")
    ck = Checkpoint(path, expect_digest)
    _check_no_pickles(ck)
    spec = ck.spec
    model = ck.empty_model(torch.float32)
    check_architecture(ck.config, type(model).__name__)
    try:
        decoder_layers(model)
    except UnsupportedModelError as e:
        raise FormatError(str(e), file=CONFIG_FILE) from None
    ck_names = ck.checkpoint_names(model)
    expected = dict(model.state_dict(keep_vars=True))
    head = model.get_output_embeddings()
    tied = ({f"{n}.weight" for n, m in model.named_modules() if m is head}
            if getattr(model.config, "tie_word_embeddings", False) else set())

    layers = _layers_in_model_order(ck, model, ck_names)
    _check_head_key(spec, model, ck_names, layers)   # the config against which layers are stored, before their bytes
    _check_fused_bits(spec, layers)
    what = f"verifying {path} (sha256, shapes, values)" if verify_checksums else f"checking {path} (shapes, values)"
    with step(what, progress, total=_nbytes(ck, ck.where), unit="B") as advance:
        rows, covered = _check_layers(ck, model, ck_names, layers, decode, verify_checksums, advance)
        stray = [m for m, _ in spec.layer_bits if m not in layers]
        if stray:
            raise FormatError(f"quantization_config.layer_bits names {stray}, which are not quantized layers of the "
                              "checkpoint", file=CONFIG_FILE)
        covered |= _check_plain_tensors(ck, ck_names, expected, verify_checksums, advance)
    persistent = {n for n in expected if n not in dict(model.named_buffers())}
    missing = sorted(persistent - covered - tied)
    if missing:
        raise FormatError(f"missing tensors {missing[:4]}{' ...' if len(missing) > 4 else ''} (neither stored "
                          "nor quantized)", file=INDEX_FILE if (ck.path / INDEX_FILE).exists() else SINGLE_FILE)

    _check_stats(ck, spec, rows)
    unsealed, digest = [], None
    if verify_checksums:   # last, so that a structural problem is named as such first
        unsealed = verify_manifest(ck.files, ck.config, ck.shards, expect_digest, ck.manifest)
        ck.checked, digest = True, ck.digest
    swap_if_asked(ck.path)
    return {"layers": rows, "totals": _totals(ck, rows, model), "spec": spec, "unsealed": unsealed,
            "digest": digest, "checkpoint": ck}


def _check_stats(ck: Checkpoint, spec, rows: list[dict]) -> None:
    """The stats file agrees with the stored layers (``rows``), which take its errors and certificates."""
    stats = {s.get("name"): s for s in ck.stats()["layers"] if isinstance(s, dict)}
    for r in rows:
        s = stats.get(r["name"])
        if s is None:
            raise FormatError("no entry for this layer", file=STATS_FILE, tensor=r["name"])
        if not isinstance(s.get("bits"), (int, float)) or abs(s["bits"] - r["bits"]) > 1e-6:
            raise FormatError(f"bits {s.get('bits')!r} disagree with the stored tensors ({r['bits']:.6f})",
                              file=STATS_FILE, tensor=r["name"])
        if spec.rotation is not None and s.get("rotation_block") != spec.rotation.block_size(r["shape"][1]):
            raise FormatError(f"rotation_block {s.get('rotation_block')!r} disagrees with the rotation's rule "
                              f"({spec.rotation.block_size(r['shape'][1])} for {r['shape'][1]} columns)",
                              file=STATS_FILE, tensor=r["name"])
        if spec.kind != "huffman" and "group_size" in s and s["group_size"] != spec.group_size:
            raise FormatError(f"quantization_config.group_size is {spec.group_size}, but {r['name']} was quantized "
                              f"with group size {s['group_size']!r} ({STATS_FILE}): one of them was edited",
                              file=CONFIG_FILE)
        r.update({k: s.get(k) for k in ("rel_error", "cert") + (("overloads",) if spec.kind == "codebook" else ())})
    if set(stats) - {r["name"] for r in rows}:
        extra = sorted(set(stats) - {r["name"] for r in rows})[:3]
        raise FormatError(f"entries for layers that are not in the checkpoint: {extra}", file=STATS_FILE)


def _check_head_key(spec, model, ck_names, layers) -> None:
    """``lm_head_quantized`` is true exactly when the output head is stored quantized: the plugin builds
    the head from the key, not from the tensors."""
    head = model.get_output_embeddings()
    name = next((n for n, m in model.named_modules() if m is head), None)
    stored = name is not None and any(ck_names.model_key(f"{m}.weight") == f"{name}.weight" for m in layers)
    if stored != (spec.extra.get("lm_head_quantized") is True):
        raise FormatError(f"quantization_config.lm_head_quantized is {'absent' if stored else 'true'}, but the output "
                          f"head {name} is stored {'quantized' if stored else 'unquantized'}", file=CONFIG_FILE)


# pickle's suffixes: a latq checkpoint is safetensors only, and loading a pickle runs its code
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


def _check_no_pickles(ck: Checkpoint) -> None:
    """Refuse a pickle file in the directory, sealed or not: a loader that finds one may run it."""
    pickled = sorted(e.name for e in ck.files.entries() if e.name.endswith(PICKLE_SUFFIXES))
    if pickled:
        raise FormatError("a pickle file in a latq checkpoint, which is safetensors only (loading a pickle runs its "
                          "code): remove it", file=pickled[0])


# the parts vLLM fuses into one layer (q/k/v, gate/up): one layer, one width
FUSED_PARTS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _check_fused_bits(spec, layers) -> None:
    """The parts of a layer vLLM fuses are quantized with the same bits (``layer_bits`` must agree)."""
    for m in layers:
        parent, _, leaf = m.rpartition(".")
        group = next((g for g in FUSED_PARTS if leaf in g), ())
        bits = {spec.bits_of(f"{parent}.{p}") for p in group if f"{parent}.{p}" in layers}
        if len(bits) > 1:
            raise FormatError(f"quantization_config.layer_bits gives the parts {'/'.join(group)} of {parent}, which "
                              f"vLLM fuses into one layer, different bits {sorted(bits)}", file=CONFIG_FILE)


def _layers_in_model_order(ck: Checkpoint, model, ck_names) -> dict[str, dict[str, str]]:
    """The checkpoint's quantized layers in the model's module order (experts at their module)."""
    rank = {n: i for i, (n, _) in enumerate(model.named_modules())}
    where = lambda m: (ck_names.experts[m].experts_module if m in ck_names.experts  # noqa: E731
                       else ck_names.model_key(f"{m}.weight").removesuffix(".weight"))
    return dict(sorted(ck.layers().items(), key=lambda kv: (rank.get(where(kv[0]), len(rank)), kv[0])))


def _nbytes(ck: Checkpoint, names) -> int:
    """Bytes the tensors ``names`` of ``ck`` hold: what checking them reads."""
    return sum(ck.shards[ck.where[n]].entries[n].end - ck.shards[ck.where[n]].entries[n].begin for n in names)


def _check_layers(ck: Checkpoint, model, ck_names, layers: dict[str, dict[str, str]], decode: bool,
                  verify_checksums: bool, advance: Callable[[int], object]) -> tuple[list[dict], set[str]]:
    """Every quantized layer checked (``advance``: by the bytes read) → its report rows, the model keys covered."""
    rows, covered, experts_done = [], set(), {}
    for module, names in layers.items():
        rows.append(_check_layer(ck, model, ck_names, module, names, decode=decode, verify_checksums=verify_checksums))
        advance(_nbytes(ck, names.values()))
        if module in ck_names.experts:  # a fused parameter is covered once each of its per-expert layers is
            p = ck_names.experts[module].param
            experts_done[p] = experts_done.get(p, 0) + 1
            if experts_done[p] == len(ck_names.of_param(p)):
                covered.add(p)
        else:
            covered.add(ck_names.model_key(f"{module}.weight"))
    return rows, covered


def _check_layer(ck: Checkpoint, model, ck_names, module: str, names: dict[str, str], *, decode: bool,
                 verify_checksums: bool) -> dict:
    """One quantized layer's tensors checked against the config and the model; its report row."""
    spec = ck.spec
    files = {ck.where[n] for n in names.values()}
    file = sorted(files)[0]
    if len(files) > 1:
        raise FormatError(f"tensors of one layer are split over {sorted(files)}", file=file, tensor=module)
    if f"{module}.weight" in ck.where:
        raise FormatError("stored both quantized and as a plain weight", file=file, tensor=f"{module}.weight")
    if not spec.is_converted(module):
        raise FormatError("quantized, but listed in quantization_config.modules_not_converted", file=file,
                          tensor=module)
    shape = linear_shape(model, module, file, ck_names)
    check_declared_shapes(ck.shards[file], names, spec.kind, shape, spec.bits_of(module), spec.group_size,
                          layer=module, file=file)
    t = {sfx: ck.tensor(n, verify=verify_checksums) for sfx, n in names.items()}   # the bytes hashed are those checked
    if spec.kind != "huffman" and has_coded_scales(t) != (spec.scale_bits is not None):
        raise FormatError("scales stored " + ("as codes, but quantization_config has no scale_bits"
                                              if has_coded_scales(t) else
                                              f"in fp16, but quantization_config.scale_bits is {spec.scale_bits}"),
                          file=file, tensor=module)
    validate_layer(t, spec.kind, shape, spec.bits_of(module), spec.group_size, layer=module, file=file,
                       decode=decode)
    if spec.kind == "dense" and spec.method != "ssqr" and t["outlier_col"].numel():
        raise FormatError(f"{t['outlier_col'].numel()} outliers, but method {spec.method} stores none",
                          file=file, tensor=f"{module}.outlier_col")
    st = check_budget(t, spec, shape, layer=module, file=file)
    return {"name": module, "kind": spec.kind, "shape": list(shape), **st}


def _check_plain_tensors(ck: Checkpoint, ck_names, expected: dict, verify_checksums: bool,
                         advance: Callable[[int], object]) -> set[str]:
    """Every stored plain tensor checked against the model's parameter; the model keys covered."""
    covered = set()
    config_dtype = getattr(torch, hf_model.model_dtype(ck.config), None)
    for name in ck.plain_names():
        file = ck.where[name]
        if ck_names.model_key(name) not in expected:
            raise FormatError("unexpected tensor: not a parameter of the model in config.json", file=file, tensor=name)
        want = expected[ck_names.model_key(name)]
        f = ck.shards[file]
        if f.shape(name) != tuple(want.shape):
            raise FormatError(f"shape {f.shape(name)}, expected {tuple(want.shape)} from config.json", file=file,
                              tensor=name)
        if not f.dtype(name).is_floating_point:
            raise FormatError(f"dtype {f.dtype(name)}, expected a floating-point dtype", file=file, tensor=name)
        check_plain_dtype(f, name, config_dtype, file=file)
        if verify_checksums:
            f.verify(name, value_limit=MAX_WEIGHT)   # one pass over the bytes: sha256 and values
        else:
            f.check_values(name, MAX_WEIGHT)
        advance(_nbytes(ck, [name]))
        covered.add(ck_names.model_key(name))
    return covered


def verify_for_serving(path: str | os.PathLike, progress: bool = False) -> dict:
    """The vLLM plugin's check of a checkpoint directory before vLLM reads a tensor: the checks
    ``latq-eval`` runs (:func:`validate_checkpoint` without decoding the Huffman streams, which
    the loader decodes): shapes before bytes, every tensor's sha256 streamed by pieces, value
    bounds, every file against the manifest, and the manifest against the digest
    ``LATQ_EXPECT_DIGEST`` pins. ``LATQ_NO_VERIFY=1`` skips the sha256 checks as ``--no-verify``
    does, with one warning saying so (refused beside a pinned digest). Returns the report."""
    skip, digest = no_verify_requested(), expected_digest_from_env()
    said = f"{NO_VERIFY_ENV}={os.environ.get(NO_VERIFY_ENV)}"
    if skip and digest:
        raise FormatError(f"{said} and {DIGEST_ENV} are both set: a pinned digest needs the checks "
                          f"{NO_VERIFY_ENV} skips", file=str(path))
    if skip:
        logger.warning("latq: %s: %s", said, SKIPPED)
    report = validate_checkpoint(path, decode=False, verify_checksums=not skip, expect_digest=digest,
                                 progress=progress)
    if report["unsealed"]:
        logger.warning("latq: %s: not sealed, read by no loader: %s", path, ", ".join(report["unsealed"]))
    logger.info("latq: %s checked before serving: %s", path, "shapes, dtypes and value bounds (no sha256)" if skip
                else "every tensor's sha256, every file against the manifest" + (f", the pinned digest {digest}"
                                                                                 if digest else "")
                + ", shapes, dtypes and value bounds")
    return report


def check_plain_dtype(f, name: str, config_dtype, *, file: str) -> None:
    """A plain tensor keeps the dtype recorded for it when the checkpoint was written (its
    shard's ``latq_layouts``): not the config's dtype, since sources keep some tensors in fp32
    whatever it says (transformers' ``_keep_in_fp32_modules``: routers' score-correction biases,
    gates) and the quantizer copies them as they are. A shard that records none (written before
    the table, or re-saved without it) falls back to the config's dtype. Checked with or
    without the sha256 checks: a dtype edit (BF16 → F16, the same bytes read as other numbers)
    is refused under ``--no-verify`` too."""
    if f.layouts is not None and name in f.layouts:
        f.check_layout(name)
    elif isinstance(config_dtype, torch.dtype) and f.dtype(name) != config_dtype:
        raise FormatError(f"dtype {f.dtype(name)}, expected {config_dtype} from config.json (the shard records no "
                          "dtype for it as written)", file=file, tensor=name)


def check_declared_shapes(f, names: dict[str, str], kind: str, shape, bits, group_size, *, layer: str,
                          file: str) -> None:
    """A layer's header shapes against what its linear's shape implies, before any byte is read:
    a tensor declaring more than that (a memory bomb) is refused naming it."""
    if kind == "codebook":
        codebook.check_layer_shape(shape, layer=layer, file=file)
    coded = kind != "huffman" and "scale_codes" in names
    out, cin = shape
    bound = {"outlier_col": out * cin, "outlier_val": out * cin, "hsymbols": out * cin, "hlengths": out * cin,
             "hstream": out * cin * huffman.MAX_CODE_LEN // 8 + 8}
    for sfx, (want, _) in expected_shapes(kind, shape, bits, group_size, coded=coded).items():
        name = names.get(sfx)
        if name is None:
            continue   # missing: validate_layer names it
        got = f.shape(name)
        if want is not None and got != tuple(want):
            raise FormatError(f"shape {got}, expected {tuple(want)}", file=file, tensor=name)
        if want is None and (len(got) != 1 or got[0] > bound[sfx]):
            raise FormatError(f"shape {got}: more than the {bound[sfx]} entries a {out}x{cin} layer can have",
                              file=file, tensor=name)


def _totals(ck: Checkpoint, rows: list[dict], model) -> dict:
    qparams = sum(r["shape"][0] * r["shape"][1] for r in rows)
    qbits = sum(r["bits"] * r["shape"][0] * r["shape"][1] for r in rows)
    nbytes = _nbytes(ck, ck.where)
    params = sum(p.numel() for p in model.parameters())
    return {"layers": len(rows), "quantized_params": qparams,
            "bits_per_weight": qbits / qparams if qparams else 0.0,
            "outlier_rate": sum(r["outlier_rate"] * r["shape"][0] * r["shape"][1] for r in rows) / qparams
            if qparams else 0.0,
            "params": params, "tensor_bytes": nbytes, "bits_per_param_all": 8 * nbytes / params if params else 0.0}


def format_report(report: dict) -> str:
    """The per-layer table; with ``served`` in the rows (``latq-inspect`` adds it from the
    kernels' cost models) a stored and a served bits/weight column per kernel family."""
    spec: QuantSpec = report["spec"]
    coded = f", scales as {spec.scale_bits}-bit codes on {scale_codes.ROWS}-row grids" if spec.scale_bits else ""
    if spec.kind == "codebook":
        budget = f"{spec.bits}-bit codebook {codebook.CODEBOOKS[spec.bits].name} g{spec.group_size}{coded}"
    elif spec.kind == "dense":
        budget = (f"{spec.bits}-bit g{spec.group_size}" + (f", outlier rate ≤ {spec.outlier_rate:g}"
                                                            if spec.method == "ssqr" else "")
                  + coded + "".join(f", {m} {b}-bit" for m, b in spec.layer_bits))
    else:
        budget = f"target {spec.target_bits:g} bits/weight"
    fams = list(report["layers"][0].get("served", {})) if report["layers"] else []
    rot = spec.rotation
    lines = [f"latq format v{spec.version} · method {spec.method} ({spec.kind}) · {budget}"
             f" · order {spec.order} · damp {spec.damp}"
             + (f" · rotation {rot.kind} seed {rot.seed}, blocks ≤ {rot.max_block}" if rot else ""),
             f"{'layer':44s} {'shape':>11s} {'bits/w':>7s} {'outl%':>6s} {'rel.err':>9s} {'cert':>6s}"
             + "".join(f" {'served ' + f:>16s}" for f in fams)]

    def f(x, spec_):
        return format(x, spec_) if isinstance(x, (int, float)) else "—"
    for r in report["layers"]:
        shp = "x".join(map(str, r["shape"]))
        served = "".join(f" {_served_cell(r['served'][fam]):>16s}" for fam in fams)
        lines.append(f"{r['name']:44s} {shp:>11s} {r['bits']:7.3f} {100 * r['outlier_rate']:6.3f} "
                     f"{f(r['rel_error'], '9.2e'):>9s} {f(r['cert'], '6.3f'):>6s}{served}")
    t = report["totals"]
    lines.append(f"total: {t['layers']} quantized layers, {t['quantized_params']:,} weights at "
                 f"{t['bits_per_weight']:.4f} bits/weight (outliers {100 * t['outlier_rate']:.3f}%); "
                 f"all tensors {t['tensor_bytes'] / 2**20:.1f} MiB = {t['bits_per_param_all']:.3f} bits/param "
                 f"over {t['params']:,} params (embeddings etc. in the model dtype)")
    if spec.kind == "codebook":
        over = [r for r in report["layers"] if r.get("overloads")]
        lines.append(f"overloads: {sum(r['overloads'] for r in over)} blocks in {len(over)} of {len(report['layers'])} "
                     "layers (a block whose target lies beyond the codebook's covering radius; cert covers the "
                     "rows without one)")
    if "served_bits_per_weight" in t:
        lines.append("served (what a decode step streams, per kernel family): " + ", ".join(
            f"{fam} {b:.4f}" for fam, b in t["served_bits_per_weight"].items())
            + f" bits/weight vs stored {t['bits_per_weight']:.4f}, "
            + ("the output head included" if any(r["name"].split(".")[-1] == "lm_head" for r in report["layers"])
               else "the output head in the model dtype not counted"))
    lines += _refusals(report["layers"], fams)
    return "\n".join(lines)


def _refusals(rows: list[dict], fams: list[str]) -> list[str]:
    """One line per kernel refusal the served columns hide behind "bf16": which kernel, why, how many layers."""
    seen: dict[str, int] = {}
    for r in rows:
        for fam in fams:
            why = r["served"][fam].get("why")
            if why:
                seen[f"{fam}: {why}"] = seen.get(f"{fam}: {why}", 0) + 1
    return [f"{what} ({n} layers, served by the bf16 fallback)" for what, n in seen.items()]


def _served_cell(s: dict) -> str:
    """``4.812 (4b triton)``: served bits/weight, the inlier width, the kernel that serves it."""
    return f"{s['bits_per_weight']:.3f} ({s['bits']}b {s['kernel']})"
