"""``latq-quantize --method e8``: the codebook form through the pipeline — checkpoint, validation,
exact dequantization, ``latq-eval`` perplexity, the certificate and overloads in the stats, experts,
resume — and the options it refuses."""
from __future__ import annotations

import hashlib
import json
import math

import pytest
import torch

from vllm_latq import data
from vllm_latq.commands.evaluate import evaluate
from vllm_latq.commands.inspect import inspect_main
from vllm_latq.commands.quantize import main as quantize_main
from vllm_latq.format.checkpoint import Checkpoint
from vllm_latq.format.validate import format_report, validate_checkpoint
from vllm_latq.quantize.pipeline import QuantizeOptions, SimulatedInterruption, quantize_model
from vllm_latq.testing.tiny_models import TINY_OPTS, make_tiny_model

E8 = dict(TINY_OPTS, method="e8", rotate="hadamard")


def _quantize(src, out, **kw):
    results = {}
    d = quantize_model(src, out, QuantizeOptions(**{**E8, **kw}), progress=False,
                       on_layer=lambda name, W, H, res: results.__setitem__(name, res))
    return d, results


@pytest.fixture(scope="module")
def e8_checkpoint(tiny_llama, tmp_path_factory):
    """The tiny Llama at 3 bits, coded scales per 64 columns: (checkpoint, {layer: QuantResult})."""
    return _quantize(tiny_llama, tmp_path_factory.mktemp("e8") / "ck", bits=3, scale_bits=4)


def test_checkpoint_is_version_3_and_dequantizes_to_the_solution(e8_checkpoint):
    d, results = e8_checkpoint
    report = validate_checkpoint(d)
    qc = json.loads((d / "config.json").read_text())["quantization_config"]
    assert (qc["format_version"], qc["method"], qc["bits"], qc["group_size"], qc["scale_bits"]) == (3, "e8", 3, 64, 4)
    deq = dict(Checkpoint(d).dequantized_tensors(torch.float32))
    assert len(results) == report["totals"]["layers"] == 14
    for name, res in results.items():   # res.q: the served Q·Rᵀ the block computed with
        assert torch.equal(deq[f"{name}.weight"], res.q), name
    stats = {s["name"]: s for s in json.loads((d / "latq_stats.json").read_text())["layers"]}
    for r in report["layers"]:   # stored bits: 3 a weight, 6 bits per 64-column scale and the grids' fp16 pairs
        out, cin = r["shape"]
        groups = math.ceil(cin / 64)
        scale_bits = 4 * 2 * math.ceil(out / 2) * groups + 2 * 16 * math.ceil(out / 16) * groups
        assert r["bits"] == pytest.approx(3 + scale_bits / (out * cin), abs=1e-12)
        assert stats[r["name"]]["solver_bits"] == pytest.approx(r["bits"], abs=1e-12)


def test_certificate_and_overloads_per_layer(e8_checkpoint):
    """Every layer records its overloaded blocks; on the rows without one the measured error is
    within the bound (cert ≤ 1); latq-inspect's table says the totals."""
    d, results = e8_checkpoint
    stats = json.loads((d / "latq_stats.json").read_text())["layers"]
    assert all(isinstance(s["overloads"], int) and s["overloads"] >= 0 for s in stats)
    certs = [s["cert"] for s in stats if s["cert"] is not None]
    assert certs and max(certs) <= 1.0
    text = format_report(validate_checkpoint(d))
    assert "3-bit codebook e8p+ball256 g64" in text
    assert f"overloads: {sum(s['overloads'] for s in stats)} blocks" in text


def test_latq_inspect_prints_its_served_bits(e8_checkpoint, capsys):
    """Each kernel family serves a codebook layer with its codebook kernel (the bf16 fallback where it has
    none): its served bits are that kernel's ``codebook_bytes``."""
    from vllm_latq.kernels.selector import families, family_member, family_name
    from vllm_latq.kernels.weight import CodebookWeight
    assert inspect_main([str(e8_checkpoint[0])]) == 0
    out = capsys.readouterr().out
    assert "latq format v3 · method e8 (codebook)" in out and "OK: " in out
    served = next(line for line in out.splitlines() if line.startswith("served (what a decode step streams"))
    for fam in families():
        member = family_member(family_name(fam), CodebookWeight)
        assert f" {fam.name} " in served
        if member is None:
            assert f"(3b bf16)" in out
        else:
            assert f"(3b {member.name})" in out


def test_latq_inspect_reports_a_group_triton_e8_refuses_by_name(tiny_llama, tmp_path, capsys):
    """Group 24 is a codebook group the format allows (a multiple of 8), not one triton-e8 lays out
    (groups of 16s): inspect says so per kernel instead of ending in the cost model's error."""
    d, _ = _quantize(tiny_llama, tmp_path / "g24", bits=2, group_size=24)
    assert inspect_main([str(d)]) == 0
    out = capsys.readouterr().out
    assert "not served by triton-e8: group size 24 is not a multiple of 16" in out, out
    assert "OK: " in out


