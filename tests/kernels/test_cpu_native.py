"""The CPU kernel's C++ op (``vllm_latq/native.py``, ``csrc/latq_cpu.cpp``): the op a vLLM
layer calls, its two outlier paths, and the fallback when it cannot be built. (Every exactness
test of ``test_cpu_kernel.py`` also runs through it.)"""
from __future__ import annotations

import pytest
import torch

from tests.kernels.test_cpu_kernel import check, expected, prepared
from vllm_latq import native
from vllm_latq.kernels.cpu import kernel as cpu, dequant as cpu_dequant, layouts as cpu_layouts
from vllm_latq.kernels.cpu.kernel import CPUKernel
from vllm_latq.testing.weights import random_weight

pytestmark = [pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta"),
              pytest.mark.usefixtures("native_ops")]


def test_native_op_is_the_layer_op_for_every_m():
    """``latq_cpu::linear`` (what a vLLM layer calls with the C++ op built) against the Python
    custom op, over the flattened state: the same result at small M (C++) and at large M (it
    calls back into ``latq::cpu_linear``); also under torch.compile(fullgraph, dynamic)."""
    from vllm_latq.kernels import ops
    with native.disabled():
        assert CPUKernel.native_op() is None
    w, state = prepared((640, 2048, 4, 0.01, 128))
    op = ops.op_for(CPUKernel)
    assert op is torch.ops.latq_cpu.linear.default
    tensors, ints = CPUKernel.flatten(state)
    g = torch.Generator().manual_seed(21)
    bias = torch.randn(640, generator=g).to(torch.bfloat16)
    for shape in ((1, 2048), (8, 2048), (2, 3, 2048), (cpu.large_m(), 2048)):
        x = torch.randn(*shape, generator=g).to(torch.bfloat16)
        for b in (None, bias):
            want = CPUKernel.apply(state, x, b)
            assert torch.equal(op(x, tensors, ints, b, 640), want), (shape, b is None)
    f = torch.compile(lambda x: op(x, tensors, ints, None, 640), fullgraph=True, dynamic=True)
    for m in (1, 5):
        x = torch.randn(m, 2048, generator=g).to(torch.bfloat16)
        assert torch.equal(f(x), CPUKernel.apply(state, x))


