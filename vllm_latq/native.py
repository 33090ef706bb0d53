"""The package's C++ ops, compiled on first use into one library (docs/ARCHITECTURE.md, "C++ helpers").
Without a compiler, or with ``LATQ_CPU_NATIVE=0``, callers keep their pure-torch paths (same math)."""
from __future__ import annotations

import contextlib
import contextvars
import hashlib
import logging
import os
import platform
import sys
import time
from pathlib import Path

import torch

from . import env

log = logging.getLogger("vllm_latq")

ENV = "LATQ_CPU_NATIVE"
LOOP_ENV = "LATQ_CPU_LOOP_MAX"
# read by the C++ library itself as it loads: checked here first (the rules of env.flag / env.choice)
GEMV_ENV = "LATQ_CPU_GEMV"    # 0/false: torch's int4 op instead of the GEMV
ISA_ENV = "LATQ_CPU_ISA"      # avx2: the GEMV's AVX2 code where AVX-512 BF16 runs too
ISA_CHOICES = ("avx2", "best")
SOURCES = (Path(__file__).parent / "kernels" / "cpu" / "csrc" / "latq_cpu.cpp",
           Path(__file__).parent / "kernels" / "cpu" / "csrc" / "hadamard.cpp",
           Path(__file__).parent / "kernels" / "cpu" / "csrc" / "codebook.cpp",
           Path(__file__).parent / "kernels" / "cpu" / "csrc" / "codebook_a8.cpp",
           Path(__file__).parent / "algorithms" / "csrc" / "sweep.cpp",
           Path(__file__).parent / "algorithms" / "csrc" / "scales.cpp",
           Path(__file__).parent / "algorithms" / "csrc" / "e8.cpp",
           Path(__file__).parent / "algorithms" / "csrc" / "e8_sweep.cpp",
           Path(__file__).parent / "quantize" / "csrc" / "gram.cpp")
# included by SOURCES: hashed with them, so an edit rebuilds
HEADERS = (Path(__file__).parent / "algorithms" / "csrc" / "e8_search.h",
           Path(__file__).parent / "kernels" / "cpu" / "csrc" / "codebook.h")
# the build's target: this CPU, or another (LATQ_CPU_MARCH=x86-64-v3 builds what an AVX2-only
# CPU builds, so an AVX-512 machine can test that build's code paths)
MARCH_ENV = "LATQ_CPU_MARCH"


def march() -> str:
    return env.text(MARCH_ENV, r"[A-Za-z0-9][A-Za-z0-9_.+-]*", "a -march name (letters, digits, _.+-)") or "native"


def enabled() -> bool:
    """Whether the C++ ops may be built and used (``LATQ_CPU_NATIVE``, default on)."""
    return env.flag(ENV, True)


def loop_max() -> int:
    """Outliers up to which the C++ loop sums them at M = 1 (M = 2..16: always the loop); above, MKL."""
    return env.integer(LOOP_ENV, 16384, minimum=0, maximum=2**62)


LOOP_MAX = loop_max()


def check_library_switches() -> None:
    """The switches the C++ library reads as it loads, parsed as the package parses its own."""
    env.flag(GEMV_ENV, True)
    env.choice(ISA_ENV, ISA_CHOICES)


def cflags() -> list[str]:
    # -fopenmp: at::parallel_for (the solvers' whole-matrix helpers) is an OpenMP pragma in ATen's
    # headers, serial unless this build enables OpenMP
    return ["-O3", f"-march={march()}", "-fopenmp"]


_UNSET = object()
_STATUS: "str | None | object" = _UNSET   # None: loaded; a string: why not


def _name() -> str:
    # -march=native code is only valid on this CPU: the build cache is keyed by it and the flags
    cpu = f"{platform.machine()}-{torch.backends.cpu.get_cpu_capability()}-{torch.__version__}"
    src = "".join(f.read_text() for f in SOURCES + HEADERS)
    # the sources' folder too: two checkouts of the same sources would otherwise share a build folder,
    # and each load from the other rebuilds it (its build.ninja names the other's paths)
    where = str(SOURCES[0].resolve().parent)
    return "latq_cpu_" + hashlib.sha256((cpu + " ".join(cflags()) + where + src).encode()).hexdigest()[:12]


# torch's build lock is a plain file (cpp_extension's FileBaton: created, removed when the build
# ends): a builder killed mid-build leaves it and every later load polls for it forever, silent.
# Every latq load takes this flock first, which dies with its holder: holding it, no latq builder
# is alive, so a torch lock still there is stale and is removed.
FLOCK_FILE = "latq_build.flock"
TORCH_LOCK_FILE = "lock"


