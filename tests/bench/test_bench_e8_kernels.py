"""bench/e8_kernels.py on a CPU: its dry run (Triton's interpreter, a fake timer) prints a row per batch and
a HEADLINE, the codebook kernel's outputs within the bench's error bound; without the interpreter it refuses."""
import os

import pytest

pytest.importorskip("triton")
from bench import e8_kernels  # noqa: E402


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the dry run needs Triton's interpreter")
def test_dry_run_prints_rows_and_a_headline(capsys):
    assert e8_kernels.main(["--dry-run", "--m", "1,9", "--bits", "4"]) == 0
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if ln.strip().startswith("64x256")]
    assert [int(r.split()[1]) for r in rows] == [1, 9]
    assert [r.split()[4] for r in rows] == ["1.0", "-"]     # the shared-memory GEMV timed below 8 rows
    assert all(float(r.split()[-1]) < e8_kernels.ERR_TOL for r in rows)
    assert "HEADLINE e8_kernels 8b.down M=1: triton-e8 1.0 us" in out          # 8b.down at 1/64: 64x256


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the dry run needs Triton's interpreter")
def test_sweep_times_every_tile_and_writes_them(tmp_path, monkeypatch, capsys):
    """``--sweep``: the GEMV at M = 1 on each of SWEEP's tiles (here two), each output checked, in the
    JSON as e8_sweep rows."""
    import json
    monkeypatch.setattr(e8_kernels, "SWEEP", [dict(BN=64, BKB=8, num_warps=4, LDS=False),
                                              dict(BN=128, BKB=16, num_warps=8, LDS=True)])
    out = tmp_path / "e8.json"
    args = ["--dry-run", "--shapes", "8b.down", "--m", "1", "--bits", "3", "--sweep", "--json", str(out)]
    assert e8_kernels.main(args) == 0
    rows = json.loads(out.read_text())["e8_sweep"]
    assert [r["config"] for r in rows] == e8_kernels.SWEEP and {r["shape"] for r in rows} == {"8b.down"}
    assert sum("M=1 {'BN'" in ln for ln in capsys.readouterr().out.splitlines()) == 2


def test_dry_run_needs_the_interpreter(monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert e8_kernels.main(["--dry-run"]) == 2
    assert "TRITON_INTERPRET=1" in capsys.readouterr().err
