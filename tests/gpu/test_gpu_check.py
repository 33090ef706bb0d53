"""scripts/gpu_check.sh without a GPU: the script parses, runs vLLM's warm-up + capture test
(tests/gpu/test_gpu_capture.py) among its GPU test files, and its ``-k`` shards leave no GPU test
out — a test added without a bit-width id still runs in a shard on a lent GPU; its dry run (the
figures' pieces on the CPU, fake timers) writes docs/gpu/latest.json's schema."""
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.sh"


def listed() -> tuple[list[str], list[str]]:
    out = subprocess.run(["bash", str(SCRIPT), "--list-shards"], capture_output=True, text=True, check=True,
                         cwd=REPO).stdout.splitlines()
    files = next(line for line in out if line.startswith("files: "))[7:].split()
    return files, [line[7:] for line in out if line.startswith("shard: ")]


def gpu_test_ids(files: list[str]) -> list[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                          *files], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return [line for line in out.stdout.splitlines() if "::" in line]


def test_script_parses_and_lists_the_capture_test():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    files, shards = listed()
    assert "tests/gpu/test_gpu_capture.py" in files and all((REPO / f).is_file() for f in files)
    assert len(shards) == 18 and len(set(shards)) == 18


def test_every_gpu_test_falls_in_a_shard():
    expression = pytest.importorskip("_pytest.mark.expression")      # pytest's own -k evaluator
    files, shards = listed()
    ids = gpu_test_ids(files)
    assert any(re.search(r"test_gpu_capture\.py::test_(dense|moe)_capture\[[2-5]bit\]", i) for i in ids)
    compiled = [expression.Expression.compile(s) for s in shards]
    for nodeid in ids:
        names = nodeid.lower()                                         # module, function and parameter ids

        def matcher(word, **_):
            return word.lower() in names
        hits = [s for s, e in zip(shards, compiled) if e.evaluate(matcher)]
        assert len(hits) == 1, (nodeid, hits)


def test_a_bad_phase_is_refused_naming_it(tmp_path):
    run = subprocess.run(["bash", str(SCRIPT), "--phase", "tests", str(tmp_path)], capture_output=True, text=True)
    assert run.returncode == 2 and "--phase must be all, figures, rest or e8 (got tests)" in run.stderr


def test_e8_phase_solve_command_runs_on_the_cpu(capsys):
    """The e8 phase's solver bench, its own arguments with the device, shapes and tokens made small and CPU:
    the options exist and the run ends with E8-3b's and GPTQ-4b's keys (CUDA: tests/gpu/test_solvers_cuda.py)."""
    from bench import solver_speed
    text = SCRIPT.read_text().replace("\\\n", " ")
    line = next(x for x in text.splitlines() if "run solver_e8.log" in x)
    args = shlex.split(line.split("-m bench.solver_speed", 1)[1])
    small = {"--device": "cpu", "--e8-shapes": "32x64,16x64", "--e8-tokens": "128"}
    assert set(small) <= set(args)
    args = [small.get(args[i - 1], a) if i else a for i, a in enumerate(args)]
    solver_speed.main(args)
    head = capsys.readouterr().out.strip().splitlines()[-1]
    assert head.startswith("HEADLINE ") and set(dict(kv.split("=") for kv in head.split()[1:])) == \
        {"e8_3b_vs_gptq", "e8_3b_s", "gptq_4b_s"}


@pytest.mark.slow
def test_dry_run_writes_the_figures_schema(tmp_path):
    """The first call's pieces — kernel bench with its peers, the codebook kernels, end-to-end decode,
    merge — on the CPU in Triton's interpreter with fake timers; latest.json comes out in the schema,
    nothing else of the checkout is written."""
    from bench import gpu_figures as gf
    env = dict(os.environ, PYTHON=sys.executable, GPU_CHECK_COMMIT="ab65128", OMP_NUM_THREADS="1")
    before = (REPO / "docs" / "gpu" / "latest.json").read_bytes() if (REPO / "docs" / "gpu" / "latest.json").exists() \
        else None
    run = subprocess.run(["bash", str(SCRIPT), "--dry-run", str(tmp_path)], capture_output=True, text=True, env=env,
                         cwd=REPO, timeout=1200)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    doc = json.loads((tmp_path / "latest.json").read_text())
    assert not gf.check(doc) and doc["device"] == "dry run (CPU, fake timers)" and doc["commit"] == "ab65128"
    assert {(p["shape"], p["m"]) for p in doc["points"]} == {(s, m) for s in gf.SHAPES for m in (1, 8)}
    assert all(p["peers"]["gemlite"] is None and p["peers"]["torch_int4"] for p in doc["points"])
    assert {(e["form"], e["batch"]) for e in doc["e2e"]} == {(f, b) for f in ("ssqr-1%-4b", "e8-3b-s4-g16")
                                                            for b in (1, 2)}
    assert {(p["form"], p["shape"], p["m"]) for p in doc["e8_points"]} == {("e8-3b-s4-g16", "8b.down", m) for m in (1, 8)}
    assert [p["lds_us"] is not None for p in sorted(doc["e8_points"], key=lambda p: p["m"])] == [True, False]
    summary = (tmp_path / "summary.txt").read_text()
    assert "kernels.log: exit 0" in summary and "e2e.log: exit 0" in summary and "no speed" in summary
    after = (REPO / "docs" / "gpu" / "latest.json").read_bytes() if (REPO / "docs" / "gpu" / "latest.json").exists() \
        else None
    assert after == before
