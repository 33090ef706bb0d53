"""The README's claims that are not numbers from a bench or the study (those are checked in
tests/bench/test_study.py): the kernel table against the kernel selection's rules, the model tables
against the architectures the tests run, and the usage block against the real commands."""
from __future__ import annotations

import re
from pathlib import Path

from tests.kernels import test_vllm_kernels
from tests.quantize import test_model_architectures
from vllm_latq.testing import moe_models

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def _section(title: str) -> str:
    return README.split(f"## {title}\n")[1].split("\n## ")[0]


def test_kernel_table_states_the_selection_rule():
    """'Machete on sm_90 for groups G…, Marlin otherwise' is what the selection test expects
    (and asserts under stubbed sm_80–90) for the default form at each group size."""
    m = re.search(r"Machete on sm_(\d+) for groups ([\d/]+), Marlin otherwise", _section("Kernels"))
    assert m, "the kernel table no longer states where Machete and Marlin serve the default form"
    said = {(int(m[1]), int(g)) for g in m[2].split("/")}
    cases = {32: "4bit-g32", 64: "4bit-g64 (default)", 128: "4bit-g128"}
    machete = {(cc, g) for cc in test_vllm_kernels.CCS for g, case in cases.items()
               if test_vllm_kernels._expected(case, cc)[1] == "MacheteLinearKernel"}
    assert said == machete


def test_model_tables_list_what_the_tests_run():
    text = _section("Models")
    row = lambda label: re.search(rf"^\| {label}[^|]*\| (.+) \|$", text, re.M)[1]  # noqa: E731
    dense = re.findall(r"`(\w+)`", row("tiny random models"))
    assert dense == test_model_architectures.ARCHS
    assert f"of {len(dense)} types" in text
    assert re.findall(r"`(\w+)`", row("mixtures of experts")) == list(moe_models.ARCHS)
    refused = set(test_model_architectures.REFUSED)
    assert {"gpt2", "gpt_oss"} == refused and "GPT-2" in text and "GPT-OSS" in text


def test_usage_block_names_real_commands_and_options():
    """Each usage line runs a console script of pyproject.toml (or torchrun / vllm), and every
    --option it passes to latq-quantize exists in its parser."""
    import tomllib
    from vllm_latq.commands import quantize as cli
    scripts = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]["scripts"]
    block = _section("Use").split("```bash\n")[1].split("```")[0]
    options = {s for a in cli.parser()._actions for s in a.option_strings}
    for line in block.splitlines():
        cmd = line.split("  #")[0].split()
        cmd = cmd[1:] if cmd[0].startswith("OMP_NUM_THREADS=") else cmd
        assert cmd[0] in (*scripts, "torchrun", "vllm"), line
        if cmd[0] == "latq-quantize" or "vllm_latq.quantize" in cmd:
            assert {w for w in cmd if w.startswith("--") and not w.startswith("--nproc")} <= options, line
