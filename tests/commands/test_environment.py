"""Environment switches parse strictly (vllm_latq/env.py, docs/ENVIRONMENT.md): each LATQ_* variable takes
its documented values and refuses anything else by name, before any work (one line, exit 2);
LATQ_NO_VERIFY=false/no/space never turns verification off, and its warning says the value given;
LATQ_KERNEL=bogus is one line from latq-serve before vLLM starts, and from the plugin while vLLM builds
its config; a path is checked for what it names (a folder, a regular file) and a kernel for whether this machine
runs it (LATQ_KERNEL=triton without CUDA); every variable the package reads is in docs/ENVIRONMENT.md."""
from __future__ import annotations

import ast
import logging
import os
import re
from pathlib import Path

import pytest

from vllm_latq import env
from vllm_latq.commands import evaluate, export, inspect, quantize, serve
from vllm_latq.commands.environment import check_environment
from vllm_latq.errors import FormatError
from vllm_latq.format.checkpoint import Checkpoint
from vllm_latq.format.validate import verify_for_serving
from vllm_latq.testing.header_edits import edit_bytes_in_place

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "ENVIRONMENT.md"
# one value each variable refuses (and what the refusal says it accepts)
BAD = {"LATQ_NO_VERIFY": ("no", "1 or true (on), 0 or false (off), or unset"),
       "LATQ_EXPECT_DIGEST": ("", "sha256: and 64 hex digits"),
       "LATQ_KERNEL": ("bogus", "one of "),
       "LATQ_AUTOTUNE": ("yes", "1 or true"),
       "LATQ_LAUNCH_CONFIGS": (" table.json", "a path without surrounding spaces"),
       "LATQ_CPU_NATIVE": ("off", "1 or true"),
       "LATQ_CPU_MARCH": ("native;rm", "a -march name"),
       "LATQ_CPU_LOOP_MAX": ("1e3", "an integer ≥ 0"),
       "LATQ_CPU_GEMV": ("2", "1 or true"),
       "LATQ_CPU_ISA": ("avx512", "one of avx2, best, or unset"),
       "LATQ_CPU_BF16": ("auto", "1 or true"),
       "LATQ_CPU_LARGE_M": ("-1", "an integer ≥ 0"),
       "LATQ_CPU_SPLIT_MAX_EXTRA_RATE": ("nan", "a number ≥ 0 and ≤ 1"),
       "LATQ_CPU_CHUNK_BYTES": ("0", "an integer ≥ 1"),
       "LATQ_CPU_PREFILL_CACHE": ("on", "1 or true"),
       "LATQ_TRITON_INTERPRET_OK": ("y", "1 or true"),
       "LATQ_CACHE": ("cache\n", "a path without surrounding spaces or newlines"),
       "LATQ_DIST_TIMEOUT": ("0", "a number > 0"),
       "LATQ_STOP_AFTER_BLOCK": ("one", "an integer ≥ 0"),
       "LATQ_FAULT": ("1:q_proj", "RANK:LAYER_SUBSTRING:raise or kill"),
       "LATQ_FAULT_AT": ("sealed:term", "STAGE:ACTION, STAGE one of saved-block, sealed, aside, replaced, "
                                        "removing-old, ACTION one of kill, stop"),
       "LATQ_SWAP_AFTER_VERIFY": ("\n", "a path without surrounding spaces")}


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for name in BAD:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("raw, want", [("1", True), ("true", True), ("TRUE", True), ("0", False), ("false", False),
                                       ("False", False), ("", None), (None, None)])
def test_flag_spellings(monkeypatch, raw, want):
    if raw is not None:
        monkeypatch.setenv("LATQ_AUTOTUNE", raw)
    assert env.flag("LATQ_AUTOTUNE", None) is want


