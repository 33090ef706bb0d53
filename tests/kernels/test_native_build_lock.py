"""No stale lock hangs a load of the C++ ops (``vllm_latq/native.py``): torch's build lock is a
plain file that a builder killed mid-build leaves behind, and torch's loader then polls for it
forever; latq's own lock (a flock, gone with its holder) lets the next load remove it, and a load
that waits for a live builder says so at once. Each load runs in a child process under a timeout,
so a hang fails the test."""
from __future__ import annotations

import fcntl
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vllm_latq import native

ROOT = Path(__file__).resolve().parents[2]
LOAD = "from vllm_latq import native; import sys; why = native.load(); print(why); sys.exit(why is not None)"

pytestmark = pytest.mark.usefixtures("native_ops")


def _env(**extra) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "OMP_NUM_THREADS": "1", **extra}


def _stderr_until(p: subprocess.Popen, text: str, seconds: float) -> str:
    """The child's stderr up to the line holding ``text``, or all it wrote within ``seconds``."""
    got, deadline = "", time.monotonic() + seconds
    while text not in got and time.monotonic() < deadline:
        ready, _, _ = select.select([p.stderr], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        line = p.stderr.readline()
        if not line:
            break
        got += line
    return got


@pytest.fixture
def built(tmp_path):
    """(a private copy of the built library's folder, the extensions root to load it from): the lock
    files these tests plant stay out of the folder other test workers' processes load from."""
    import shutil
    src = Path(native.build_directory())
    folder = tmp_path / src.name
    shutil.copytree(src, folder, ignore=shutil.ignore_patterns(native.TORCH_LOCK_FILE, native.FLOCK_FILE))
    return folder, str(tmp_path)


def test_a_stale_torch_lock_does_not_hang_a_load(built):
    """A torch ``lock`` file left in the (built) library's folder, as a killed build leaves it: the
    next load removes it, says so, and loads (the library is built: seconds, not a hang)."""
    folder, root = built
    stale = folder / native.TORCH_LOCK_FILE
    fd = os.open(stale, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    os.close(fd)
    try:
        p = subprocess.run([sys.executable, "-c", LOAD], cwd=ROOT, env=_env(TORCH_EXTENSIONS_DIR=root),
                           capture_output=True, text=True, timeout=180)
        assert p.returncode == 0, p.stdout + p.stderr
        assert f"latq: removed {stale}, the build lock of a build that was killed" in p.stderr, p.stderr
        assert "building" not in p.stderr, p.stderr   # built already: nothing to say
        assert not stale.exists()
    finally:
        stale.unlink(missing_ok=True)


def test_a_build_says_so_before_it_starts(tmp_path):
    """A load that has to build (no library in the folder) says so first: the compiler prints nothing for
    minutes. The compiler is stubbed here: it fails at once, and the load falls back to the torch paths."""
    stub = ("import torch.utils.cpp_extension as c\n"
            "def build(**kw): raise RuntimeError('no compiler here')\n"
            "c.load = build\n" + LOAD)
    p = subprocess.run([sys.executable, "-c", stub], cwd=ROOT, env=_env(TORCH_EXTENSIONS_DIR=str(tmp_path)),
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 1 and "no compiler here" in p.stdout, p.stdout + p.stderr
    [folder] = tmp_path.iterdir()
    assert p.stderr.startswith(f"latq: building the C++ ops for this CPU in {folder} (once; minutes)\n"), p.stderr


def test_a_load_waiting_for_a_live_builder_says_so(built):
    """While another process holds the build lock (a live build), a load waits for it and says so
    on stderr within seconds, naming that process; it loads once the lock is released."""
    folder, root = built
    fd = os.open(os.path.join(folder, native.FLOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    p = subprocess.Popen([sys.executable, "-c", LOAD], cwd=ROOT, env=_env(TORCH_EXTENSIONS_DIR=root),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        said = _stderr_until(p, "latq: waiting", seconds=60)
        assert f"latq: waiting for process {os.getpid()}, which is building the C++ ops in {folder}" in said, said
        assert p.poll() is None
    finally:
        os.close(fd)   # the "builder" ends
        out, err = p.communicate(timeout=180)
    assert p.returncode == 0, out + err



def test_a_load_waiting_a_moment_says_nothing(built):
    """A holder that lets go within native.QUIET_WAIT_S (a rank loading the built library beside
    another) costs the load that moment and no line."""
    folder, root = built
    fd = os.open(os.path.join(folder, native.FLOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    ready = "from vllm_latq import native; import sys; print('ready', flush=True); sys.stdin.readline(); "
    p = subprocess.Popen([sys.executable, "-c", ready + LOAD.partition("; ")[2]], cwd=ROOT,
                         env=_env(TORCH_EXTENSIONS_DIR=root), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        p.stdin.write("go\n")
        p.stdin.flush()
        time.sleep(native.QUIET_WAIT_S / 3)   # the load is at the lock, held
    finally:
        os.close(fd)
    out, err = p.communicate(timeout=180)
    assert p.returncode == 0, out + err
    assert "latq: waiting" not in err, err

def _orphans_gone(folder: Path, seconds: float) -> None:
    """Waits until no process works in ``folder``: ninja runs each compiler in a process group of its
    own, so a killed build's compilers outlive it and would write the objects the next build writes."""
    deadline = time.monotonic() + seconds
    while busy := _working_in(folder):
        assert time.monotonic() < deadline, f"processes {busy} still build in {folder}"
        time.sleep(1)


@pytest.mark.slow
def test_a_build_killed_midway_leaves_nothing_that_stops_the_next(built):
    """A real build, killed (its whole process group) while its compiler works: the next load builds and
    loads the library. The build starts from a copy of the built folder without the library and one
    object (the smallest translation unit: one compile, not a whole build, each time)."""
    folder, root = built
    (folder / f"{native._name()}.so").unlink()
    (folder / "gram.o").unlink()
    env = _env(TORCH_EXTENSIONS_DIR=root)
    p = subprocess.Popen([sys.executable, "-c", LOAD], cwd=ROOT, env=env, start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not (folder / native.TORCH_LOCK_FILE).exists() or not _compiling(folder):
        assert p.poll() is None and time.monotonic() < deadline, "the build never ran a compiler"
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
    _orphans_gone(folder, seconds=900)
    assert (folder / native.TORCH_LOCK_FILE).exists(), "the killed build left no lock: nothing tested"
    # its own session: on a timeout its compilers go with it
    q = subprocess.Popen([sys.executable, "-c", LOAD], cwd=ROOT, env=env, start_new_session=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = q.communicate(timeout=1200)
    finally:
        if q.poll() is None:
            os.killpg(q.pid, signal.SIGKILL)
            q.wait()
    assert q.returncode == 0, out + err
    assert "the build lock of a build that was killed" in err and "latq: building the C++ ops" in err, err
    assert (folder / f"{native._name()}.so").exists()


COMPILERS = {"cc1plus", "clang", "clang++"}   # the process that compiles: GCC's or Clang's


def _compiling(folder: Path) -> bool:
    """Whether a compiler works in ``folder``."""
    return any(_comm(pid) in COMPILERS for pid in _working_in(folder))


def _comm(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _working_in(folder: Path) -> list[str]:
    """The processes whose working directory is in ``folder``."""
    busy = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/cwd").startswith(str(folder)):
                busy.append(pid)
        except OSError:
            continue
    return busy


def test_two_checkouts_of_the_same_sources_build_in_folders_of_their_own(tmp_path, monkeypatch):
    """Sharing a folder, each checkout's load would rebuild the other's library (its build.ninja names
    the other's paths) and hold the lock for the whole build."""
    here = native._name()
    copies = []
    for f in native.SOURCES:
        c = tmp_path / f.relative_to(ROOT / "vllm_latq")
        c.parent.mkdir(parents=True, exist_ok=True)
        c.write_text(f.read_text())
        copies.append(c)
    monkeypatch.setattr(native, "SOURCES", tuple(copies))
    assert native._name() != here
    monkeypatch.setattr(native, "SOURCES", tuple(copies))
    assert native._name() == native._name()
