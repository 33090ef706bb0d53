"""A run stopped at each stage of writing OUT: the next run finishes or undoes the replace and says
which, moves a checkpoint the stopped run sealed instead of computing it again, and a second run is
kept off a held OUT even when its lock file is deleted by hand."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vllm_latq.commands import quantize as cli
from vllm_latq.format import output_dir
from vllm_latq.format.files import MANIFEST_FILE, TEMP_MARK
from vllm_latq.format.manifest import digest_of
from vllm_latq.format.output_dir import LOCK_SUFFIX, OLD_SUFFIX
from vllm_latq.quantize import faults
from vllm_latq.quantize.output import TMP_SUFFIX

RTN = ["--method", "rtn", "--group-size", "32", "--no-progress"]
NEW = [*RTN, "--bits", "3", "--overwrite"]   # the run that replaces a 4-bit checkpoint
ROOT = Path(__file__).resolve().parents[2]


class Killed(BaseException):
    """Stands for SIGKILL in-process: no handler of the run catches it."""


@pytest.fixture
def source(tiny_llama, tmp_path):
    shutil.copytree(tiny_llama, tmp_path / "models" / "tiny")
    return tmp_path / "models" / "tiny"


@pytest.fixture
def out(source, tmp_path):
    """A 4-bit checkpoint the tests replace."""
    assert cli.main([str(source), str(tmp_path / "ck"), *RTN]) == 0
    return tmp_path / "ck"


def _beside(out: Path, suffix: str) -> Path:
    return out.with_name(out.name + suffix)


def _stop_at(monkeypatch, stage: str) -> None:
    def hook(reached):
        if reached == stage:
            raise Killed(stage)
    monkeypatch.setattr(faults, "at", hook)


def _solved(monkeypatch) -> list[str]:
    """The layers the next run solves (none: nothing computed again)."""
    from vllm_latq.quantize import solve_layers
    names, solve = [], solve_layers.solve
    monkeypatch.setattr(solve_layers, "solve", lambda m, W, H, name, **kw: (names.append(name), solve(m, W, H, name,
                                                                                                        **kw))[1])
    return names


def _only(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name != "models")


@pytest.mark.parametrize("stage", ["sealed", "aside", "replaced", "removing-old"])
def test_a_run_killed_at_each_stage_of_the_replace_is_finished_by_the_next(source, out, stage, monkeypatch, capsys):
    old_digest = digest_of(out)
    _stop_at(monkeypatch, stage)
    with pytest.raises(Killed):
        cli.main([str(source), str(out), *NEW])
    tmp, old = _beside(out, TMP_SUFFIX), _beside(out, OLD_SUFFIX)
    new_digest = digest_of(tmp if stage in ("sealed", "aside") else out)
    assert new_digest != old_digest
    assert os.path.lexists(out) == (stage != "aside") and os.path.lexists(old) == (stage != "sealed")
    if stage == "removing-old":
        assert (old / TEMP_MARK).is_file() and not (old / MANIFEST_FILE).exists()   # no longer a checkpoint
    assert _beside(out, LOCK_SUFFIX).is_file()   # it records the sealed checkpoint
    capsys.readouterr()
    monkeypatch.undo()
    solved = _solved(monkeypatch)
    assert cli.main([str(source), str(out), *NEW]) == 0
    err = capsys.readouterr().err
    assert solved == [] and "not computed again" in err, err
    if stage != "sealed":
        assert "interrupted --overwrite" in err and str(old) in err, err
    assert digest_of(out) == new_digest and _only(out) == ["ck"]


def test_the_checkpoint_moved_aside_is_restored_when_the_new_one_is_not_complete(source, out, monkeypatch, capsys):
    old_digest = digest_of(out)
    _stop_at(monkeypatch, "aside")
    with pytest.raises(Killed):
        cli.main([str(source), str(out), *NEW])
    tmp = _beside(out, TMP_SUFFIX)
    (tmp / "model.safetensors.index.json").write_text("{}")   # the new checkpoint no longer verifies
    monkeypatch.undo()
    capsys.readouterr()
    assert cli.main([str(source), str(out), *RTN]) == 2   # no --overwrite: OUT is back, and kept
    err = capsys.readouterr().err
    assert f"restored {out} from {_beside(out, OLD_SUFFIX)}" in err and f"{out} exists" in err, err
    assert digest_of(out) == old_digest and not _beside(out, OLD_SUFFIX).exists()


def test_a_sealed_run_directory_of_other_options_is_computed_again(source, out, monkeypatch, capsys):
    _stop_at(monkeypatch, "sealed")
    with pytest.raises(Killed):
        cli.main([str(source), str(out), *NEW])
    monkeypatch.undo()
    solved = _solved(monkeypatch)
    assert cli.main([str(source), str(out), *NEW, "--bits", "2"]) == 0
    assert solved and "not computed again" not in capsys.readouterr().err
    assert output_dir.sealed_digest(out) and _only(out) == ["ck"]


def _make_read_only(d: Path) -> None:
    if os.geteuid() != 0:
        d.chmod(0o555)
    elif subprocess.run(["chattr", "+i", str(d)], capture_output=True).returncode != 0:
        pytest.skip("root, and chattr +i is not available here: a read-only folder cannot be made")


def _make_writable(d: Path) -> None:
    if os.geteuid() != 0:
        d.chmod(0o755)
    else:
        subprocess.run(["chattr", "-i", str(d)], check=True)


def test_a_read_only_folder_at_the_final_rename_is_named_and_the_rerun_moves_the_checkpoint(source, tmp_path,
                                                                                            monkeypatch, capsys):
    """Not the lock file's unlink: the folder that holds OUT, and where the sealed checkpoint stays."""
    parent = tmp_path / "outs"
    parent.mkdir()
    out = parent / "ck"
    monkeypatch.setattr(faults, "at", lambda stage: _make_read_only(parent) if stage == "sealed" else None)
    try:
        assert cli.main([str(source), str(out), *RTN]) == 2
    finally:
        _make_writable(parent)
    err = capsys.readouterr().err
    assert f"cannot move {_beside(out, TMP_SUFFIX)} there" in err and f"is the folder {parent} writable?" in err, err
    assert LOCK_SUFFIX not in err and not out.exists()
    monkeypatch.undo()
    solved = _solved(monkeypatch)
    assert cli.main([str(source), str(out), *RTN]) == 0
    assert solved == [] and output_dir.sealed_digest(out) and _only(out) == ["ck"]


