"""The CPU fast path (``kernels/cpu/kernel.py``) against the torch reference.

Two comparisons per case:

* **contract** — vs :func:`latq_linear_ref` (fp32 math on the fp16-scaled weights), with a
  worst-case bound. The kernel's deviations, with u = 2⁻⁸ (bf16 unit roundoff) and
  S = |x|·|W|ᵀ (the sum of the absolute products): activations cast to bf16 (≤ u per product;
  0 for bf16 input), scales carried over fp16 → bf16 (≤ u per product), on the large-M path
  the dequantized weight z·s rounded to bf16 once (≤ u per product), fp32 accumulation
  (≤ K·2⁻²⁴ per product), the op's bf16 output (≤ u·S) and the final rounding to the output
  dtype (≤ u_out·|y|). Hence |y − ref| ≤ (3 + [large M])·u·S + u_out·|ref| (+ K·2⁻²⁴·S).
  This bound is loose for catching indexing bugs (a single wrong weight moves y by ~S/K), so:
* **emulated** — vs the same math done exactly (fp64) on what the kernel is specified to use:
  bf16(x), weights z·bf16(s) (op path: the op dequantizes in fp32, exact), fp32 outliers on
  the unrounded activations; on the large-M path one bf16 weight bf16(z·s) / bf16(o). What remains is the op's bf16 output rounding (≤ u·|y_inliers|),
  the final rounding (≤ u_out·(|y| + u·|y_inliers|)) and fp32 accumulation (≤ K·2⁻²⁴·S):
  tight enough that one wrong weight fails (checked by ``test_emulation_catches_one_wrong_weight``).
"""
from __future__ import annotations

import gc
import warnings

import pytest
import torch

from tests.helpers import gemv_isa_set
from vllm_latq import format as fmt
from vllm_latq import native
from vllm_latq.kernels.cpu import kernel as cpu, dequant as cpu_dequant, layouts as cpu_layouts
from vllm_latq.kernels.cpu.kernel import CPUKernel
from vllm_latq.kernels.served_bytes import GridStats
from vllm_latq.kernels.weight import LatqWeight, dequantize
from vllm_latq.kernels.reference import latq_linear_ref
from vllm_latq.testing.weights import random_weight
from vllm_latq.kernels.transcode import transcode

warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
pytestmark = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")

U_BF16 = 2.0 ** -8
U_OUT = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}


@pytest.fixture(autouse=True, params=["native", "native-avx2", "torch"])
def small_m_path(request):
    """Every test through each small-M path: the C++ op (``vllm_latq.native``) as dispatched here
    (its best GEMV, or torch's op without one), the C++ op with its GEMV forced to AVX2 where
    the best is another instruction set (AVX-512: so both GEMVs pass every exactness test), and
    the pure-torch path it replaces (the fallback without a compiler); all meet the same bounds.
    Returns "native" or "torch"."""
    if request.param.startswith("native") and native.load() is not None:
        pytest.skip(f"C++ op unavailable: {native.load()}")
    if request.param == "native-avx2":
        if torch.ops.latq_cpu.gemv_isa() in ("avx2", "") or not cpu._gemv_here():
            pytest.skip("the GEMV's best instruction set here is AVX2 or none: the 'native' case runs it")
        with gemv_isa_set("avx2"):
            assert cpu.gemv_isa() == "avx2"
            yield "native"
        return
    with native.disabled(request.param == "torch"):
        yield request.param


def make_weight(out, cin, bits, rate, group=128, seed=0, heavy_rows=(), fp16_values=False):
    """Random b-bit inliers (0 at outliers) + CSR outliers at ``rate`` (+ rows mostly outliers),
    fp32 values (``fp16_values``: fp16-exact, as SSQR stores them)."""
    return random_weight(out, cin, bits, rate, group=group, seed=seed, rows=heavy_rows, fp16_values=fp16_values)


