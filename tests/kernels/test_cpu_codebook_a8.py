"""The opt-in int8-activation codebook kernel (``cpu-e8-a8``, kernels/cpu/codebook.py and
csrc/codebook_a8.cpp): the reference's numbers on x rounded as ``round_to_int8`` defines, at 2/3/4 bits,
groups of 16 / 64 / a row, coded and fp16 scales, M = 1..9, fp32/bf16 x, rotated layers; its layout holds
the same bytes; it is never chosen unless forced; its refusals; the op under opcheck; the AVX-512 source
compiled for a VNNI target."""
from __future__ import annotations

import platform
import shutil
import subprocess
from dataclasses import replace

import pytest
import torch

from vllm_latq import native
from vllm_latq.format.rotation import Rotation, rotate
from vllm_latq.kernels import selector
from vllm_latq.kernels.cpu.codebook import (A8_ROWS, CPUCodebookA8Kernel, CPUCodebookKernel, a8_block,
                                            round_to_int8, state_codes)
from vllm_latq.kernels.reference import latq_linear_ref
from vllm_latq.kernels.weight import dequantize

from tests.kernels.test_cpu_codebook import CPU, native_or_skip, weight


def a8_or_skip():
    native_or_skip()
    why = CPUCodebookA8Kernel.unavailable_here()
    if why:
        pytest.skip(f"cpu-e8-a8 {why}")


def close_on_rounded(y, x, w):
    """y against the reference on the rounded x: fp32 summation order, one rounding in x's dtype."""
    xq = round_to_int8(x if w.rotation is None else rotate(x, w.rotation), a8_block(w.group_size, w.in_features))
    ref = latq_linear_ref(xq, replace(w, rotation=None))   # Q itself: the rotated frame's weights
    bound = (xq.abs() @ dequantize(replace(w, rotation=None)).abs().T).max().item() * 1e-5
    ulp = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -7}[x.dtype]
    assert y.dtype == x.dtype and y.shape == ref.shape
    torch.testing.assert_close(y.float(), ref.float(), rtol=ulp, atol=bound + ulp * ref.float().abs().max().item())


def test_rounding_is_a_block_scale_to_127_steps():
    x = torch.tensor([[0.5, -1.0, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0], [3.0, 1.0, -2.9, 1.49]])
    q = round_to_int8(x)
    steps = q / (x.abs().amax(-1, keepdim=True) / 127).clamp_min(1e-30)
    assert torch.equal(steps, steps.round()) and steps.abs().max() == 127
    assert torch.equal(q[1], torch.zeros(4))
    assert q[0, 1] == -1.0 and (q - x).abs().max() <= 3.0 / 254 + 1e-7
    wide = torch.cat([x, 4 * x, x[:, :2]], -1)        # blocks of 4: each its own scale, the last of 2
    assert torch.equal(round_to_int8(wide, 4), torch.cat([q, 4 * q, round_to_int8(x[:, :2])], -1))
    assert [a8_block(g, 576) for g in (16, 32, 48, 64, 128, 576)] == [16, 32, 48, 64, 64, 64]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("coded,group", [(True, 16), (False, 64), (True, 32), (False, 0)], ids=["c16", "g64", "c32", "row"])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_matches_the_reference_on_rounded_x(bits, group, coded, dtype):
    a8_or_skip()
    k = 256
    w = weight(bits, n=96, k=k, group=group or k, coded=coded, seed=bits)
    state = CPUCodebookA8Kernel.prepare(w)
    assert state.tile_rows == A8_ROWS and torch.equal(state_codes(state), w.codes)
    for M in (1, 3, 4, 5, 9):
        x = torch.randn(M, k, generator=torch.Generator().manual_seed(M)).to(dtype)
        close_on_rounded(CPUCodebookA8Kernel.apply(state, x), x, w)


def test_bias_and_leading_dimensions():
    a8_or_skip()
    w = weight(3, n=64, k=128, group=16, coded=True)
    state, bias = CPUCodebookA8Kernel.prepare(w), torch.randn(64)
    x = torch.randn(2, 3, 128)
    y = CPUCodebookA8Kernel.apply(state, x, bias)
    assert y.shape == (2, 3, 64)
    torch.testing.assert_close(y, CPUCodebookA8Kernel.apply(state, x.reshape(6, 128)).reshape(2, 3, 64) + bias)