def _run(source, out, *args, env=None):
    """latq-quantize in a process of its own (a signal stops that process, not the tests)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "vllm_latq.commands.quantize", str(source), str(out), *args],
                            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(p: subprocess.Popen) -> str:
    """``p``'s stderr once it ended; killed if it has not ended in time (no process of a test outlives it)."""
    try:
        return p.communicate(timeout=900)[1]
    except subprocess.TimeoutExpired:
        p.kill()
        raise


def _status(p: subprocess.Popen) -> int:
    """``p``'s next wait status: stopped or ended (killed after 900 s, so no test waits forever)."""
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        pid, status = os.waitpid(p.pid, os.WUNTRACED | os.WNOHANG)
        if pid:
            return status
        time.sleep(0.2)
    p.kill()
    raise TimeoutError(f"{p.args} neither stopped nor ended in 900 s")


def _until_done(p: subprocess.Popen) -> int:
    """Continue ``p`` each time it stops itself (after every block) → its exit code."""
    while os.WIFSTOPPED(status := _status(p)):
        os.kill(p.pid, signal.SIGCONT)
    return os.waitstatus_to_exitcode(status)


def test_a_second_run_is_refused_while_the_first_is_paused_even_if_the_lock_file_is_deleted(source, tmp_path):
    out = tmp_path / "ck"
    first = _run(source, out, *RTN, env={faults.AT_ENV: "saved-block:stop"})
    try:
        status = _status(first)   # paused after its first block, holding OUT
        assert os.WIFSTOPPED(status), first.stderr.read()
        run_dir = _beside(out, TMP_SUFFIX)
        before = sorted(p.name for p in run_dir.iterdir())
        assert "model-00001-of-00003.safetensors" in before
        _beside(out, LOCK_SUFFIX).unlink()
        second = _run(source, out, *RTN)
        err = _finish(second)
        assert second.returncode == 2, err
        assert f"{out} is being written by another run (latq-quantize, pid {first.pid}" in err, err
        assert f"its run directory {run_dir} is locked" in err and sorted(p.name for p in run_dir.iterdir()) == before
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert _until_done(first) == 0, first.stderr.read()
    assert output_dir.sealed_digest(out) and _only(out) == ["ck"]


@pytest.mark.slow
@pytest.mark.parametrize("stage", faults.STAGES[1:])
def test_sigkill_at_each_stage_then_the_rerun_finishes(source, out, stage):
    """The in-process stand-in above, with a real SIGKILL at the hook."""
    killed = _run(source, out, *NEW, env={faults.AT_ENV: f"{stage}:kill"})
    err = _finish(killed)
    assert killed.returncode == -signal.SIGKILL, err
    rerun = _run(source, out, *NEW)
    err = _finish(rerun)
    assert rerun.returncode == 0 and "not computed again" in err, err
    assert output_dir.sealed_digest(out) and _only(out) == ["ck"]


@pytest.mark.slow
def test_sigkill_after_a_saved_block_then_resume(source, out):
    killed = _run(source, out, *NEW, env={faults.AT_ENV: "saved-block:kill"})
    err = _finish(killed)
    assert killed.returncode == -signal.SIGKILL, err
    assert (_beside(out, TMP_SUFFIX) / "latq_progress.json").is_file()
    rerun = _run(source, out, *NEW, "--resume")
    err = _finish(rerun)
    assert rerun.returncode == 0 and "model.layers.0." not in err and "model.layers.1." in err, err
    assert output_dir.sealed_digest(out) and _only(out) == ["ck"]
