"""The C++ op as an AVX2-only CPU builds and runs it, on any x86 machine: a subprocess with
``LATQ_CPU_MARCH=x86-64-v3`` (Haswell-class: AVX2, FMA, F16C, no AVX-512; its own build in the
extension cache) and ``ATEN_CPU_CAPABILITY=avx2`` (torch's AVX2 kernels, which pack int4 in
32-row blocks, not the GEMV's 64). The build leaves out the AVX-512 code (no ``LATQ_HAVE_GEMV``),
so its outlier finish runs as on such a CPU — only this runs that build here. And vLLM serving
a real checkpoint through it, as ``scripts/as_avx2_cpu.sh`` emulates such a machine.

Slow: the extra build takes about a minute on two shared cores (cached after), and the kernel's
exactness files run again inside it."""
from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_latq import native

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64-v3 is an x86 target"),
              pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")]

ROOT = Path(__file__).resolve().parents[2]
AVX2_ENV = {native.MARCH_ENV: "x86-64-v3", "ATEN_CPU_CAPABILITY": "avx2", "OMP_NUM_THREADS": "1"}

# what the subprocess reports: the build's compiled-in ISA, the dispatch, the loaded library and
# the prepared state of three layers (as in _states below)
PROBE = r"""
import hashlib, json, torch
from vllm_latq import native
assert native.load() is None, native.load()
from vllm_latq.kernels.cpu import kernel
from tests.kernels.test_cpu_avx2_build import _states
so = sorted({l.split()[-1] for l in open("/proc/self/maps") if "latq_cpu_" in l and l.rstrip().endswith(".so")})
print(json.dumps({"build": torch.ops.latq_cpu.build_isa(), "isa": torch.ops.latq_cpu.gemv_isa(),
                  "e8_isa": torch.ops.latq_cpu.codebook_isa(),
                  "has_gemv": torch.ops.latq_cpu.has_gemv(), "kernel_isa": kernel.gemv_isa(),
                  "op_reads": torch.ops.latq_cpu.op_reads_gemv_layout(),
                  "cap": torch.backends.cpu.get_cpu_capability(), "so": so, "states": _states()}))
"""


def _states() -> dict:
    """sha256 and served bytes of the CPU kernel's state for a 4-bit g64 layer (the default
    checkpoint's form), the same with coded scales (``--scale-bits 4``) and one with outliers."""
    from vllm_latq.kernels.cpu.kernel import CPUKernel
    from vllm_latq.testing.weights import random_weight
    out = {}
    for name, kw in (("g64", {}), ("coded", {"scale_bits": 4}), ("outliers", {"rate": 0.01})):
        w = random_weight(192, 576, 4, kw.get("rate", 0.0), group=64, seed=41,
                          **{k: v for k, v in kw.items() if k != "rate"})
        st = CPUKernel.prepare(w)
        tensors, ints = CPUKernel.flatten(st)
        h = hashlib.sha256(repr(list(ints)).encode())
        for t in tensors:
            h.update(b"-" if t is None else f"{t.dtype}{tuple(t.shape)}".encode() + t.contiguous().view(-1).view(
                torch.uint8).numpy().tobytes())
        out[name] = {"sha": h.hexdigest(), "bytes": CPUKernel.served_bytes(st)}
    return out