@pytest.mark.parametrize("raw", ["no", "yes", "off", " ", " 1", "2", "tru"])
def test_a_flag_takes_nothing_else(monkeypatch, raw):
    monkeypatch.setenv("LATQ_AUTOTUNE", raw)
    with pytest.raises(env.EnvError) as e:
        env.flag("LATQ_AUTOTUNE")
    assert str(e.value) == (f"environment variable LATQ_AUTOTUNE={raw!r}: expected 1 or true (on), 0 or false (off), "
                            "or unset")


def test_numbers_are_bounded_and_finite(monkeypatch):
    for raw, ok in (("7", 7), ("+7", 7), (" 7", None), ("7.0", None), ("99", None)):
        monkeypatch.setenv("LATQ_X", raw)
        if ok is None:
            with pytest.raises(env.EnvError, match="LATQ_X="):
                env.integer("LATQ_X", 3, minimum=0, maximum=10)
        else:
            assert env.integer("LATQ_X", 3, minimum=0, maximum=10) == ok
    for raw, ok in (("0.5", 0.5), ("1e-3", 1e-3), ("inf", None), ("nan", None), ("0", None), ("-1", None)):
        monkeypatch.setenv("LATQ_X", raw)
        if ok is None:
            with pytest.raises(env.EnvError, match="expected a number > 0"):
                env.number("LATQ_X", 1.0, minimum=0.0, above=True)
        else:
            assert env.number("LATQ_X", 1.0, minimum=0.0, above=True) == ok
    monkeypatch.delenv("LATQ_X")
    assert env.integer("LATQ_X", 3, minimum=0) == 3


@pytest.mark.parametrize("raw", ["1" * 5000, "３０", "٣", "1_0", "1e400", "0x10"])
def test_an_integer_is_short_ascii_digits(monkeypatch, raw):
    """int() reads Unicode digits and '1_0', and past 4300 digits raises an error of its own: all refused
    by name, in one short line."""
    monkeypatch.setenv("LATQ_X", raw)
    with pytest.raises(env.EnvError) as e:
        env.integer("LATQ_X", 3, minimum=0)
    assert str(e.value).startswith("environment variable LATQ_X=") and len(str(e.value)) < 200, e.value


@pytest.mark.parametrize("raw", ["1" * 5000, "٠.٥", "３０", "1_0", "١", "infinity", "0x1p-2", " 0.5"])
def test_a_number_is_short_ascii_decimal(monkeypatch, raw):
    """float() reads '٠.٥' as 0.5, '３０' as 30 and '1_0' as 10: a number variable takes ASCII decimals only."""
    monkeypatch.setenv("LATQ_X", raw)
    with pytest.raises(env.EnvError) as e:
        env.number("LATQ_X", 1.0, minimum=0.0, maximum=1e9)
    assert "expected a number ≥ 0" in str(e.value) and len(str(e.value)) < 200, e.value
    for ok, want in (("0.5", 0.5), (".5", 0.5), ("5.", 5.0), ("+1e3", 1e3), ("1E-3", 1e-3)):
        monkeypatch.setenv("LATQ_X", ok)
        assert env.number("LATQ_X", 1.0, minimum=0.0, maximum=1e9) == want


def test_the_cache_must_be_a_directory(monkeypatch, capsys, tmp_path):
    """LATQ_CACHE=/dev/null (or any file) is refused naming the variable, before any work."""
    monkeypatch.setenv("LATQ_CACHE", "/dev/null")
    assert inspect.inspect_main([str(tmp_path / "no-such-checkpoint")]) == 2
    assert capsys.readouterr().err == ("latq-inspect: error: environment variable LATQ_CACHE='/dev/null': expected a "
                                       "directory (this exists and is not one), or unset\n")
    from vllm_latq.data.paths import cache_dir
    with pytest.raises(env.EnvError, match="LATQ_CACHE"):
        cache_dir()
    monkeypatch.setenv("LATQ_CACHE", str(tmp_path / "new"))   # a directory to be: created where used
    assert cache_dir() == tmp_path / "new" and (tmp_path / "new").is_dir()