def test_it_differs_from_the_exact_kernel_only_by_the_rounding():
    """The rounding is what changes: on x already on its int8 grid the two kernels agree."""
    a8_or_skip()
    w = weight(3, n=64, k=256, group=16, coded=True)
    x = round_to_int8(torch.randn(2, 256), a8_block(16, 256))
    exact = CPUCodebookKernel.apply(CPUCodebookKernel.prepare(w), x)
    torch.testing.assert_close(CPUCodebookA8Kernel.apply(CPUCodebookA8Kernel.prepare(w), x), exact,
                               rtol=1e-5, atol=1e-5 * exact.abs().max().item())


def test_only_when_forced(monkeypatch):
    """Never chosen by default; ``LATQ_KERNEL=cpu-e8-a8`` picks it, wrapped for a rotated layer, and the
    rotation happens before the rounding."""
    a8_or_skip()
    w = weight(3, n=64, k=256, group=16, coded=True)
    w = replace(w, rotation=Rotation(0).signs(256))
    monkeypatch.delenv(selector.ENV_FORCE, raising=False)
    assert selector.select(w, CPU, torch.bfloat16).name == "cpu-e8+hadamard"
    monkeypatch.setenv(selector.ENV_FORCE, "cpu-e8-a8")
    k = selector.select(w, CPU, torch.bfloat16)
    assert k.name == "cpu-e8-a8+hadamard"
    x = torch.randn(3, 256)
    close_on_rounded(k.apply(k.prepare(w), x), x, w)


def test_refusals_name_the_reason():
    a8_or_skip()
    for n, k, group in [(48, 256, 16), (64, 200, 8), (64, 256, 24)]:
        ok, why = CPUCodebookA8Kernel.can_implement(weight(3, n=n, k=k, group=group), CPU, torch.bfloat16)
        assert not ok and "multiple of" in why, (n, k, group, why)
    state = CPUCodebookKernel.prepare(weight(3, n=64, k=256, group=16))   # the exact kernel's layout
    tensors, ints = CPUCodebookKernel.flatten(state)
    with pytest.raises(RuntimeError, match="tile rows"):
        CPUCodebookA8Kernel.native_op()(torch.randn(1, 256), tensors, ints, None, 64)


def test_opcheck_native_op():
    a8_or_skip()
    w = weight(4, n=64, k=256, group=64)
    tensors, ints = CPUCodebookA8Kernel.flatten(CPUCodebookA8Kernel.prepare(w))
    op = CPUCodebookA8Kernel.native_op()
    torch.library.opcheck(op, (torch.randn(3, 256).bfloat16(), tensors, ints, torch.randn(64).bfloat16(), 64))
    torch.library.opcheck(op, (torch.randn(5, 256), [*tensors, Rotation(0).signs(256)], ints, None, 64))


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or shutil.which("g++") is None
                    or shutil.which("objdump") is None, reason="an x86 g++ and objdump")
def test_avx512_vnni_path_compiles(tmp_path):
    """The int8 path compiled for an AVX-512 VBMI + VNNI + GFNI target on any x86 machine: it builds and
    holds its byte moves and integer dots (an AVX2-only machine cannot run them)."""
    from torch.utils.cpp_extension import include_paths
    src = next(s for s in native.SOURCES if s.name == "codebook_a8.cpp")
    obj = tmp_path / "codebook_a8.o"
    cmd = ["g++", "-std=c++17", "-c", "-O3", "-march=x86-64-v4", "-mavx512vbmi", "-mavx512vnni", "-mgfni", "-fPIC",
           "-w", *[f"-I{p}" for p in include_paths()], str(src), "-o", str(obj)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    dis = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(obj)], capture_output=True, text=True, check=True)
    for insn in ("vpmultishiftqb", "vpdpbusd", "vgf2p8affineqb"):
        assert insn in dis.stdout, insn
    assert "vpermi2b" in dis.stdout or "vpermt2b" in dis.stdout


def test_forcing_it_where_it_cannot_run_is_refused_before_any_layer(monkeypatch):
    """On a CPU or build without VNNI (or without the C++ ops) ``LATQ_KERNEL=cpu-e8-a8`` fails at start-up,
    naming what is missing, rather than at the first layer."""
    from vllm_latq import env
    monkeypatch.setattr(CPUCodebookA8Kernel, "unavailable_here",
                        classmethod(lambda cls: "needs AVX-512 VBMI, VNNI and GFNI (in the build and on this CPU)"))
    monkeypatch.setenv(selector.ENV_FORCE, "cpu-e8-a8")
    with pytest.raises(env.EnvError, match="VNNI"):
        selector.check_environment()
    ok, why = CPUCodebookA8Kernel.can_implement(weight(3, n=64, k=256, group=16), CPU, torch.bfloat16)
    assert not ok and "VNNI" in why
