"""scripts/gpu_check.sh without a GPU: the script parses, runs vLLM's warm-up + capture test
(tests/gpu/test_gpu_capture.py) among its GPU test files, and its ``-k`` shards leave no GPU test
out — a test added without a bit-width id still runs in a shard on a lent GPU."""
import re
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