class Expected:
    """Per (weight, prepared state), once: the contract weight (``dequantize``, as in
    ``latq_linear_ref``) and the emulated operands. Weights of a > 4-bit layer that the
    kernel moved off the 4-bit grid into its CSR (``planes == 1``) are emulated as such:
    fp32 outliers z·s with the fp16 scale."""

    def __init__(self, w: LatqWeight, state):
        W = dequantize(w)
        self.Wf, self.Wabs_t = W, W.double().abs().T.contiguous()
        z = fmt.unpack(w.qweight, w.bits, w.in_features).double()
        s16 = w.scales.double().repeat_interleave(w.group_size, 1)[:, : w.in_features]
        s = w.scales.float().to(torch.bfloat16).double().repeat_interleave(w.group_size, 1)[:, : w.in_features]
        O = torch.zeros(w.out_features, w.in_features, dtype=torch.float64)
        rows = fmt.csr_rows(w.crow, w.nnz)
        O[rows, w.col.long()] = w.val.double()
        if w.bits > 4 and state.planes == 1:
            off = (z < -8) | (z > 7)
            O[off] = (z * s16)[off]
            z[off] = 0
        Wi = z * s                                        # op path: exact in the op's fp32
        self.Wi_t = Wi.T.contiguous()
        # large M: one bf16 weight, bf16(z·s) with the outliers bf16(o) in (their z is 0)
        self.Wi_large_t = (Wi + O).to(torch.bfloat16).double().T.contiguous()
        self.O_t = O.T.contiguous()


_EXPECTED: dict[int, Expected] = {}


def expected(w, state):
    key = (id(w), id(state))
    if key not in _EXPECTED:
        _EXPECTED[key] = (w, state, Expected(w, state))   # keep both alive: ids stay unique
    return _EXPECTED[key][2]


def check(w, state, x, bias=None):
    """Both comparisons; returns the largest error / tolerance of the tight one."""
    e = expected(w, state)
    y = CPUKernel.apply(state, x, bias)
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], w.out_features)
    xd = x.reshape(-1, w.in_features).double()
    large = xd.shape[0] >= cpu.large_m() and state.layout_block != 0
    yk = y.reshape(-1, w.out_features).double()
    S = xd.abs() @ e.Wabs_t
    b = 0 if bias is None else bias.double()
    uo = U_OUT[x.dtype]
    slack = w.in_features * 2.0 ** -24 * S + 1e-30
    # contract: latq_linear_ref's math (x.float() @ dequantize(w)ᵀ + bias → x.dtype)
    ref = (x.reshape(xd.shape).float() @ e.Wf.T + (0 if bias is None else bias.float())).to(x.dtype).double()
    tol = (3 + large) * U_BF16 * S + 2 * uo * ref.abs() + slack
    err = (yk - ref).abs()
    assert (err <= tol).all(), f"contract: max err/tol {(err / tol).max():.3g}"
    # emulated: only the output roundings and fp32 accumulation remain
    yin = xd.to(torch.bfloat16).double() @ (e.Wi_large_t if large else e.Wi_t)
    ye = yin + b if large else yin + xd @ e.O_t + b
    tol_e = U_BF16 * yin.abs() + uo * (ye.abs() + U_BF16 * yin.abs()) + 2 * slack
    err_e = (yk - ye).abs()
    assert (err_e <= tol_e).all(), f"emulated: max err/tol {(err_e / tol_e).max():.3g}"
    return float((err_e / tol_e).max())


_STATES = {}


def prepared(key, **kw):
    full = (key, tuple(sorted(kw.items())))
    if full not in _STATES:
        w = make_weight(*key, **kw)
        _STATES[full] = (w, CPUKernel.prepare(w))
    return _STATES[full]


# --------------------------------------------------------------------------- the op itself

