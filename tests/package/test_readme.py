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


def test_python_example_names_real_functions_and_options():
    """The README's Python block imports what exists and passes only options those functions take."""
    import importlib
    import inspect
    from vllm_latq.quantize.options import QuantizeOptions
    block = _section("Python").split("```python\n")[1].split("```")[0]
    for mod, names in re.findall(r"^from ([\w.]+) import (.+)$", block, re.M):
        m = importlib.import_module(mod)
        assert all(hasattr(m, n.strip()) for n in names.split(",")), (mod, names)
    fields = set(inspect.signature(QuantizeOptions).parameters)
    for call in re.findall(r"QuantizeOptions\(([^)]*)\)", block):
        assert {kw.split("=")[0].strip() for kw in call.split(",")} <= fields, call
    from vllm_latq.commands.evaluate import evaluate
    assert "ppl" in inspect.getsource(evaluate)


def test_methods_table_lists_the_methods_latq_quantize_takes():
    from vllm_latq.commands import quantize as cli
    choices = next(a.choices for a in cli.parser()._actions if "--method" in a.option_strings)
    listed = set(re.findall(r"^\| `(\w+)`(?:, `(\w+)`)?", _section("Methods"), re.M))
    listed = {m for pair in listed for m in pair if m}
    assert listed == set(choices) - {"babai"}, (listed, choices)
