"""The CPU family's codebook kernel (``cpu-e8``, kernels/cpu/codebook.py and csrc/codebook.cpp): exact
decoding of every stage, the reference's numbers for 2/3/4-bit codes at groups 16/64/a row, coded
and fp16 scales, M = 1..64, bf16/fp32 activations, bias, rotated layers through the selector, each
instruction set that runs here, the pure-torch path, the ops under opcheck, and the AVX-512 path
compiled (this suite may run on an AVX2-only machine)."""
from __future__ import annotations

import platform
import shutil
import subprocess
from dataclasses import replace

import pytest
import torch

from tests.helpers import op_setting
from vllm_latq import native
from vllm_latq.format import codebook as cb, scale_codes
from vllm_latq.format.rotation import Rotation, rotate
from vllm_latq.kernels import ops, selector
from vllm_latq.kernels.cpu.codebook import CPUCodebookKernel, decode_table
from vllm_latq.kernels.reference import latq_linear_ref
from vllm_latq.kernels.weight import CodebookWeight, dequantize

CPU = torch.device("cpu")


def weight(bits=3, n=48, k=256, group=64, coded=False, seed=0) -> CodebookWeight:
    """Random codes (every code is a point of its codebook) and scales; ``coded``: on the coded grid."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k // cb.DIM, cb.CODEBOOKS[bits].index_bytes), generator=g, dtype=torch.uint8)
    s = torch.rand(n, -(-k // group), generator=g) * 0.02 + 0.002
    cs = scale_codes.code_scales(s) if coded else None
    scales = cs.decode().half() if coded else s.half()
    return CodebookWeight(codes, scales, bits, group, k, cs)


def native_or_skip():
    why = native.load()
    if why is not None:
        pytest.skip(f"C++ ops unavailable: {why}")


def isas() -> list[str]:
    """The instruction sets the op runs here (its best first), scalar included."""
    if native.load() is not None:
        return []
    best = torch.ops.latq_cpu.codebook_isa()
    return [i for i in ("avx512", "avx2", "") if i == best or (i != "avx512" and best)]


@pytest.fixture(params=["avx512", "avx2", "scalar"])
def isa(request):
    native_or_skip()
    name = "" if request.param == "scalar" else request.param
    if name not in isas():
        pytest.skip(f"{request.param} does not run here")
    with op_setting("codebook_isa", name):
        yield request.param


def close(y: torch.Tensor, x: torch.Tensor, w: CodebookWeight, bias=None):
    """y against the reference: fp32 summation order, one rounding in x's dtype."""
    ref = latq_linear_ref(x, w, bias)
    xr = x if w.rotation is None else rotate(x, w.rotation)
    bound = (xr.float().abs() @ dequantize(w).abs().T).max().item() * 1e-5
    ulp = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}[x.dtype]
    assert y.dtype == x.dtype and y.shape == ref.shape
    torch.testing.assert_close(y.float(), ref.float(), rtol=ulp, atol=bound + ulp * ref.float().abs().max().item())


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_decoding_is_the_formats_exactly(bits, isa):
    """Rows of the identity through the op: every weight read back as the format dequantizes it,
    bit for bit (small M, and large M's decoded tiles)."""
    w = weight(bits, n=40, k=128, group=16)
    st = CPUCodebookKernel.prepare(w)
    want = dequantize(w).T
    for m0 in range(0, 128, 8):
        assert torch.equal(CPUCodebookKernel.apply(st, torch.eye(128)[m0:m0 + 8]), want[m0:m0 + 8])
    with op_setting("codebook_large_m", 1):
        assert torch.equal(CPUCodebookKernel.apply(st, torch.eye(128)), want)


