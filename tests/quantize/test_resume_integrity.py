"""``--resume`` verifies what it resumes: the progress record (its own sha256), the finished shards
and the saved activations carry checksums written with them; a forged stat, a scaled activation
or a corrupted shard is refused naming the file (exit code 2), the partial run left as it was,
and nothing is sealed; an intact one resumes."""
from __future__ import annotations

import json
import shutil

import pytest

from vllm_latq.commands import quantize as cli
from vllm_latq.errors import FormatError
from vllm_latq.format.validate import validate_checkpoint
from vllm_latq.quantize.pipeline import PROGRESS_FILE, TMP_SUFFIX, QuantizeOptions, SimulatedInterruption, quantize_model
from vllm_latq.testing.tiny_models import TINY_OPTS

OPTS = dict(method="gptq", **TINY_OPTS)
CLI = ["--method", "gptq", "--group-size", str(TINY_OPTS["group_size"]), "--nsamples", str(TINY_OPTS["nsamples"]),
       "--seqlen", str(TINY_OPTS["seqlen"]), "--no-quantize-lm-head", "--no-progress"]


@pytest.fixture(scope="module")
def interrupted(tiny_llama, tmp_path_factory):
    """The run directory of a GPTQ run of the tiny Llama stopped after block 0."""
    root = tmp_path_factory.mktemp("interrupted")
    with pytest.raises(SimulatedInterruption):
        quantize_model(tiny_llama, root / "ck", QuantizeOptions(**OPTS), progress=False, stop_after_block=0)
    return root / ("ck" + TMP_SUFFIX)


@pytest.fixture
def run(interrupted, tmp_path):
    d = tmp_path / ("ck" + TMP_SUFFIX)
    shutil.copytree(interrupted, d)
    return d


def _tree(d):
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in d.rglob("*") if p.is_file()}


def _flip(path, at: int = -100):
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x40
    path.write_bytes(bytes(raw))


def _forge_stats(run):
    p = run / PROGRESS_FILE
    state = json.loads(p.read_text())
    state["stats"][0]["cert"] = 0.001
    p.write_text(json.dumps(state))


TAMPER = {   # what is tampered with, and the file the refusal names
    "forged_stats": (_forge_stats, PROGRESS_FILE),
    "scaled_activations": (lambda run: _flip(run / "latq_activations.1.bin"), "latq_activations.1.bin"),
    "corrupted_shard": (lambda run: _flip(run / "model-00001-of-00003.safetensors"), "model-00001-of-00003.safetensors"),
    "older_record": (lambda run: (run / PROGRESS_FILE).write_text(json.dumps(
        {k: v for k, v in json.loads((run / PROGRESS_FILE).read_text()).items() if k not in ("shards", "sha256")})),
        PROGRESS_FILE),
}


@pytest.mark.parametrize("case", sorted(TAMPER))
def test_tampered_partial_state_is_refused_and_left_alone(tiny_llama, run, case):
    tamper, name = TAMPER[case]
    tamper(run)
    before = _tree(run)
    out = run.with_name("ck")
    for resume in (True, False):   # a rerun without --resume resumes too: refused the same, nothing deleted
        with pytest.raises(FormatError, match=rf"{name}: .*rerun with --overwrite \(without --resume\) to start over"):
            quantize_model(tiny_llama, out, QuantizeOptions(**OPTS), progress=False, resume=resume)
        assert _tree(run) == before and not out.exists()


def test_the_command_exits_2_naming_the_file(tiny_llama, run, capsys):
    _flip(run / "latq_activations.1.bin")
    assert cli.main([str(tiny_llama), str(run.with_name("ck")), *CLI, "--resume"]) == 2
    err = capsys.readouterr().err
    assert "latq_activations.1.bin: differs from what the interrupted run wrote" in err, err


def test_overwrite_starts_a_tampered_partial_run_over(tiny_llama, run):
    _flip(run / "latq_activations.1.bin")
    out = quantize_model(tiny_llama, run.with_name("ck"), QuantizeOptions(**OPTS), progress=False, overwrite=True)
    assert not run.exists() and validate_checkpoint(out)["layers"]


def test_an_intact_partial_state_resumes_and_is_sealed(tiny_llama, run):
    out = quantize_model(tiny_llama, run.with_name("ck"), QuantizeOptions(**OPTS), progress=False, resume=True)
    assert not run.exists() and validate_checkpoint(out)["layers"]