def test_its_rotation_removed_and_resealed_is_refused_by_every_reader(e8_checkpoint, tmp_path, capsys):
    """The codebook kind is written only with a rotation (its codes quantize W·R): a checkpoint whose
    ``rotation`` was removed and the manifest written again would be served unrotated (garbage).
    inspect, eval, export and the serving check refuse it in one line naming the key."""
    import shutil
    from vllm_latq.commands import evaluate as evaluate_cmd, export
    from vllm_latq.errors import FormatError
    from vllm_latq.format.manifest import write_manifest
    from vllm_latq.format.validate import verify_for_serving
    d = tmp_path / "ck"
    shutil.copytree(e8_checkpoint[0], d)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["quantization_config"]["rotation"]
    (d / "config.json").write_text(json.dumps(cfg))
    write_manifest(d)
    says = "quantization_config.rotation is missing: the codebook kind (method e8) is written only with a rotation"
    assert inspect_main([str(d), "--no-served"]) == 2
    assert evaluate_cmd.main([str(d), "--nwindows", "1", "--seqlen", "16", "--no-progress"]) == 2
    assert export.main([str(d), str(tmp_path / "ex"), "--dequantize-unmapped"]) == 2
    err = capsys.readouterr().err
    assert err.count(says) == 3 and len(err.strip().splitlines()) == 3, err
    with pytest.raises(FormatError, match="rotation is missing"):
        verify_for_serving(d)


def test_latq_eval_reads_it_as_the_solved_model(e8_checkpoint, tiny_llama):
    """latq-eval's perplexity of the checkpoint is the source model's with every linear replaced by
    the solver's served weight."""
    from transformers import AutoModelForCausalLM
    d, results = e8_checkpoint
    got = evaluate(str(d), seqlen=64, nwindows=4, batch_size=4, progress=False)
    m = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, res in results.items():
            m.get_submodule(name).weight.copy_(res.q)
    windows = data.eval_windows(data.load_tokenizer(tiny_llama), seqlen=64, nwindows=4,
                                docs=data.read_documents("wiki", "eval"))
    want = data.perplexity(m, windows, batch_size=4, progress=False)["ppl"]
    assert math.isfinite(got["ppl"]) and got["method"] == "e8"
    assert got["ppl"] == pytest.approx(want, rel=1e-5)


def test_export_refuses_it_naming_a_layer(e8_checkpoint, tmp_path):
    from vllm_latq.commands.export import ExportRefused, export_checkpoint
    with pytest.raises(ExportRefused, match=r"^model\.layers\.0\.[a-z_.]+: the codebook form \(method e8\) has no "
                                            r"export: no GGUF or compressed-tensors type holds E8 codes; serve it "
                                            r"with latq's plugin \(latq-serve\)$"):
        export_checkpoint(e8_checkpoint[0], tmp_path / "ct", dequantize_unmapped=True)
    assert not (tmp_path / "ct").exists()


@pytest.mark.slow
def test_stopped_and_resumed_is_the_uninterrupted_checkpoint(tiny_llama, tmp_path):
    opts = QuantizeOptions(**{**E8, "bits": 2})
    with pytest.raises(SimulatedInterruption):
        quantize_model(tiny_llama, tmp_path / "a", opts, progress=False, stop_after_block=0)
    a = quantize_model(tiny_llama, tmp_path / "a", opts, progress=False, resume=True)
    b = quantize_model(tiny_llama, tmp_path / "b", opts, progress=False)
    digest = lambda d: {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}  # noqa: E731
    assert digest(a) == digest(b)


@pytest.mark.slow
def test_experts_are_quantized_one_by_one(tmp_path):
    src = make_tiny_model(tmp_path / "src", "mixtral", layers=1)
    d, results = _quantize(src, tmp_path / "out", bits=4)
    report = validate_checkpoint(d)
    experts = [r["name"] for r in report["layers"] if ".experts." in r["name"]]
    assert len(experts) == 4 * 3 and all(r["kind"] == "codebook" for r in report["layers"])
    deq = dict(Checkpoint(d).dequantized_tensors(torch.float32))
    for name, res in results.items():
        assert torch.equal(deq[f"{name}.weight"], res.q), name


def test_e8_rotates_unless_told_and_refuses_to_be_told_not_to():
    from vllm_latq.quantize.options import QuantizeOptions
    assert QuantizeOptions(method="e8", bits=3).rotate == "hadamard"
    assert QuantizeOptions(method="gptq", bits=3).rotate == "none"
    with pytest.raises(ValueError, match="method e8 needs a rotation"):
        QuantizeOptions(method="e8", bits=3, rotate="none")


@pytest.mark.parametrize("argv, says", [
    (["--method", "e8", "--rotate", "none"],
     "method e8 needs a rotation: leave --rotate out or give --rotate hadamard"),
    (["--method", "e8", "--rotate", "hadamard", "--bits", "5"], "bits must be one of 2, 3, 4 for e8"),
    (["--method", "e8", "--rotate", "hadamard", "--group-size", "60"], "group_size must be a positive multiple of 8"),
    (["--method", "e8", "--rotate", "hadamard", "--order", "min-pivot"], "order must be one of act, natural for e8"),
    (["--method", "e8", "--rotate", "hadamard", "--decoder", "kbest"], "decoder kbest is for"),
])
def test_refused_options_exit_2_in_one_line(tiny_llama, tmp_path, capsys, argv, says):
    assert quantize_main([str(tiny_llama), str(tmp_path / "out"), *argv, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()