def test_plain_op_is_the_native_op_without_outliers_and_bias():
    """``latq_cpu::plain_linear`` (a vLLM layer's call for a state without outliers, without
    bias) gives ``latq_cpu::linear``'s bits at small M, on 3-D x, at large M (the Python op
    behind it), in bf16 and fp32, also under torch.compile(fullgraph, dynamic); a state with
    outliers has none (its layer keeps the list op)."""
    from vllm_latq.kernels import ops
    ops.op_for(CPUKernel)   # registers latq::cpu_linear, the large-M op behind both, as a layer's load does
    w0 = prepared((192, 576, 4, 0.0, 64))[0]   # cached outside: a state prepared without the op has torch's layout
    with native.disabled():
        assert CPUKernel.plain_op(CPUKernel.prepare(w0)) is None
    assert CPUKernel.plain_op(prepared((640, 2048, 4, 0.01, 128))[1]) is None
    g = torch.Generator().manual_seed(22)
    for key in ((192, 576, 4, 0.0, 64), (576, 576, 8, 0.0, 64)):   # one plane; two (an 8-bit head)
        w, state = prepared(key)
        N, K = key[0], key[1]
        plain = CPUKernel.plain_op(state)
        assert plain is torch.ops.latq_cpu.plain_linear.default
        tensors, ints = CPUKernel.flatten(state)
        assert all(t is None for t in tensors[2:])
        for shape in ((1, K), (8, K), (2, 3, K), (cpu.large_m(), K)):
            for dtype in (torch.bfloat16, torch.float32):
                x = torch.randn(*shape, generator=g).to(dtype)
                want = CPUKernel.native_op()(x, tensors, ints, None, N)
                got = plain(x, tensors[0], tensors[1], ints, N)
                assert got.shape == (*shape[:-1], N) and torch.equal(got, want), (key, shape, dtype)
        f = torch.compile(lambda x: plain(x, tensors[0], tensors[1], ints, N), fullgraph=True, dynamic=True)
        for m in (1, 5):
            x = torch.randn(m, K, generator=g).to(torch.bfloat16)
            assert torch.equal(f(x), CPUKernel.apply(state, x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_op_in_the_engines_dtype(dtype, gemv_isa):
    """An engine in fp32 activations (latq-serve's advice where bf16 is emulated) calls
    ``latq_cpu::linear`` with fp32 x and bias: an fp32 result, exact to the reference's bounds
    (``check``) on each GEMV instruction set, with and without outlier tiles, at M = 1, 3, 8, 16
    and the large-M path."""
    from vllm_latq.kernels import ops
    op = ops.op_for(CPUKernel)
    g = torch.Generator().manual_seed(24)
    for key in ((640, 2048, 4, 0.01, 128), (192, 576, 4, 0.0, 64)):
        w, state = prepared(key)
        N, K = key[0], key[1]
        tensors, ints = CPUKernel.flatten(state)
        for M in (1, 3, 8, 16, cpu.large_m()):
            x, b = torch.randn(M, K, generator=g).to(dtype), torch.randn(N, generator=g).to(dtype)
            y = op(x, tensors, ints, b, N)
            assert y.dtype == dtype and torch.equal(y, CPUKernel.apply(state, x, b))
            check(w, state, x, b)


def test_native_unavailable_falls_back(monkeypatch):
    monkeypatch.setattr(native, "_STATUS", native._UNSET)
    monkeypatch.setenv(native.ENV, "0")
    assert native.load() == "LATQ_CPU_NATIVE=0" and not native.available()
    assert CPUKernel.native_op() is None
    w, state = prepared((640, 2048, 4, 0.01, 128))
    check(w, state, torch.randn(3, 2048).to(torch.bfloat16))


_CSR_STATES = {}


def csr_prepared(key):
    """``prepared`` with the outliers kept as a CSR (what the op gets without the GEMV, or for
    in_features ≥ 2¹⁵) instead of tiles."""
    if key not in _CSR_STATES:
        w = prepared(key)[0]
        _CSR_STATES[key] = (w, CPUKernel.prepare(w, tiles=False))
    return _CSR_STATES[key]


@pytest.mark.parametrize("gemv", [True, False])
@pytest.mark.parametrize("loop_max", [0, 1 << 40])
def test_native_csr_outliers_by_loop_and_by_mkl(loop_max, gemv):
    """Outliers as a CSR: the C++ op sums them with its own loop or MKL (M=1 by outlier count,
    M > 16 always MKL), after the GEMV or torch's op: exact to the emulation, for M=1 and every
    row-block width of the loop (4, 8, 16), and MKL at M=21."""
    w, state = csr_prepared((640, 2048, 4, 0.05, 128))
    assert state.crow is not None and state.tile_col is None
    g = torch.Generator().manual_seed(22)
    saved = torch.ops.latq_cpu.gemv_max_m()
    torch.ops.latq_cpu.set_loop_max(loop_max)
    torch.ops.latq_cpu.set_gemv_max_m(saved if gemv else 0)
    try:
        for M in (1, 3, 8, 16, 21):
            check(w, state, torch.randn(M, 2048, generator=g).to(torch.bfloat16))
            check(w, state, torch.randn(M, 2048, generator=g), torch.randn(640, generator=g))
    finally:
        torch.ops.latq_cpu.set_loop_max(native.LOOP_MAX)
        torch.ops.latq_cpu.set_gemv_max_m(saved)


def test_prefetch_switch_changes_no_output():
    """``set_prefetch_l2`` (the bench's A/B of where the GEMV prefetches its weights) leaves every
    output bit-identical: M = 1, 2 (prefetched into L2) and 8 (into L1), one and two planes."""
    g = torch.Generator().manual_seed(5)
    states = [CPUKernel.prepare(random_weight(320, 640, bits, 0.0, group=64, seed=bits)) for bits in (4, 8)]
    try:
        for st in states:
            for M in (1, 2, 8):
                x = torch.randn(M, 640, generator=g).to(torch.bfloat16)
                torch.ops.latq_cpu.set_prefetch_l2(False)
                l1 = CPUKernel.apply(st, x)
                torch.ops.latq_cpu.set_prefetch_l2(True)
                assert torch.equal(CPUKernel.apply(st, x), l1), (st.planes, M)
    finally:
        torch.ops.latq_cpu.set_prefetch_l2(True)


def test_tiles_hold_the_csr():
    """``tiles_from_csr``: every outlier once, in its row's lane, padding marked; each block's
    rows are a permutation inside its 4 tiles, longest row first; ``cpu_dequant.tile_entries_of`` of any
    64-aligned row range gives back exactly that range's CSR entries."""
    gen = torch.Generator().manual_seed(5)
    N, K = 208, 300                                    # 3 full blocks + a 16-row tail
    m = torch.rand(N, K, generator=gen) < torch.rand(N, 1, generator=gen) * 0.2
    m[7] = False                                       # an empty row
    crow = torch.zeros(N + 1, dtype=torch.int32)
    crow[1:] = torch.cumsum(m.sum(1), 0)
    rr, cc = m.nonzero(as_tuple=True)
    col, val = cc.int(), torch.randn(rr.numel(), generator=gen)
    off, rows, tcol, tval = cpu_layouts.tiles_from_csr(crow, col, val)
    T = rows.shape[0]
    assert T == 13 and off.shape == (T + 1,) and tcol.shape == tval.shape == (int(off[-1]), 16)
    assert ((tcol < 0) == (tval == 0)).all() and int((tcol >= 0).sum()) == col.numel()
    for b in range(4):
        r = rows[4 * b: 4 * b + 4].flatten()
        real = r[r < 64]
        assert sorted(real.tolist()) == list(range(min(64, N - 64 * b)))
        assert (r[r >= 64] - 64 == torch.nonzero(r >= 64).flatten() % 16).all()
        cnt = m[64 * b + real].sum(1)
        assert (cnt[:-1] >= cnt[1:]).all()             # longest first
    st = cpu.CPUState(None, None, None, None, None, off, rows, tcol, tval, None, N, K, 32, 1, 0, 0)
    for r0, r1 in ((0, N), (64, 192), (192, N), (0, 64)):
        r, c, v = cpu_dequant.tile_entries_of(st, r0, r1)
        got = sorted(zip((r + r0).tolist(), c.tolist(), v.tolist()))
        sel = (rr >= r0) & (rr < r1)
        assert got == sorted(zip(rr[sel].tolist(), cc[sel].tolist(), val[sel].tolist()))


# --------------------------------------------------------------------------- the M = 1 GEMV

@pytest.fixture
def _gemv_built(native_ops):
    if torch.ops.latq_cpu.gemv_max_m() <= 0:
        pytest.skip("the C++ GEMV is not built here (no AVX-512 VBMI/BF16) or is off")


gemv_only = pytest.mark.usefixtures("_gemv_built")


def _op_state(N, K, g, seed, zeros=False):
    """→ (the GEMV's packed weights, torch's op's, (s, z) pairs, the fp64 weight): the two packings
    differ where torch packs for its AVX2 kernel."""
    pack, _ = cpu_layouts.int4_ops()
    gen = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 16, (N, K), generator=gen, dtype=torch.int32)
    s = (torch.rand(K // g, N, generator=gen) * 0.05 + 0.001).to(torch.bfloat16)
    z = (torch.randn(K // g, N, generator=gen) * 0.02 if zeros else torch.zeros(K // g, N)).to(torch.bfloat16)
    W = (u.double() - 8) * s.double().repeat_interleave(g, 0).T + z.double().repeat_interleave(g, 0).T
    return cpu_layouts.pack_gemv(u), pack(u, 1), torch.stack([s, z], -1).contiguous(), W


@gemv_only
@pytest.mark.parametrize("N,K,g", [(960, 576, 64), (576, 576, 64), (192, 576, 64), (3072, 576, 64),
                                   (576, 1536, 128), (80, 256, 32), (112, 512, 256), (208, 384, 64),
                                   (48, 64, 32), (16, 128, 128), (1024, 4096, 128), (64, 2048, 256)])
@pytest.mark.parametrize("zeros", [False, True])
def test_gemv_matches_the_op(N, K, g, zeros, gemv_isa):
    """``latq_cpu::gemv`` on the op's own state: the op's math up to fp32 summation order. Both
    are rounded to bf16, so: each within bf16 rounding + 1e-5·Σ|x||w| of the fp64 sum, and the
    two within one bf16 ulp of each other (most equal). N % 64 ≠ 0 covers the pair-packed tail;
    M covers the one-row kernel, the M-row kernel with (M ≤ 4) and without interleaved k-pairs,
    and M > 8 (two passes over a block). Without zeros, the GEMV on the scales alone equals it."""
    _, mm = cpu_layouts.int4_ops()
    p, po, sz, W = _op_state(N, K, g, N + K + g, zeros)
    gen = torch.Generator().manual_seed(K)
    for M in (1, 2, 3, 5, 8, 13, 16):
        x = (torch.randn(M, K, generator=gen) * torch.rand(M, K, generator=gen) * 4).to(torch.bfloat16)
        y, yo = torch.ops.latq_cpu.gemv(x, p, sz, g).double(), mm(x, po, g, sz).double()
        ref = x.double() @ W.T
        S = x.double().abs() @ W.abs().T
        assert ((y - ref).abs() <= 2.0 ** -8 * ref.abs() + 1e-5 * S).all()
        assert ((y - yo).abs() <= 2.0 ** -7 * torch.maximum(y.abs(), yo.abs()) + 1e-5 * S).all()
        assert (y == yo).double().mean() > 0.9
        if not zeros:   # the scales alone (the kernel's layout here): the same sums, the zero term 0
            assert torch.equal(torch.ops.latq_cpu.gemv(x, p, sz[..., 0].contiguous(), g).double(), y)


@gemv_only
@pytest.mark.parametrize("key", [(960, 576, 4, 0.01, 128), (576, 1536, 4, 0.0, 128), (80, 256, 4, 0.02, 32),
                                 (112, 512, 3, 0.01, 256), (208, 384, 4, 0.01, 64), (128, 256, 6, 0.0, 128),
                                 (3072, 576, 4, 0.05, 64), (80, 4096, 4, 0.1, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tiles", [True, False])
def test_gemv_in_small_linear(key, dtype, tiles, gemv_isa):
    """M = 1, 3, 8, 16 through ``small_linear`` with the GEMV on: the kernel's tight bounds
    (``test_cpu_kernel.check``) for bf16/fp16/fp32 activations, with and without outliers and
    bias, incl. two int4 planes (6-bit), a pair-packed tail and rows of > 256 outliers (tiles of
    that many slots), the outliers summed in the GEMV's threads from tiles or after it from a CSR; and within one bf16 ulp of the inliers (+
    fp32 summation) of the same call with torch's op (``set_gemv_max_m(0)``; tiles then summed
    in a pass of their own; where torch's op cannot read the GEMV's layout, the pure-torch path's
    call of it on the repacked weights)."""
    w, state = prepared(key) if tiles else csr_prepared(key)
    assert (state.tile_col is not None) == (tiles and key[3] > 0)
    N, K = key[0], key[1]
    g = torch.Generator().manual_seed(23)
    saved = torch.ops.latq_cpu.gemv_max_m()
    assert saved >= 16
    for M, b in ((1, None), (1, torch.randn(N, generator=g)), (3, None), (8, torch.randn(N, generator=g)),
                 (16, torch.randn(N, generator=g))):
        x = torch.randn(M, K, generator=g).to(dtype)
        bias = None if b is None else b.to(dtype)
        try:
            check(w, state, x, bias)
            on = CPUKernel.apply(state, x, bias).double()
            torch.ops.latq_cpu.set_gemv_max_m(0)
            with native.disabled(not torch.ops.latq_cpu.op_reads_gemv_layout()):
                off = CPUKernel.apply(state, x, bias).double()
        finally:
            torch.ops.latq_cpu.set_gemv_max_m(saved)
        S = x.to(torch.bfloat16).double().abs() @ expected(w, state).Wi_t.abs()
        # both round the inliers to bf16 before the bias: one ulp of the inliers, not of the sum
        yi = [t - (0 if bias is None else bias.double()) for t in (on, off)]
        tol = 2.0 ** -7 * (on.abs() + S * 2.0 ** -8) + 2.0 ** -7 * torch.maximum(*[t.abs() for t in yi]) + 1e-5 * S
        assert ((on - off).abs() <= tol).all()


def test_gemv_env_switch():
    """``LATQ_CPU_GEMV=0`` or ``false`` (read once at load, by the C++ library) keeps torch's op for every M;
    ``1`` and empty (unset) keep the GEMV, as the package's flag rule (vllm_latq/env.py) reads them."""
    import subprocess
    import sys
    code = ("import torch\nfrom vllm_latq import native\nassert native.load() is None\n"
            "print(torch.ops.latq_cpu.gemv_max_m())")
    for env, want in (("0", "0"), ("False", "0"), ("1", None), ("", None)):
        out = subprocess.run([sys.executable, "-c", code], env={**__import__("os").environ, "LATQ_CPU_GEMV": env},
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        if want is not None:
            assert out.stdout.split()[-1] == want
        else:
            assert int(out.stdout.split()[-1]) in (0, 1 << 30)


def test_gemv_dispatch_takes_avx2_without_avx512():
    """With AVX-512 masked off (``LATQ_CPU_ISA=avx2``, read at load) the GEMV runs on AVX2 where
    the CPU has it, and the kernel still serves the GEMV's layout (scales alone, not torch's op's
    pairs); an unknown instruction set is refused by name."""
    import os
    import subprocess
    import sys
    if not torch.ops.latq_cpu.has_gemv():
        pytest.skip("no GEMV on this CPU")
    code = ("import torch\nfrom vllm_latq import native\nassert native.load() is None\n"
            "from vllm_latq.kernels.cpu import kernel\n"
            "print(torch.ops.latq_cpu.gemv_isa(), kernel.gemv_isa(), torch.ops.latq_cpu.gemv_max_m() > 0)")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "LATQ_CPU_ISA": "avx2"},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["avx2", "avx2", "True"]
    with pytest.raises(RuntimeError, match="unknown instruction set 'sse9'"):
        torch.ops.latq_cpu.set_gemv_isa("sse9")


@gemv_only
def test_gemv_state_is_one_layout_on_every_isa(gemv_isa, monkeypatch):
    """The GEMV's state does not depend on the instruction set or on torch's packer (which
    packs 32-row blocks for its AVX2 kernel): ``prepare`` packs ``pack_gemv``'s layout itself —
    torch's own bytes where its op reads that layout — so AVX2 and AVX-512 serve the same bits,
    4.25 a weight for a 4-bit g64 layer, coded scales (``--scale-bits 4``) 12 bytes per 16.
    (tests/kernels/test_cpu_avx2_build.py compares the bytes with an AVX2-only build's, slow.)"""
    from vllm_latq import format as fmt
    N, K = 192, 576
    w = random_weight(N, K, 4, 0.0, group=64, seed=41)
    u = (fmt.unpack(w.qweight, 4, K) + 8).int()
    if torch.ops.latq_cpu.op_reads_gemv_layout():
        assert torch.equal(cpu_layouts.pack_gemv(u), cpu_layouts.int4_ops()[0](u, 1))

    def other_packer(*a):
        raise AssertionError("prepare used torch's packer where the GEMV runs")
    monkeypatch.setattr(cpu_layouts, "_PACK", other_packer)
    monkeypatch.setattr(cpu_layouts, "_MM", cpu_layouts.int4_ops()[1])
    st = CPUKernel.prepare(w)
    assert torch.equal(st.packed, cpu_layouts.pack_gemv(u))
    assert (st.layout_block, bool(st.layout_halves)) == cpu_layouts.GEMV_LAYOUT
    assert sum(CPUKernel.served_bytes(st).values()) * 8 == 4.25 * N * K
    coded = CPUKernel.prepare(random_weight(N, K, 4, 0.0, group=64, seed=41, scale_bits=4))
    assert coded.scales.dtype == torch.int32 and CPUKernel.served_bytes(coded)["scales"] == K // 64 * N // 16 * 12
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(42)).to(torch.bfloat16)
    check(w, st, x)