@pytest.mark.parametrize("name, raw, accepted", [
    ("LATQ_LAUNCH_CONFIGS", "/dev/zero", "a regular file (this exists and is not one)"),
    ("LATQ_LAUNCH_CONFIGS", "{tmp}", "a regular file (this exists and is not one)"),
    ("LATQ_LAUNCH_CONFIGS", "/nonexistent/table.json", "(its directory is not there)"),
    ("LATQ_SWAP_AFTER_VERIFY", "/nonexistent/dir", "an existing directory (nothing is there)"),
    ("LATQ_SWAP_AFTER_VERIFY", "/dev/null", "an existing directory (this is not one)")])
def test_a_path_is_checked_for_what_it_names(monkeypatch, capsys, tmp_path, name, raw, accepted):
    """A launch-config table must be a regular file (or one autotuning is to write), the swap hook's directory
    must be there: /dev/zero, a folder, a missing folder are one line naming the variable, before any work."""
    raw = raw.format(tmp=tmp_path)
    monkeypatch.setenv(name, raw)
    assert inspect.inspect_main([str(tmp_path / "no-such-checkpoint")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"latq-inspect: error: environment variable {name}={raw!r}: expected ") and accepted in err \
        and err.count("\n") == 1, err
    (tmp_path / "table.json").write_text('{"families": {}}')
    for ok in (tmp_path / "table.json", tmp_path / "new.json", tmp_path):   # a table, one to write, a folder
        if (name == "LATQ_SWAP_AFTER_VERIFY") == ok.is_dir():
            monkeypatch.setenv(name, str(ok))
            check_environment()


def test_a_kernel_this_machine_cannot_run_is_refused_before_any_work(ck, monkeypatch, capsys):
    """LATQ_KERNEL=triton without a CUDA device (outside the interpreter) is refused with the other variables,
    not when vLLM builds a layer."""
    pytest.importorskip("triton")
    import torch

    from vllm_latq.kernels.triton.kernel import ENV_INTERPRET_OK, INTERPRET
    if torch.cuda.device_count():
        pytest.skip("a CUDA device is here: the Triton kernels run")
    monkeypatch.setenv("LATQ_KERNEL", "triton")
    want = ("environment variable LATQ_KERNEL='triton': expected a kernel that runs on this machine (triton needs a "
            "CUDA device (this machine has none); for CPU tensors set TRITON_INTERPRET=1 and "
            f"{ENV_INTERPRET_OK}=1 (Triton interpreter)), or unset\n")
    assert inspect.inspect_main([str(ck)]) == 2 and capsys.readouterr().err == f"latq-inspect: error: {want}"
    monkeypatch.setattr(serve, "serve_in_process", lambda *a: pytest.fail("handed over to vLLM"))
    with pytest.raises(SystemExit) as e:
        serve.main([str(ck), "--port", "9"])
    assert e.value.code == 2 and capsys.readouterr().err == f"latq-serve: error: {want}"
    if INTERPRET:   # the interpreter, where allowed, runs them on CPU tensors
        monkeypatch.setenv(ENV_INTERPRET_OK, "1")
        check_environment()


@pytest.mark.parametrize("name", sorted(BAD))
def test_every_variable_is_refused_by_name_before_any_work(monkeypatch, capsys, name, tmp_path):
    value, accepted = BAD[name]
    monkeypatch.setenv(name, value)
    with pytest.raises(env.EnvError) as e:
        check_environment()
    assert e.value.name == name and accepted in str(e.value), e.value
    missing = str(tmp_path / "no-such-checkpoint")   # the command would refuse it, were it looked at
    assert inspect.inspect_main([missing]) == 2
    err = capsys.readouterr().err
    assert err == f"latq-inspect: error: {e.value}\n", err


def test_every_command_checks_the_environment_first(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("LATQ_NO_VERIFY", "no")
    missing = str(tmp_path / "nothing")
    runs = {"latq-quantize": lambda: quantize.main([missing, str(tmp_path / "out")]),
            "latq-eval": lambda: evaluate.main([missing]),
            "latq-export": lambda: export.main([missing, str(tmp_path / "out")]),
            "latq-inspect": lambda: inspect.inspect_main([missing])}
    for prog, run in runs.items():
        assert run() == 2
        err = capsys.readouterr().err
        assert err == f"latq-{prog[5:]}: error: environment variable LATQ_NO_VERIFY='no': expected 1 or true (on), " \
                      "0 or false (off), or unset\n", err
    assert not (tmp_path / "out").exists()


def test_no_verify_false_no_or_space_never_skips_the_checks(ck, monkeypatch, caplog):
    norm = "model.norm.weight"
    shard = Checkpoint(ck).where[norm]
    edit_bytes_in_place(ck / shard, norm, lambda t: t * 1.5)   # in bounds: only its sha256 tells
    for raw in ("false", "0", "FALSE", ""):
        monkeypatch.setenv("LATQ_NO_VERIFY", raw)
        with pytest.raises(FormatError, match=rf"file {shard}, tensor {norm}: sha256 mismatch"):
            verify_for_serving(ck)
    for raw in ("no", " ", "off"):
        monkeypatch.setenv("LATQ_NO_VERIFY", raw)
        with pytest.raises(env.EnvError, match=rf"LATQ_NO_VERIFY={re.escape(repr(raw))}: expected 1 or true"):
            verify_for_serving(ck)
    monkeypatch.setenv("LATQ_NO_VERIFY", "True")
    with caplog.at_level(logging.WARNING, logger="vllm.latq"):
        verify_for_serving(ck)
    assert any(r.getMessage().startswith("latq: LATQ_NO_VERIFY=True: the sha256 checks") for r in caplog.records)


def test_a_bogus_kernel_is_one_line_before_vllm_starts(ck, monkeypatch, capsys):
    def no_vllm(*a, **k):
        raise AssertionError("handed over to vLLM")
    monkeypatch.setattr(serve, "serve_in_process", no_vllm)
    monkeypatch.setattr(os, "execv", no_vllm)
    monkeypatch.setenv("LATQ_KERNEL", "bogus")
    with pytest.raises(SystemExit) as e:
        serve.main([str(ck), "--port", "9"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("latq-serve: error: environment variable LATQ_KERNEL='bogus': "
                                                "expected one of ") and err.count("\n") == 1, err
    assert "reference" in err


def test_the_plugin_refuses_a_bogus_kernel_while_vllm_builds_its_config(ck, monkeypatch):
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm_latq.plugin.config import LatqConfig, LatqEnvironmentRefused
    qc = Checkpoint(ck).config["quantization_config"]
    monkeypatch.setenv("LATQ_KERNEL", "bogus")
    with pytest.raises(LatqEnvironmentRefused) as e:
        LatqConfig.from_config(qc).maybe_update_config(str(ck), hf_config=SimpleNamespace(quantization_config=qc))
    assert str(e.value).startswith("latq: environment variable LATQ_KERNEL='bogus': expected one of ")
    assert not isinstance(e.value, ValueError)   # pydantic would fold a ValueError into a ValidationError


def _read_variables() -> set[str]:
    """Every LATQ_* variable the package reads: string constants naming one, and the C++ getenv calls."""
    names = set()
    for f in (REPO / "vllm_latq").rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and re.fullmatch(r"LATQ_[A-Z0-9_]+", node.value):
                names.add(node.value)
    for f in (REPO / "vllm_latq").rglob("*.cpp"):
        names |= set(re.findall(r'getenv\("(LATQ_[A-Z0-9_]+)"\)', f.read_text()))
    return names


def test_every_variable_the_package_reads_is_documented_and_refusable():
    read = _read_variables()
    documented = set(re.findall(r"^\| `(LATQ_[A-Z0-9_]+)` \|", DOC.read_text(), re.M))
    assert read == documented == set(BAD), (read ^ documented, read ^ set(BAD))