def test_table_is_the_formats():
    """Rows 0..255: E8P's patterns, each signed by its parity; 256..511: the ball, halved; then per sign
    byte h a mask (−0.0 on a flipped lane, the last by the parity of h's low seven bits) and a shift
    (+¼, −¼ where bit 7 is set)."""
    t = decode_table()
    assert t.shape == (1024, 8) and t.dtype == torch.float32
    assert torch.equal(t[:256].abs().double(), cb.e8p_patterns())
    assert torch.equal(t[256:512].double() * 2, cb.e8_ball256())
    assert torch.equal(t[:256, -1] < 0, torch.remainder(cb.e8p_patterns().sum(-1), 2) != 0)
    masks, shifts = t[512::2], t[513::2]
    assert masks.shape == (256, 8) and torch.equal(masks, torch.zeros_like(masks))
    assert torch.signbit(masks).sum() == 256 * 8 // 2
    for h in (0b1000011, 0b11000011):
        assert torch.signbit(masks[h]).tolist() == [True, True, False, False, False, False, True, True]
    assert torch.equal(shifts[:128], torch.full((128, 8), 0.25))
    assert torch.equal(shifts[128:], torch.full((128, 8), -0.25))


@pytest.mark.parametrize("n", [48, 128], ids=["rows", "tiles"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("coded", [False, True], ids=["fp16", "coded"])
@pytest.mark.parametrize("group", [16, 64, 0], ids=["g16", "g64", "row"])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_matches_the_reference(bits, group, coded, dtype, n):
    """Every path against the reference: 128 rows lay out as 64-row tiles where the tiles' path runs
    (M = 1 of bf16 x takes it), 48 as rows."""
    native_or_skip()
    w = weight(bits, n=n, k=192, group=group or 192, coded=coded, seed=bits)
    st = CPUCodebookKernel.prepare(w)
    assert st.tile_rows == (CPUCodebookKernel.tile_rows(128) if n == 128 else 1)
    g = torch.Generator().manual_seed(2)
    bias = torch.randn(n, generator=g).to(dtype)
    for M in (1, 3, 17, 64):
        x = torch.randn(M, 192, generator=g).to(dtype)
        close(CPUCodebookKernel.apply(st, x), x, w)
        close(CPUCodebookKernel.apply(st, x, bias), x, w, bias)


# the row path's loops: a group of 3 blocks (pairs straddle groups) and 25 blocks a row; a pair a group
# with a lone last block; a pair a group throughout; 4 blocks a group
@pytest.mark.parametrize("k,group", [(200, 24), (200, 16), (192, 16), (192, 32)])
@pytest.mark.parametrize("M", [1, 3, 8, 9, 17, 64])
def test_each_instruction_set(M, k, group, isa):
    w = weight(4 if group == 24 else 3, n=40, k=k, group=group)
    x = torch.randn(M, k, generator=torch.Generator().manual_seed(M))
    close(CPUCodebookKernel.apply(CPUCodebookKernel.prepare(w), x), x, w)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_tiles_read_every_weight_exactly(bits):
    """The 64-row tiles' path (AVX-512 VBMI + GFNI; bf16 x's dots in bf16 with AVX-512 BF16, M below the
    large-M rows: up to 4 rows with each block's words in registers, more with a chunk's words made once
    into L1 for 4 rows a pass): unit rows of x read every weight back as the format dequantizes it, bit
    for bit (point × scale, exact in fp32 and bf16-rounded once), and the same tiled state on every other
    instruction set and M gives the rows' results."""
    tiles_or_skip()
    for coded, group in ((True, 16), (False, 64), (True, 256)):
        w = weight(bits, n=192, k=256, group=group, coded=coded, seed=bits)
        st = CPUCodebookKernel.prepare(w)
        assert st.tile_rows == 64 and st.codes.shape == (3, 32, bits, 64)
        want = dequantize(w).T.bfloat16()
        for m in (0, 7, 8, 100, 255):
            assert torch.equal(CPUCodebookKernel.apply(st, torch.eye(256)[m:m + 1].bfloat16()), want[m:m + 1])
        # 2 and 4 rows of x in registers; 9 through L1, 4 + 4 + 1 a pass
        for rows in ([3, 200], [5, 6, 70, 250], [0, 9, 17, 64, 65, 130, 199, 254, 255]):
            assert torch.equal(CPUCodebookKernel.apply(st, torch.eye(256)[rows].bfloat16()), want[rows])
        rows = replace(st, codes=w.codes.contiguous(), tile_rows=1)
        x = torch.randn(5, 256).bfloat16()
        for isa in isas():
            with op_setting("codebook_isa", isa):
                torch.testing.assert_close(CPUCodebookKernel.apply(st, x), CPUCodebookKernel.apply(rows, x),
                                           rtol=2 ** -7, atol=1e-6)


def tiles_or_skip():
    native_or_skip()
    if CPUCodebookKernel.tile_rows(64) != 64:
        pytest.skip("the tiles' path does not run here (AVX-512 VBMI + GFNI)")


@pytest.fixture
def without_bf16_dots():
    """The tiles' path as on a CPU without AVX-512 BF16 (Ice Lake): any x in fp32."""
    tiles_or_skip()
    with op_setting("codebook_bf16_dots", False):
        yield


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("coded,group", [(True, 16), (False, 64), (True, 256)], ids=["coded-g16", "fp16-g64", "row"])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_tiles_fp32_dots(bits, coded, group, dtype, without_bf16_dots):
    """The tiles' fp32 dots (x without bf16 dots: q bytes spread into fp32 words less their offset, at 4 bits
    the two stages' bytes summed; up to 4 rows of x in registers, more through L1): unit rows read every
    weight back bit for bit, in x's dtype rounded once; random rows (and a bias) match the reference."""
    w = weight(bits, n=192, k=256, group=group, coded=coded, seed=bits)
    st = CPUCodebookKernel.prepare(w)
    assert st.tile_rows == 64
    want = dequantize(w).T.to(dtype)
    for rows in ([0], [7], [255], [8, 100, 3], [0, 9, 17, 64, 130, 255]):   # 1 and 3 rows in registers, 6 via L1
        assert torch.equal(CPUCodebookKernel.apply(st, torch.eye(256)[rows].to(dtype)), want[rows])
    g = torch.Generator().manual_seed(bits)
    bias = torch.randn(192, generator=g).to(dtype)
    for M in (1, 3, 4, 6, 9):
        x = torch.randn(M, 256, generator=g).to(dtype)
        close(CPUCodebookKernel.apply(st, x), x, w)
        close(CPUCodebookKernel.apply(st, x, bias), x, w, bias)


@pytest.mark.parametrize("dots", [True, False], ids=["bf16-dots", "fp32-dots"])
@pytest.mark.parametrize("k,group", [(200, 24), (136, 136)], ids=["25-blocks-g24", "17-blocks-one-group"])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_tiles_take_odd_blocks_and_groups(bits, k, group, dots):
    """The tiles' loops with an odd number of blocks a row and groups of 3 (or 17) blocks, both dots, 1 to 9
    rows of x in bf16, fp16 and fp32, against the reference."""
    tiles_or_skip()
    if dots and not torch.ops.latq_cpu.codebook_bf16_dots():
        pytest.skip("no AVX-512 BF16 dots here")
    w = weight(bits, n=128, k=k, group=group, coded=True, seed=k)
    st = CPUCodebookKernel.prepare(w)
    g = torch.Generator().manual_seed(k)
    with op_setting("codebook_bf16_dots", dots):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for M in (1, 3, 6, 9):
                x = torch.randn(M, k, generator=g).to(dtype)
                close(CPUCodebookKernel.apply(st, x), x, w)


def test_large_m_path_agrees_with_the_small_m_one():
    native_or_skip()
    w = weight(3, n=40, k=256)
    st = CPUCodebookKernel.prepare(w)
    x = torch.randn(2, 5, 256).bfloat16()   # leading dimensions kept
    small = CPUCodebookKernel.apply(st, x)
    with op_setting("codebook_large_m", 1):
        large = CPUCodebookKernel.apply(st, x)
    assert large.shape == (2, 5, 40)
    close(large.reshape(10, 40), x.reshape(10, 256), w)
    torch.testing.assert_close(large, small, rtol=2 ** -7, atol=1e-6)


def test_pure_torch_path_is_the_references():
    w = weight(2, group=16, coded=True)
    x = torch.randn(5, 256)
    bias = torch.randn(48)
    with native.disabled():
        y = CPUCodebookKernel.apply(CPUCodebookKernel.prepare(w), x, bias)
    assert torch.equal(y, latq_linear_ref(x, w, bias))


def test_selector_picks_it_for_a_rotated_codebook_layer():
    """A rotated CodebookWeight on CPU: ``cpu-e8+hadamard`` (``LATQ_KERNEL=cpu`` too: the family's
    member for the form), through its apply and the op a layer calls."""
    native_or_skip()
    k = 256
    w = replace(weight(3, k=k, group=64), rotation=Rotation(0).signs(k))
    for forced in (None, "cpu"):
        with pytest.MonkeyPatch.context() as mp:
            mp.delenv(selector.ENV_FORCE, raising=False) if forced is None else mp.setenv(selector.ENV_FORCE, forced)
            kern, reasons = selector.select_with_reasons(w, CPU, torch.bfloat16)
        assert kern.name == "cpu-e8+hadamard", reasons
    st = kern.prepare(w)
    assert kern.label(st) == "cpu-e8+hadamard"
    tensors, ints = kern.flatten(st)
    op = ops.op_for(kern)
    assert op is torch.ops.latq_cpu.codebook_linear.default
    bias = torch.randn(48).bfloat16()
    for M in (1, 3, 17, 64):
        x = torch.randn(M, k).bfloat16()
        close(kern.apply(st, x), x, w)
        close(op(x, tensors, ints, bias, 48), x, w, bias)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_rotated_layer_rotates_in_the_same_call(dtype, monkeypatch):
    """Eager apply of a rotated codebook layer is one C++ call (the op rotates x by its trailing signs,
    no separate transform), bit for bit what rotating first and then applying gives, small and large M."""
    native_or_skip()
    from vllm_latq.kernels import rotated
    k, kern = 256, rotated.rotated_kernel(CPUCodebookKernel)
    st = kern.prepare(replace(weight(3, n=64, k=k, group=16, coded=True), rotation=Rotation(0).signs(k)))
    xs = [torch.randn(M, k).to(dtype) for M in (1, 3, 300)]
    want = [CPUCodebookKernel.apply(st.inner, torch.ops.latq_cpu.hadamard(x, st.signs)) for x in xs]
    monkeypatch.setattr(rotated, "rotate_activations", lambda *a: pytest.fail("a separate rotation call"))
    for x, y in zip(xs, want):
        assert torch.equal(kern.apply(st, x), y)


def test_refusals_name_the_reason():
    w = weight()
    assert CPUCodebookKernel.can_implement(w, torch.device("cuda"), torch.bfloat16) == (
        False, "device cuda is not a CPU")
    ok, why = CPUCodebookKernel.can_implement(w, CPU, torch.int8)
    assert not ok and "activation dtype torch.int8 unsupported" in why
    from vllm_latq.testing.weights import random_weight
    ok, why = CPUCodebookKernel.can_implement(random_weight(16, 64, 4, 0.0, group=32), CPU, torch.float32)
    assert (ok, why) == (False, "serves CodebookWeight layers, not LatqWeight")


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_served_bytes(bits):
    """Codes + scales as stored per layer (``codebook_bytes``: fp16, or coded at 6 bits a scale), the
    table once for all layers: E8-3b with coded scales per 16 columns streams its stored 3.375 bits."""
    for n, group, coded in ((48, 64, True), (40, 16, True), (48, 16, False), (48, 320, False)):
        w = weight(bits, n=n, k=320, group=group, coded=coded)
        st = CPUCodebookKernel.prepare(w)
        served = CPUCodebookKernel.served_bytes(st)
        assert served.pop("table") == 1024 * 8 * 4
        assert served == CPUCodebookKernel.codebook_bytes(n, 320, bits, group, 4 if coded else None)
        ng = -(-320 // group)
        assert served == {"codes": n * 320 * bits // 8, "scales": (-(-n // 16) * 12 if coded else 2 * n) * ng}
    st = CPUCodebookKernel.prepare(weight(3, n=48, k=320, group=16, coded=True))
    parts = CPUCodebookKernel.served_bytes(st)
    assert 8 * (parts["codes"] + parts["scales"]) / (48 * 320) == 3.375
    other = CPUCodebookKernel.prepare(weight(bits, seed=1))
    assert CPUCodebookKernel.shared_tensors(other)["table"] is CPUCodebookKernel.shared_tensors(st)["table"]
    assert selector.family_member("cpu", CodebookWeight) is CPUCodebookKernel


def test_coded_scales_are_read_as_stored():
    """A coded layer's state holds the checkpoint's words (not decoded fp16 scales), and reading them
    back gives the format's scales bit for bit, a last band of fewer than 16 rows included."""
    from vllm_latq.kernels.cpu.codebook import state_scales
    w = weight(3, n=40, k=256, group=16, coded=True)
    st = CPUCodebookKernel.prepare(w)
    assert st.scales.dtype == torch.int32 and st.scales.shape == (3, 16, 3)
    assert torch.equal(state_scales(st), w.coded.decode().half())


@pytest.mark.parametrize("coded", [True, False])
def test_placed_state_computes_the_same(coded):
    """place moves the codes and scales into the weight arenas (as a served model loads them) and
    keeps the table every layer shares; apply's output is bit-identical (tiles and rows layouts)."""
    for n in (128, 40):
        st = CPUCodebookKernel.prepare(weight(3, n=n, k=256, group=16, coded=coded))
        x = torch.randn(3, 256).bfloat16()
        want = [CPUCodebookKernel.apply(st, x[:m]) for m in (1, 3)]
        codes, scales, table = st.codes, st.scales, st.table
        CPUCodebookKernel.place(st)
        assert st.table is table
        for new, old in ((st.codes, codes), (st.scales, scales)):
            assert torch.equal(new, old) and new.untyped_storage().data_ptr() != old.untyped_storage().data_ptr()
        assert st.codes.untyped_storage().data_ptr() == st.scales.untyped_storage().data_ptr()   # one arena
        assert all(torch.equal(CPUCodebookKernel.apply(st, x[:m]), y) for m, y in zip((1, 3), want))


def test_opcheck_native_op():
    """``latq_cpu::codebook_linear``: schema, fake and dynamic shapes (small and large M, rotated)."""
    native_or_skip()
    w = weight(4, n=32, k=256, group=64)
    tensors, ints = CPUCodebookKernel.flatten(CPUCodebookKernel.prepare(w))
    op = CPUCodebookKernel.native_op()
    x, bias = torch.randn(3, 256).bfloat16(), torch.randn(32).bfloat16()
    torch.library.opcheck(op, (x, tensors, ints, bias, 32))
    torch.library.opcheck(op, (torch.randn(40, 256), tensors, ints, None, 32))
    torch.library.opcheck(op, (x, [*tensors, Rotation(0).signs(256)], ints, None, 32))


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or shutil.which("g++") is None
                    or shutil.which("objdump") is None, reason="an x86 g++ and objdump")
@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "icelake"])
def test_avx512_path_compiles(tmp_path, bf16):
    """The AVX-512 paths, compiled for an AVX-512 VBMI + GFNI target with and without BF16 (an Ice Lake's)
    on any x86 machine: they build, and the tiles' path holds its zmm byte lookups, with its bf16 dots
    only where the target has them (an AVX2-only machine cannot run them; where one runs them, the tests
    above do, the fp32 dots as without BF16 too)."""
    from torch.utils.cpp_extension import include_paths
    src = next(s for s in native.SOURCES if s.name == "codebook.cpp")
    obj = tmp_path / "codebook.o"
    cmd = ["g++", "-std=c++17", "-c", "-O3", "-march=x86-64-v4", "-mavx512vbmi", "-mgfni", "-fPIC", "-w",
           *(["-mavx512bf16"] if bf16 else []), *[f"-I{p}" for p in include_paths()], str(src), "-o", str(obj)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    dis = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(obj)], capture_output=True, text=True, check=True)
    for insn in ("vpermi2b", "vgf2p8affineqb", "vpermb"):   # the tiles' decode (nothing else here uses them)
        assert insn in dis.stdout, insn
    for insn in ("vpermw", "vdpbf16ps"):   # the bf16 dots'
        assert (insn in dis.stdout) == bf16, insn