def test_op_convention():
    """``_weight_int4pack_mm_for_cpu`` dequantizes (u − 8)·scale + zero, accumulates in fp32."""
    pack, mm = cpu_layouts.int4_ops()
    g = torch.Generator().manual_seed(0)
    N, K, gs = 80, 256, 64                              # one full 64-row block + a 16-row tail
    u = torch.randint(0, 16, (N, K), generator=g, dtype=torch.int32)
    sc = (torch.rand(K // gs, N, generator=g) + 0.5).to(torch.bfloat16)
    ze = torch.randn(K // gs, N, generator=g).to(torch.bfloat16)
    x = torch.randn(3, K, generator=g).to(torch.bfloat16)
    y = mm(x, pack(u, 1), gs, torch.stack([sc, ze], -1))
    W = (u.double() - 8) * sc.double().repeat_interleave(gs, 0).T + ze.double().repeat_interleave(gs, 0).T
    ref = x.double() @ W.T
    assert y.dtype == torch.bfloat16
    assert ((y.double() - ref).abs() <= U_BF16 * ref.abs() + 1e-4 * (x.double().abs() @ W.abs().T)).all()


def test_packed_layout_inverse():
    layout = cpu_layouts.detect_layout()
    if layout is None:
        pytest.skip(f"unknown int4pack layout on {torch.backends.cpu.get_cpu_capability()}: large M uses the op")
    pack, _ = cpu_layouts.int4_ops()
    g = torch.Generator().manual_seed(2)
    for N in (16, 48, 64, 80, 208):
        u = torch.randint(0, 16, (N, 64), generator=g, dtype=torch.int32)
        p = pack(u, 1)
        assert torch.equal(cpu_layouts.unpack_int4pack(p, N, 64, layout).T.int() + 8, u)
        B = layout[0]
        for r0 in range(0, N, B):
            r1 = min(N, r0 + B)
            assert torch.equal(cpu_layouts.unpack_int4pack(p, N, 64, layout, r0, r1).T.int() + 8, u[r0:r1])



# --------------------------------------------------------------------------- coded group scales

# (N, K, group): group 64; ragged K (576 = 4.5 groups of 128: op group 64 repeats each code);
# a tail block of 16 rows (80 = 64 + 16); group 16, which no op group divides
CODED_SHAPES = [(192, 576, 64), (128, 576, 128), (80, 256, 32), (640, 2048, 16)]


@pytest.mark.parametrize("shape", CODED_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}g{s[2]}")
def test_coded_scales(shape, small_m_path, monkeypatch):
    """Coded group scales (``--scale-bits 4``) stay codes where the C++ GEMV runs — 12 bytes per 16
    scales, the checkpoint's 6 bits, as ``layout_bytes`` counts — and compute, bit for bit, what
    the same layer with decoded scales computes, at every path's M (the large-M dequant and
    the pure-torch path decode them); group 16, which no op group divides, runs only there."""
    N, K, g = shape
    w = random_weight(N, K, 4, 0.0, group=g, seed=21, scale_bits=4)
    plain = LatqWeight(w.qweight, w.scales, w.crow, w.col, w.val, w.bits, g, K)   # the same scales, decoded
    codes = small_m_path == "native" and cpu._gemv_here()
    ok, why = CPUKernel.can_implement(w, "cpu", torch.bfloat16)
    if g == 16 and not codes:
        assert not ok and "coded scales" in why
        return
    state = CPUKernel.prepare(w)
    assert (state.scales.dtype == torch.int32) == codes
    stats = GridStats.from_integers(fmt.unpack(w.qweight, 4, K), torch.ones(N))
    assert CPUKernel.served_bytes(state) == CPUKernel.layout_bytes(N, K, 4, g, stats, scale_bits=4)
    if codes:
        assert CPUKernel.served_bytes(state)["scales"] == K // state.group_size * N // 16 * 12
    ref_state = CPUKernel.prepare(plain) if g != 16 else None
    gen = torch.Generator().manual_seed(22)
    for M, large in ((1, 1 << 30), (3, 1 << 30), (8, 1 << 30), (64, 1 << 30), (64, 64)):
        monkeypatch.setattr(cpu, "LARGE_M", large)
        x = torch.randn(M, K, generator=gen).to(torch.bfloat16)
        check(w, state, x)
        if ref_state is not None:
            assert torch.equal(CPUKernel.apply(state, x), CPUKernel.apply(ref_state, x))
    if codes:   # the words are the format's codes: decoded, the layer's fp16 scales' bf16
        idx = torch.arange(K // state.group_size) * state.group_size // g
        torch.testing.assert_close(cpu_layouts.decode_scale_words(state.scales), w.scales.float()[:, idx].T,
                                   rtol=0, atol=0)


# --------------------------------------------------------------------------- exactness

MODEL_SHAPES = [(640, 2048, 128), (1536, 576, 128), (576, 1536, 128)]   # down/gate-style, g=128
SMALL_SHAPES = [(256, 640, 128), (80, 96, 32), (48, 576, 64)]           # k/v-style; tail-only blocks


# every M with bf16, every dtype at M=1 and 8 (the float32/float16 → bf16 cast); M=64 once
# through the int4 op and once through the large-M dequant path (LARGE_M lowered to 64)
CASES = [(1, torch.bfloat16, None), (8, torch.bfloat16, None), (64, torch.bfloat16, 64),
         (1, torch.float32, None), (8, torch.float32, None), (64, torch.float32, 1 << 30),
         (1, torch.float16, None), (8, torch.float16, None)]


def _exact(shape, bits, rate, monkeypatch):
    N, K, gs = shape
    w, state = prepared((N, K, bits, rate, gs))
    assert state.planes == 1
    assert cpu._has_outliers(state) == (rate > 0.0)
    g = torch.Generator().manual_seed(3)
    default = cpu.LARGE_M
    for M, dt, large_m in CASES:
        monkeypatch.setattr(cpu, "LARGE_M", default if large_m is None else large_m)
        x = (torch.randn(M, K, generator=g) * 2).to(dt)
        check(w, state, x)


@pytest.mark.parametrize("rate", [0.0, 0.01, 0.05])
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("shape", MODEL_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}g{s[2]}")
def test_exact_vs_reference(shape, bits, rate, monkeypatch):
    _exact(shape, bits, rate, monkeypatch)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("shape", SMALL_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}g{s[2]}")
def test_exact_vs_reference_small(shape, bits, monkeypatch):
    _exact(shape, bits, 0.05, monkeypatch)


def test_contract_is_latq_linear_ref():
    """``check``'s contract reference is exactly :func:`latq_linear_ref` (cached)."""
    w, state = prepared((256, 640, 4, 0.01, 128))
    g = torch.Generator().manual_seed(12)
    for dt in (torch.bfloat16, torch.float32, torch.float16):
        x, bias = torch.randn(3, 640, generator=g).to(dt), torch.randn(256, generator=g).to(dt)
        mine = (x.float() @ expected(w, state).Wf.T + bias.float()).to(dt)
        assert torch.equal(mine, latq_linear_ref(x, w, bias))


def test_emulation_catches_one_wrong_weight():
    """The tight comparison fails if a single inlier is off by one step (the first inlier at
    or after column 300 of row 17: never an outlier position, whatever the seed placed)."""
    w, state = prepared((256, 640, 4, 0.01, 128))
    z = fmt.unpack(w.qweight, 4, 640)
    outliers = set(w.col[w.crow[17]:w.crow[18]].tolist())
    c = next(c for c in range(300, 640) if c not in outliers)
    z[17, c] = z[17, c] + (1 if z[17, c] < 7 else -1)
    bad = LatqWeight(fmt.pack(z, 4), w.scales, w.crow, w.col, w.val, 4, 128, 640)
    x = torch.randn(1, 640, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    with pytest.raises(AssertionError, match="emulated"):
        check(w, CPUKernel.prepare(bad), x)


def test_rows_with_many_outliers():
    heavy = [(0, 1.0), (5, 0.6), (63, 0.5), (64, 0.3), (250, 0.9)]
    w, state = prepared((256, 640, 4, 0.01, 128), heavy_rows=tuple(heavy))
    counts = (w.crow[1:] - w.crow[:-1])
    assert counts[0] == 640 and counts.max() > 300
    g = torch.Generator().manual_seed(5)
    for M in (1, 3, 8, 64):
        check(w, state, torch.randn(M, 640, generator=g).to(torch.bfloat16))
        check(w, state, torch.randn(M, 640, generator=g))


@pytest.mark.parametrize("coding", [torch.float16, torch.int16, torch.float32])
def test_outlier_codings(coding, monkeypatch):
    """Each exact coding of the outlier values (``cpu_layouts.code_values``: fp16 where every
    value is fp16-exact, int16 z × the row's fp32 scale for a one-scale layer, else fp32) meets
    the tight bounds at every path's M, with bias, incl. the large-M dequant."""
    if coding == torch.int16:
        w = hptq_like(192, 576, 3.0, seed=4)
        assert w.nnz > 0 and w.group_size == 576
    else:
        w = make_weight(192, 576, 4, 0.05, group=64, seed=15, heavy_rows=((3, 0.5),),
                        fp16_values=coding == torch.float16)
    state = CPUKernel.prepare(w)
    if state.tile_col is not None:   # the tiles (where the C++ GEMV runs); else an fp32 CSR
        assert state.tile_val.dtype == coding and (state.row_scale is not None) == (coding == torch.int16)
    g = torch.Generator().manual_seed(16)
    monkeypatch.setattr(cpu, "LARGE_M", 64)
    for M in (1, 3, 8, 16, 64):
        bias = torch.randn(192, generator=g).to(torch.bfloat16)
        check(w, state, torch.randn(M, 576, generator=g).to(torch.bfloat16), bias)
        check(w, state, torch.randn(M, 576, generator=g))


def test_every_batch_size_and_leading_dims_and_bias():
    w, state = prepared((640, 2048, 4, 0.01, 128))
    g = torch.Generator().manual_seed(6)
    for M in list(range(1, 17)) + [cpu.large_m() - 1, cpu.large_m(), cpu.large_m() + 72]:
        check(w, state, torch.randn(M, 2048, generator=g).to(torch.bfloat16))
    for dt in (torch.bfloat16, torch.float32, torch.float16):
        bias = torch.randn(640, generator=g).to(dt)
        for M in (1, 5, 96):
            check(w, state, torch.randn(2, M, 2048, generator=g).to(dt), bias)


def test_chunked_prepare_and_large_m(monkeypatch):
    """Several prepare chunks and several large-M dequant chunks (with a 16-row tail)."""
    monkeypatch.setattr(cpu, "PREPARE_CHUNK", 64 * 256)
    monkeypatch.setattr(cpu_dequant, "CHUNK_BYTES", 2 * 256 * 64)
    w = make_weight(208, 256, 4, 0.02, group=64, seed=7)
    state = CPUKernel.prepare(w)
    g = torch.Generator().manual_seed(8)
    for M in (1, 8, cpu.large_m(), cpu.large_m() + 22):
        check(w, state, torch.randn(M, 256, generator=g).to(torch.bfloat16))


@pytest.mark.parametrize("native_bf16", ["1", "0"])
def test_large_m_gemm_in_the_cpus_fast_dtype(native_bf16, monkeypatch):
    """Prefill multiplies the dequantized chunks in bf16 where the CPU computes bf16 natively and
    in fp32 where it emulates it (AVX2-only CPUs, ``LATQ_CPU_BF16=0`` here): the same bf16
    operands either way, so the result is within the kernel's bounds in both — and the fp32 one
    is also the bf16 one to the bf16 rounding it skips."""
    monkeypatch.setenv("LATQ_CPU_BF16", native_bf16)
    monkeypatch.setattr(cpu_dequant, "CHUNK_BYTES", 2 * 512 * 64)
    w = make_weight(208, 512, 4, 0.01, group=128, seed=9)
    state = CPUKernel.prepare(w)
    x = torch.randn(cpu.large_m(), 512, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
    y = cpu_dequant.large_m_linear(state, x)
    assert y.dtype == (torch.bfloat16 if native_bf16 == "1" else torch.float32)
    check(w, state, x)
    if native_bf16 == "0":
        monkeypatch.setenv("LATQ_CPU_BF16", "1")
        yb = cpu_dequant.large_m_linear(state, x).float()
        assert torch.allclose(y, yb, rtol=2 ** -7, atol=1e-3 * float(yb.abs().max()))


def test_prefill_cache(monkeypatch):
    """Opt-in cached bf16 weight for large M: the same bf16(z·s) weight as the per-call dequant."""
    w, state = prepared((640, 2048, 4, 0.01, 128))
    x = torch.randn(cpu.large_m() + 3, 2048, generator=torch.Generator().manual_seed(13)).to(torch.bfloat16)
    monkeypatch.setattr(cpu_dequant, "PREFILL_CACHE", True)
    try:
        check(w, state, x)
        check(w, state, x)                       # second call: from the cache
        assert len(cpu_dequant._PREFILL.entries) >= 1
    finally:
        cpu.clear_prefill_cache()


def test_dropping_a_layer_frees_its_caches(monkeypatch):
    """The sparse CSR (pure-torch small-M path) and the opt-in prefill weight are kept while the
    layer's tensors live, and freed with them — also for a state rebuilt by ``unflatten`` per
    custom-op call (the cache is keyed by the tensors, not by the state object)."""
    monkeypatch.setattr(cpu_dequant, "PREFILL_CACHE", True)
    cpu.clear_prefill_cache()
    w = make_weight(64, 256, 4, 0.05, group=64, seed=14)
    state = CPUKernel.prepare(w, tiles=False)
    tensors, ints = CPUKernel.flatten(state)
    x1, xl = torch.randn(1, 256).to(torch.bfloat16), torch.randn(cpu.large_m(), 256).to(torch.bfloat16)
    with native.disabled():                     # the path that builds the CSR
        y = CPUKernel.apply(CPUKernel.unflatten(tensors, ints), x1)
        assert torch.equal(CPUKernel.apply(CPUKernel.unflatten(tensors, ints), x1), y)
    CPUKernel.apply(CPUKernel.unflatten(tensors, ints), xl)
    CPUKernel.apply(state, xl)
    assert len(cpu._CSR.entries) == 1 and len(cpu_dequant._PREFILL.entries) == (1 if state.layout_block else 0)
    del state, tensors
    gc.collect()
    assert not cpu._CSR.entries and not cpu_dequant._PREFILL.entries


# --------------------------------------------------------------------------- HPTQ / > 4 bits

def hptq_like(out, cin, spread, seed):
    """Unclipped Laplacian-ish integers under one fp16-exact scale → transcoded runtime form."""
    g = torch.Generator().manual_seed(seed)
    z = torch.round(torch.distributions.Laplace(0.0, spread).sample((out, cin))).int()
    return transcode(z.clamp(-2000, 2000), float(torch.tensor(0.0137).half()))


@pytest.mark.parametrize("split_rate,planes", [(0.0, 2), (1.0, 1)])
def test_wide_transcodes(monkeypatch, split_rate, planes):
    """5..8-bit inliers: two nibble planes along K, or off-grid weights as fp32 outliers."""
    monkeypatch.setattr(cpu, "SPLIT_MAX_EXTRA_RATE", split_rate)
    g = torch.Generator().manual_seed(9)
    seen = set()
    for (N, K), spread in (((256, 640), 4.0), ((192, 576), 12.0), ((64, 1024), 30.0)):
        w = hptq_like(N, K, spread, seed=N)
        assert w.group_size == K and w.scales.shape == (N, 1)
        seen.add(w.bits)
        state = CPUKernel.prepare(w)
        assert state.planes == (planes if w.bits > 4 else 1)
        for M in (1, 8, 64):
            for dt in (torch.bfloat16, torch.float32):
                check(w, state, torch.randn(M, K, generator=g).to(dt))
    assert max(seen) > 4, seen


def test_hptq_low_bits_use_whole_row_group():
    w = hptq_like(128, 576, 1.0, seed=1)
    assert w.bits <= 4
    state = CPUKernel.prepare(w)
    if cpu._gemv_here():                   # the GEMV's scales alone: one per row
        assert state.group_size == 576 and state.scales.shape == (1, 128)
    else:
        assert state.group_size == 64      # 576 = 9·64: the largest op group dividing K
    check(w, state, torch.randn(4, 576).to(torch.bfloat16))


# --------------------------------------------------------------------------- can_implement

def _w(out, cin, bits=4, group=128):
    """Shape-only weight (can_implement looks at shapes, bits and group size)."""
    return LatqWeight(torch.zeros(out, fmt.packed_words(cin, bits), dtype=torch.int32),
                      torch.ones(out, -(-cin // group), dtype=torch.float16),
                      torch.zeros(out + 1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
                      torch.zeros(0), bits, group, cin)


@pytest.mark.parametrize("w,device,dt,needle", [
    (lambda: _w(100, 256), "cpu", torch.bfloat16, "out_features=100"),
    (lambda: _w(64, 200, group=200), "cpu", torch.bfloat16, "in_features=200"),
    (lambda: _w(64, 96, group=48), "cpu", torch.bfloat16, "group size 48"),
    (lambda: _w(64, 100, group=32), "cpu", torch.bfloat16, "in_features=100"),
    (lambda: _w(64, 256), "meta", torch.bfloat16, "not a CPU"),
    (lambda: _w(64, 256), "cpu", torch.int8, "activation dtype"),
], ids=["ragged-N", "ragged-K", "group48", "K100", "device", "dtype"])
def test_cannot_implement_with_reason(w, device, dt, needle):
    weight = w()
    ok, why = CPUKernel.can_implement(weight, torch.device(device), dt)
    assert not ok and needle in why, why
    if device == "cpu" and dt == torch.bfloat16:   # a layer the op cannot take: prepare refuses too
        with pytest.raises(ValueError, match="CPU kernel cannot run"):
            CPUKernel.prepare(weight)


def test_can_implement_model_shapes():
    for N, K in [(1024, 640), (256, 640), (640, 1024), (2048, 640), (640, 2048),
                 (576, 576), (192, 576), (1536, 576), (576, 1536), (4096, 4096)]:
        ok, why = CPUKernel.can_implement(_w(N, K), torch.device("cpu"), torch.bfloat16)
        assert ok, (N, K, why)
    bad = _w(64, 256)
    bad.bits = 9
    ok, why = CPUKernel.can_implement(bad, torch.device("cpu"), torch.bfloat16)
    assert not ok and "9-bit" in why


def test_selector_sees_cpu_kernel(monkeypatch):
    from vllm_latq.kernels import selector
    assert CPUKernel in selector.kernels()
    monkeypatch.setenv(selector.ENV_FORCE, "cpu")
    assert selector.select(_w(64, 256), torch.device("cpu"), torch.bfloat16) is CPUKernel


def test_state_flattens_to_dense_tensors_and_ints():
    w, state = prepared((256, 640, 4, 0.01, 128))
    tensors, ints = CPUKernel.flatten(state)
    assert all(t is None or (isinstance(t, torch.Tensor) and t.layout == torch.strided) for t in tensors)
    again = CPUKernel.unflatten(tensors, ints)
    x = torch.randn(2, 640).to(torch.bfloat16)
    assert torch.equal(CPUKernel.apply(again, x), CPUKernel.apply(state, x))