def _run(args, timeout, march="x86-64-v3"):
    env = {**os.environ, **AVX2_ENV, native.MARCH_ENV: march, "PYTHONPATH": str(ROOT)}
    return subprocess.run(args, cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _avx512_lines(so: str) -> list[str]:
    """Disassembly lines of ``so`` that use AVX-512 state: zmm, mask or xmm/ymm16–31 registers."""
    dis = subprocess.run(["objdump", "-d", "--no-show-raw-insn", so], capture_output=True, text=True, check=True)
    pat = re.compile(r"%zmm\d|%k[0-7]\b|%[xy]mm(1[6-9]|2\d|3[01])\b")
    return [ln for ln in dis.stdout.splitlines() if pat.search(ln)]


@pytest.fixture(scope="module")
def probe():
    out = _run([sys.executable, "-c", PROBE], timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_build_has_no_avx512_and_dispatches_to_the_avx2_gemv(probe):
    """The x86-64-v3 build compiles no AVX-512 (its macros, and not one AVX-512 register in the
    library's code), its GEMV runs on AVX2 although torch's AVX2 op packs another layout, and
    the kernel prepares the GEMV's state there."""
    assert probe["cap"] == "AVX2"
    assert probe["build"] == "gemv512=0 avx2fn=1 avx512f=0 avx2=1"
    assert (probe["isa"], probe["has_gemv"], probe["kernel_isa"], probe["op_reads"]) == ("avx2", True, "avx2", False)
    assert len(probe["so"]) == 1
    if shutil.which("objdump") is None:
        pytest.skip("no objdump to read the library's instructions (its macros were checked)")
    assert _avx512_lines(probe["so"][0]) == []
    if native.available() and torch.ops.latq_cpu.build_isa().startswith("gemv512=1"):   # the check sees AVX-512
        mine = [ln.split()[-1] for ln in open("/proc/self/maps") if "latq_cpu_" in ln and ln.rstrip().endswith(".so")]
        assert _avx512_lines(mine[0])


def test_served_state_equals_the_avx512_paths(probe):
    """The AVX2 path serves the same bytes as the AVX-512 one: 4.25 bits/weight for a 4-bit g64
    layer, coded scales as 12 bytes per 16 — and, where this machine runs the AVX-512 GEMV, the
    same state byte for byte."""
    N, K = 192, 576
    got = probe["states"]
    assert sum(got["g64"]["bytes"].values()) * 8 == 4.25 * N * K
    assert got["coded"]["bytes"]["scales"] == K // 64 * N // 16 * 12
    assert got["outliers"]["bytes"]["outliers"] > 0
    if not (native.available() and torch.ops.latq_cpu.gemv_isa() == "avx512"):
        pytest.skip("no AVX-512 GEMV here to compare the state with")
    assert got == _states()


def test_a_generic_x86_64_build_still_runs_the_avx2_gemv():
    """Built for plain x86-64 (a generic target, no AVX2 in it), the AVX2 code still compiles —
    each of its functions carries its own target — and is dispatched to at run time on an AVX2
    CPU, where the kernel's exactness tests pass through it."""
    probe = ("from vllm_latq import native; assert native.load() is None, native.load(); import torch; "
             "print(torch.ops.latq_cpu.build_isa(), torch.ops.latq_cpu.gemv_isa())")
    out = _run([sys.executable, "-c", probe], timeout=1800, march="x86-64")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-5:] == ["gemv512=0", "avx2fn=1", "avx512f=0", "avx2=0", "avx2"], out.stdout
    tests = _run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "tests/kernels/test_cpu_kernel.py",
                  "-k", "exact_vs_reference and native"], timeout=1800, march="x86-64")
    assert tests.returncode == 0, tests.stdout[-3000:]
    assert int(re.search(r"(\d+) passed", tests.stdout).group(1)) >= 20, tests.stdout[-2000:]


def test_vllm_serves_the_default_checkpoint_as_on_an_avx2_machine(tmp_path):
    """vLLM as an AVX2-only machine runs it (``scripts/as_avx2_cpu.sh``: vLLM's AVX2 build,
    torch, oneDNN and MKL capped at AVX2, latq's op built for x86-64-v3): SmolLM2's default
    checkpoint (GPTQ 4-bit g64) loads with the CPU kernel on every linear, whose GEMV runs on
    AVX2, and in fp32 (what latq-serve advises there) and bf16 its greedy tokens are HF's on the
    dequantized weights up to near-ties — in bf16, a step is judged by HF in fp32 or in bf16,
    whichever it is nearer to greedy under: a bf16 step moves logits by more than 0.1 of their
    std on some CPUs (0.15 on one CI machine)."""
    from tests import vllm_helpers as h
    from vllm_latq.format.checkpoint import load_dequantized_model

    ck = h.pipeline_checkpoint("smollm2-135m", "gptq")
    ids = h.tokenize(ck)
    hf = load_dequantized_model(ck, torch.float32)
    want = h.hf_greedy(hf, ids, 32)
    jobs = [{"model": ck, "prompt_ids": ids, "max_tokens": 32, "dtype": dtype, "env": {"LATQ_KERNEL": "cpu"}}
            for dtype in ("float32", "bfloat16")]
    res = h.run_vllm_jobs(jobs, tmp=tmp_path, timeout=3600, launcher=("bash", str(ROOT / "scripts/as_avx2_cpu.sh")))
    for r in res:
        assert "error" not in r, r.get("traceback")
        assert (r["vllm_build"], r["gemv_isa"]) == ("avx2", "avx2"), (r["vllm_build"], r["gemv_isa"])
    loaded = [line for line in res[0]["log"].splitlines() if "linears loaded" in line]
    assert len(loaded) == 2 and all(re.search(r"kernels \{'cpu': \d+\}", line) for line in loaded), loaded
    hf16 = load_dequantized_model(ck, torch.bfloat16)
    for dtype, r in zip(("float32", "bfloat16"), res):
        if r["tokens"] != want:
            margins = h.greedy_margins(hf if dtype == "float32" else (hf, hf16), ids, r["tokens"])
            assert max(margins) < 0.1, (dtype, margins)