def build_directory() -> str:
    """The folder torch builds (and finds) this host's library in (``TORCH_EXTENSIONS_DIR``, else torch's default)."""
    from torch.utils.cpp_extension import _get_build_directory
    return _get_build_directory(_name(), verbose=False)


# a holder that only loads the built library (torchrun's ranks start together) lets go within this: no word
QUIET_WAIT_S = 2.0


def _flock_within(fd: int, seconds: float) -> bool:
    """Whether ``fd``'s exclusive flock was taken within ``seconds``."""
    import fcntl
    deadline = time.monotonic() + seconds
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


@contextlib.contextmanager
def build_lock(folder: str):
    """Holds ``folder``'s latq build lock (waiting for a live builder, saying so on stderr within
    :data:`QUIET_WAIT_S`), with a stale torch lock of a killed build removed."""
    import fcntl
    fd = os.open(os.path.join(folder, FLOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if not _flock_within(fd, QUIET_WAIT_S):
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            print(f"latq: waiting for process {holder}, which is building the C++ ops in {folder}",
                  file=sys.stderr, flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        stale = os.path.join(folder, TORCH_LOCK_FILE)
        if os.path.exists(stale):
            with contextlib.suppress(FileNotFoundError):
                os.remove(stale)
            print(f"latq: removed {stale}, the build lock of a build that was killed", file=sys.stderr, flush=True)
        yield
    finally:
        os.close(fd)   # releases the flock


def load() -> str | None:
    """Build/load the extension once per process → None if loaded, else why not."""
    global _STATUS
    if _STATUS is _UNSET:
        if not enabled():
            _STATUS = f"{ENV}={os.environ[ENV]}"
        else:
            check_library_switches()
            try:
                from torch.utils.cpp_extension import load as build
                folder = build_directory()
                with build_lock(folder):
                    if not os.path.exists(os.path.join(folder, f"{_name()}.so")):   # torch's compile says nothing
                        print(f"latq: building the C++ ops for this CPU in {folder} (once; minutes)", file=sys.stderr,
                              flush=True)
                    build(name=_name(), sources=[str(f) for f in SOURCES], extra_cflags=cflags(),
                          extra_ldflags=["-fopenmp"], build_directory=folder,
                          is_python_module=False, verbose=False)
                torch.library.register_fake("latq_cpu::linear", _fake)
                torch.library.register_fake("latq_cpu::codebook_linear", _fake)
                torch.library.register_fake("latq_cpu::codebook_linear_a8", _fake)
                torch.library.register_fake("latq_cpu::plain_linear", _fake_plain)
                torch.library.register_fake("latq_cpu::rotated_plain_linear", _fake_plain)
                torch.library.register_fake("latq_cpu::small_linear", _fake_small)
                torch.library.register_fake("latq_cpu::hadamard", lambda x, signs: torch.empty_like(x))
                torch.ops.latq_cpu.set_loop_max(LOOP_MAX)
                _STATUS = None
            except Exception as e:  # no compiler, no ninja, a failed build: keep the torch path
                _STATUS = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
                log.warning("latq: the C++ ops could not be built (%s); using the pure-torch paths", _STATUS)
    return _STATUS


def available() -> bool:
    return load() is None


# Scoped, not a module flag: tests and benches compare the C++ and pure-torch paths of the same
# call without leaking the switch into other tests or threads.
_ENABLED = contextvars.ContextVar("latq_native_enabled", default=True)


def usable() -> bool:
    """The C++ ops are built and not switched off by :func:`disabled` in this context."""
    return _ENABLED.get() and available()


@contextlib.contextmanager
def disabled(off: bool = True):
    """Within the block (``off=True``) every caller takes its pure-torch path."""
    token = _ENABLED.set(not off)
    try:
        yield
    finally:
        _ENABLED.reset(token)


def _fake(x, tensors, ints, bias, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


def _fake_plain(x, packed, scales, ints, out_features, signs=None):   # signs: rotated_plain_linear
    return x.new_empty((*x.shape[:-1], out_features))


def _fake_small(x, packed, scales_zeros, crow, col, val, tile_off, tile_rows, tile_col, tile_val, row_scale, bias,
                group_size, planes):
    return x.new_empty((x.shape[0], packed.shape[0]))
