"""scripts/setup.sh, the first thing a newcomer runs: it says its steps on stderr, keeps stdout for what the
command after it prints (the demo's table), and drops setuptools' editable-install warning block."""
from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SETUP = ROOT / "scripts" / "setup.sh"

BLOCK = """\
  overlay/site-packages/setuptools/command/editable_wheel.py:354: \
BuildBackendWarning: Editable installation.
  !!

          ********************************************************************************
          Please be careful with folders in your working directory with the same
          name as your package as they may take precedence during imports.
          ********************************************************************************

  !!
    with strategy, WheelFile(wheel_path, "w") as wheel_obj:
"""


def _quiet_function() -> str:
    """setup.sh's ``quiet() { … }`` as it stands there."""
    src = SETUP.read_text()
    return src[src.index("quiet() {"):src.index("\n}\n", src.index("quiet() {")) + 3]


def _quiet(text: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f"set -o pipefail\n{_quiet_function()}quiet cat"], input=text,
                          capture_output=True, text=True)


def test_pip_output_goes_to_stderr_without_the_editable_warning_block():
    r = _quiet("Collecting torch\n" + BLOCK + "WARNING: /opt/x is ignored: it is neither a file nor a directory\n"
               "Successfully installed vllm-latq\n")
    assert r.returncode == 0 and r.stdout == ""
    assert r.stderr == "Collecting torch\nSuccessfully installed vllm-latq\n"


def test_a_failing_pip_fails_setup():
    r = subprocess.run(["bash", "-c", f"set -euo pipefail\n{_quiet_function()}quiet false\necho after"],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "after" not in r.stdout


def test_an_up_to_date_setup_says_so_on_stderr_and_nothing_on_stdout():
    want = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + SETUP.read_bytes()).hexdigest()[:16]
    stamp = ROOT / ".venv" / ".latq-setup-stamp"
    if not stamp.is_file() or stamp.read_text().strip() != want:
        pytest.skip("this checkout's .venv was set up by another setup.sh: running it would install")
    r = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "latq setup: up to date\n")