def test_kernel_exactness_files_pass_in_the_avx2_build(probe):
    """What an AVX2-only machine runs of the CPU kernel's tests: every exactness test against
    the reference (GEMV, outlier tiles and CSR, coded scales, M = 1, 3, 8, 16 and large M, bf16 /
    fp16 / fp32 activations) through the x86-64-v3 build, and none of them skipped for lack of
    the C++ op or its GEMV."""
    out = _run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-rs",
                "tests/kernels/test_cpu_kernel.py", "tests/kernels/test_cpu_native.py"], timeout=3600)
    tail = out.stdout[-4000:] + out.stderr[-2000:]
    assert out.returncode == 0, tail
    m = re.search(r"(\d+) passed", out.stdout)
    assert m and int(m.group(1)) > 100, tail
    skips = [ln for ln in out.stdout.splitlines() if ln.startswith("SKIPPED")]
    assert not [ln for ln in skips if "unavailable" in ln or "GEMV is not built" in ln or "no GEMV" in ln], skips


def test_rotation_is_exact_in_the_avx2_build(probe):
    """A rotated layer on an AVX2-only machine: the C++ transform (AVX2 and scalar, the build has no
    AVX-512 path) bit for bit torch's, and the CPU kernel's lean and list ops on rotated inputs,
    through the x86-64-v3 build."""
    out = _run([sys.executable, "-m", "pytest", "-v", "-x", "-p", "no:cacheprovider", "-rs",
                "tests/kernels/test_rotation_kernels.py", "-k", "cpu"], timeout=3600)
    tail = out.stdout[-4000:] + out.stderr[-2000:]
    assert out.returncode == 0, tail
    m = re.search(r"(\d+) passed", out.stdout)
    assert m and int(m.group(1)) >= 20, tail
    assert "test_cpu_rotated_layer_through_the_lean_op[avx2] PASSED" in out.stdout, tail
    assert "test_cpu_transform_is_the_torch_one[avx2-256] PASSED" in out.stdout, tail
    # the instruction sets are a fixture now: AVX-512's cases are collected and skipped (the build holds none)
    ran = [ln for ln in out.stdout.splitlines() if ln.startswith("tests/") and (" PASSED" in ln or " SKIPPED" in ln)]
    assert all(("avx512" in ln) == (" SKIPPED" in ln) for ln in ran), tail


def test_codebook_kernel_in_the_avx2_build(probe):
    """The codebook kernel (``cpu-e8``) on an AVX2-only machine: its AVX2 path is the one that runs
    (the build holds no AVX-512, as checked above), and its tests — exact decoding, the reference's
    numbers, rotated layers, opcheck — pass through the x86-64-v3 build, none skipped for lack of
    the op."""
    assert probe["e8_isa"] == "avx2"
    out = _run([sys.executable, "-m", "pytest", "-v", "-x", "-p", "no:cacheprovider", "-rs", "-m", "not slow",
                "tests/kernels/test_cpu_codebook.py"], timeout=3600)
    tail = out.stdout[-4000:] + out.stderr[-2000:]
    assert out.returncode == 0, tail
    m = re.search(r"(\d+) passed", out.stdout)
    assert m and int(m.group(1)) >= 60 and "C++ ops unavailable" not in out.stdout, tail
    assert re.search(r"test_each_instruction_set\[avx2-1-[^\]]*\] PASSED", out.stdout), tail
    assert not re.search(r"\[avx512-[^\]]*\] PASSED", out.stdout), tail
