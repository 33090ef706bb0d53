"""Triton kernels, proven without a GPU.

* The load-time layout (pure torch): plane packing round trips, ELL-16 / CSR outliers
  rebuild the checkpoint's CSR, the outlier-layout model picks ELL for spread outliers and
  CSR for crowded ones.
* The kernels in Triton's interpreter (``TRITON_INTERPRET=1``, set by conftest) against
  ``latq_linear_ref``: bits {2, 3, 4, 5} × M {1, 2, 4, 7, 8, 16} × outlier rates {0, 1 %, 5 %}
  × fp16/bf16 (each grid: every pair of values by default, the whole grid in the slow suite),
  on shapes that are multiples of nothing (N = 40, K = 300: ragged scale group,
  ragged 32-column tile, rows padded to 16, K padded to the step; at 3 bits all of it is
  the 4-bit tail), with a row holding half the columns as outliers and rows holding none;
  split-K, bias, fp32 activations, the larger-M fallback, group sizes 32/64/one group per
  tensor, both outlier layouts. 3 and 5 bits also on K that is not a multiple of 512 (576,
  640, 896, 1280: whole 512-column chunks plus a tail), with split-K over main and tail steps.
* Coded scales (format/scale_codes.py): the laid-out words hold the format's codes and grids,
  the kernels' decode is the format's bit for bit, and both kernels match the reference on
  coded layers (bits {2, 3, 4} × M {1, 4, 9, 17, 64} × outliers {0, 2 %}).
* Offline compilation for sm_80/86/89/90 (real ptxas): no register spills, shared memory
  within the target's limit (heaviest config per kernel and bit width here; every config
  in the slow test and in ``bench/kernels.py``).
"""

import pytest
import torch

from tests.helpers import CROWDED, each_value, pairwise
from vllm_latq import format as fmt
from vllm_latq.kernels.triton import layout as tlay
from vllm_latq.kernels.weight import LatqWeight
from vllm_latq.kernels.reference import latq_linear_ref
from vllm_latq.testing.weights import random_weight

triton = pytest.importorskip("triton")
from vllm_latq.kernels.triton import kernel as tk  # noqa: E402
from vllm_latq.kernels.triton.kernel import TritonKernel  # noqa: E402

pytestmark = pytest.mark.skipif(not tk.INTERPRET, reason="kernel tests run in Triton's interpreter")

N, K = 40, 300


def make_weight(n=N, k=K, bits=4, group=128, rate=0.01, seed=0, crowded=True, scale_bits=None) -> LatqWeight:
    """Random b-bit inliers, fp16 scales (``scale_bits``: coded), fp16-exact CSR outliers at
    ``rate``; with ``crowded``, row 1 has half its columns as outliers and rows 3..5 none."""
    return random_weight(n, k, bits, rate, group=group, seed=seed, scale_lo=0.002, scale_span=0.02, val_std=0.2,
                         fp16_values=True, rows=CROWDED if crowded and rate > 0 else (), scale_bits=scale_bits)


def check(y, x, w, bias=None):
    ref32 = latq_linear_ref(x.float(), w, None if bias is None else bias.float())
    assert y.dtype == x.dtype and y.shape == ref32.shape
    eps = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float32: 2.0**-20}[x.dtype]
    scale = ref32.abs().max().item() + 1e-6
    # the output is rounded to x.dtype (≤ ½ ulp) after an fp32 sum in another order
    torch.testing.assert_close(y.float(), ref32, rtol=eps, atol=scale * 2e-6 + 1e-6)


def activations(m, dtype, k=K, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g).to(dtype)


# ----------------------------------------------------------------------------- layout (torch)

@pytest.mark.parametrize("pbits", [1, 2, 4])
def test_pack_plane_round_trip(pbits):
    v = torch.randint(0, 2**pbits, (32, 2 * 16 * (32 // pbits)), dtype=torch.uint8)
    words = tlay.pack_plane(v, pbits)
    assert words.dtype == torch.int32 and words.numel() == v.numel() * pbits // 32
    assert torch.equal(tlay.unpack_plane(words, pbits, *v.shape), v)


def test_plane_word_holds_slab_columns():
    """Word w, slot j of chunk c ↔ column c·16V + 16j + w (the kernels' slab order)."""
    n_pad, k_pad = 16, 256
    v = torch.zeros(n_pad, k_pad, dtype=torch.uint8)
    v[5, 128 + 16 * 3 + 7] = 3                                  # chunk 0 (2-bit: 256 cols), slot 11
    words = tlay.pack_plane(v, 2).reshape(1, 1, 16, 16)
    assert words[0, 0, 7, 5].item() == 3 << (2 * 11) and words.count_nonzero() == 1


@pytest.mark.parametrize("k", [K, 640, 1280])
@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_layout_inliers_round_trip(bits, k):
    """The planes hold z: bit planes of the main columns (3 bits: 2 + 1, 5 bits: 4 + 1, the
    1-bit plane of 5 bits padded to 512 columns), then at 3 bits the tail's z + 8 in the
    4-bit layout."""
    w = make_weight(bits=bits, k=k, rate=0.0)
    L = tlay.build(w)
    spans = tlay.plane_columns(bits, L.k_pad)
    km = tlay.main_columns(bits, L.k_pad)
    z = torch.zeros(L.n_pad, L.k_pad, dtype=torch.int64)
    shift = 0
    for (pb, cols), plane in zip(spans, L.planes):
        v = tlay.unpack_plane(plane, pb, L.n_pad, cols).long()
        if shift < bits:
            z[:, :km] |= v[:, :km] << shift
            shift += pb
        else:
            z[:, km:] = v - 8
    z[:, :km] -= 2 ** (bits - 1)
    assert torch.equal(z[:N, :k], fmt.unpack(w.qweight, bits, k).long())
    assert L.n_pad % 16 == 0 and len(L.planes) == len(spans)
    assert L.nbytes()["inliers"] == tlay.inlier_bytes(L.n_pad, bits, L.k_pad)


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_k_padding_is_at_most_one_128_column_step(bits):
    """K is padded by < 128 columns (2 bits: < 256, its step), and beyond b bits per padded
    column a 3/5-bit row stores at most 384 bits more (one 128-column step at 3 bits): at 3
    bits one more bit per tail column (the tail is < 512 columns, a multiple of 128), at 5
    bits the 1-bit plane's padding to 512 columns."""
    for k in range(16, 5000, 16):
        k_pad = tlay.pad_k(k, bits)
        extra = tlay.inlier_bytes(16, bits, k_pad) * 8 // 16 - bits * k_pad
        assert k_pad - k < (256 if bits == 2 else 128), k
        assert 0 <= extra <= (384 if bits in (3, 5) else 0), (k, extra)
    assert tlay.inlier_bytes(16, 3, 640) == 16 * (512 * 3 + 128 * 4) // 8     # Gemma3-270m's hidden size
    assert tlay.inlier_bytes(16, 3, 1024) == 16 * 1024 * 3 // 8               # whole chunks: no tail


def _dense_outliers(w):
    D = torch.zeros(w.out_features, w.in_features)
    rows = fmt.csr_rows(w.crow, w.nnz)
    D[rows, w.col.long()] = w.val
    return D


@pytest.mark.parametrize("mode", ["ell", "csr"])
def test_layout_outliers_rebuild_csr(mode):
    w = make_weight(rate=0.05)
    L = tlay.build(w, outlier_mode=mode)
    o = L.outliers
    D = torch.zeros(L.n_pad, K)
    if mode == "ell":
        for g in range(L.n_pad // 16):
            a, b = int(o["off"][g]), int(o["off"][g + 1])
            col = o["col"][a:b].reshape(-1, 16).long()
            val = o["val"][a:b].reshape(-1, 16)
            for r in range(16):
                D[16 * g + r].index_put_((col[:, r],), val[:, r].float(), accumulate=True)
        assert L.max_row_outliers == int((w.crow[1:] - w.crow[:-1]).max())
    else:
        D[o["row"].long(), o["col"].long()] = o["val"].float()
        assert o["crow"].numel() == L.n_pad + 1
    assert o["col"].dtype == torch.int16 and o["val"].dtype == torch.float16     # compact: 4 B/entry
    assert torch.equal(D[:N], _dense_outliers(w))


def test_outlier_model_choice():
    spread = make_weight(n=256, k=512, rate=0.02, crowded=False)
    assert tlay.outlier_model(spread.crow, 256)["mode"] == "ell"
    crowd = torch.zeros(257, dtype=torch.int32)                # one row in 16 holds all: ELL pads 16x
    counts = torch.zeros(256, dtype=torch.int64)
    counts[::16] = 400
    crowd[1:] = torch.cumsum(counts, 0)
    m = tlay.outlier_model(crowd, 256)
    assert m["mode"] == "csr" and m["padding"] == 16 and "csr" in m["reason"]


def test_spg():
    assert tk.spg_of(4, 128) == 8 and tk.spg_of(2, 128) == 8 and tk.spg_of(3, 128) == 8
    assert tk.spg_of(4, 32) == 2 and tk.spg_of(2, 96) == 2 and tk.spg_of(3, 4096) == 32
    assert tk.spg_of(4, 48) == 1


def test_lop3_lut():
    """The LUT in ``_and_or``'s ``lop3.b32`` (GPU branch) is the function its interpreter branch
    computes, ``(a & b) | c``: PTX's truth-table encoding, built bit by bit — bit
    ``4a + 2b + c`` of the LUT is f(a, b, c) — and read from the kernel's own source."""
    import inspect
    import re

    from vllm_latq.kernels.triton import device as triton_device

    src = inspect.getsource(triton_device._and_or.fn)
    luts = re.findall(r"lop3\.b32 \$0, \$1, \$2, \$3, (0x[0-9a-fA-F]+);", src)
    assert len(luts) == 1, src
    assert "return (a & MASK) | c" in src            # the interpreter's (and the docstring's) function

    def f(a, b, c):
        return (a & b) | c

    lut = sum(f(i >> 2 & 1, i >> 1 & 1, i & 1) << i for i in range(8))
    assert int(luts[0], 16) == lut


# ----------------------------------------------------------------------------- selector contract

def test_can_implement(monkeypatch):
    w = make_weight()
    monkeypatch.delenv(tk.ENV_INTERPRET_OK, raising=False)
    ok, why = TritonKernel.can_implement(w, torch.device("cpu"), torch.bfloat16)
    assert not ok and "CUDA" in why and tk.ENV_INTERPRET_OK in why
    monkeypatch.setenv(tk.ENV_INTERPRET_OK, "1")
    assert TritonKernel.can_implement(w, torch.device("cpu"), torch.bfloat16) == (True, None)
    w6 = LatqWeight(w.qweight, w.scales, w.crow, w.col, w.val, 6, 128, K)
    ok, why = TritonKernel.can_implement(w6, torch.device("cpu"), torch.bfloat16)
    assert not ok and "6-bit" in why
    w24 = make_weight(group=24)
    ok, why = TritonKernel.can_implement(w24, torch.device("cpu"), torch.bfloat16)
    assert not ok and "24" in why
    ok, why = TritonKernel.can_implement(w, torch.device("cpu"), torch.int8)
    assert not ok


def test_selector_picks_triton_in_interpreter(monkeypatch):
    from vllm_latq.kernels import selector
    monkeypatch.setenv(tk.ENV_INTERPRET_OK, "1")
    assert selector.select(make_weight(), torch.device("cpu"), torch.float16) is TritonKernel
    monkeypatch.delenv(tk.ENV_INTERPRET_OK)
    assert selector.select(make_weight(), torch.device("cpu"), torch.float16) is not TritonKernel


# ----------------------------------------------------------------------------- kernels (interpreter)

_STATES = {}


def state_for(bits, rate, mode=None, group=128, k=K, scale_bits=None):
    key = (bits, rate, mode, group, k, scale_bits)
    if key not in _STATES:
        w = make_weight(bits=bits, k=k, rate=rate, group=group, seed=bits, scale_bits=scale_bits)
        _STATES[key] = (w, TritonKernel.prepare(w, outlier_mode=mode))
    return _STATES[key]


# all pairs of the grid by default, the whole grid in the slow suite
@pytest.mark.parametrize("bits,m,rate,dtype", pairwise(bits=[2, 3, 4, 5], m=[1, 2, 4, 7, 8, 16], rate=[0.0, 0.01, 0.05],
                                                       dtype=[torch.float16, torch.bfloat16]))
def test_kernel_matches_reference(bits, m, rate, dtype):
    w, st = state_for(bits, rate)
    x = activations(m, dtype, seed=m)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(5)).to(dtype) if m % 2 else None
    y = TritonKernel.apply(st, x, bias)
    check(y, x, w, bias)


@pytest.mark.parametrize("bits,k,kernel,m", pairwise(bits=[3, 5], k=[576, 640, 896, 1280], **{
    "kernel,m": [("gemv", 1), ("gemv", 3), ("mma", 8), ("mma", 20)]}))
def test_k_tails(bits, k, kernel, m):
    """K not a multiple of 512 (SmolLM2's 576, Gemma3's 640, Qwen2.5's 896, 1280 ~ 4864 =
    9·512 + 256): 3 bits run whole 512-column chunks and then the 4-bit tail (1, 1, 3, 2
    steps); 5 bits 128-column steps, the last 1-bit chunk part padding. Outliers on, bias."""
    w, st = state_for(bits, 0.02, k=k)
    if bits == 3:
        assert st.plane_t.numel() == st.n_pad * (st.k_pad % 512) // 8 and st.k_pad == -(-k // 128) * 128
    x = activations(m, torch.bfloat16, k=k, seed=m)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    check(TritonKernel.apply(st, x, bias, kernel=kernel), x, w, bias)


@pytest.mark.parametrize("kernel,m", [("gemv", 3), ("mma", 8)])
@pytest.mark.parametrize("mode", ["ell", "csr"])
@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_both_outlier_layouts(bits, mode, kernel, m):
    w, st = state_for(bits, 0.05, mode)
    assert st.outl == tk.OUTL_CODE[mode]
    x = activations(m, torch.bfloat16)
    check(TritonKernel.apply(st, x, kernel=kernel), x, w)


# coded scales (format/scale_codes.py): the kernels decode 4-bit codes on 16-row grids

def test_coded_scale_words_decode_to_the_formats_scales():
    """The laid-out words (codes of rows 0–7, 8–15, min | step) hold each scale's code and its
    slab's grid; padding groups are zero words."""
    w = make_weight(group=64, scale_bits=4)
    L = tlay.build(w)
    words = L.scales.long() & 0xFFFFFFFF                                  # [slabs, groups, 3]
    ngp = -(-L.k_pad // 64)                                                # 6: one padding group
    assert L.scales.dtype == torch.int32 and words.shape == (L.n_pad // 16, ngp, tlay.CODED_WORDS)
    r = torch.arange(L.n_pad)
    codes = (words[r // 16, :, (r % 16) // 8] >> (4 * (r % 8))[:, None]) & 15       # [n_pad, groups]
    smin, step = (((words[..., 2] >> sh) & 0xFFFF).short().view(torch.float16) for sh in (0, 16))
    S = fmt.scale_codes.decode_scales(codes[:N, :5], smin[:, :5], step[:, :5])
    assert torch.equal(S, w.coded.decode()) and torch.equal(S.half(), w.scales)
    assert torch.equal(codes[:N, :5], w.coded.codes.long()) and not words[:, 5:].any()
    fp16 = tlay.build(make_weight(group=64))
    assert L.nbytes()["scales"] * 32 == fp16.nbytes()["scales"] * 12 == tlay.scale_bytes(L.n_pad, ngp, True) * 32


@pytest.mark.parametrize("kernel", ["gemv", "mma"])
def test_coded_scales_are_decoded_bit_exactly(kernel):
    """With z = 1 everywhere and one-hot fp32 activations (exact sums), ``y[i, n]`` is the
    decoded scale of row n, group i: the kernels' decode equals ``scale_codes.decode_scales``
    bit for bit, over scales from fp16 subnormals to ~100 (codes' rounding at every magnitude)."""
    g = torch.Generator().manual_seed(3)
    S = (torch.randn(N, 5, generator=g) * 4).exp().mul(1e-3).clamp(2.0**-24, 100.0)
    S[16:32] = 0.25                                                    # one slab with step 0
    coded = fmt.scale_codes.code_scales(S)
    bits = 4
    w = LatqWeight(fmt.pack(torch.ones(N, K, dtype=torch.int32), bits), coded.decode().half(),
                   torch.zeros(N + 1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32), torch.zeros(0),
                   bits, 64, K, coded)
    x = torch.zeros(5, K)
    x[torch.arange(5), 64 * torch.arange(5)] = 1.0
    y = TritonKernel.apply(TritonKernel.prepare(w), x, kernel=kernel)
    assert torch.equal(y.T, fmt.scale_codes.decode_scales(coded.codes, coded.min, coded.step))


@pytest.mark.parametrize("bits", [3, 4])
def test_solver_coded_scales_through_the_stored_form(bits):
    """A layer quantized with coded scales (``rtn(..., scale_bits=4)``), written as stored
    tensors and read back as the loader does: the Triton state lays out its codes and both
    kernels match the reference (the codes' fp16 decode)."""
    from vllm_latq.kernels.weight import from_dense_tensors
    from vllm_latq.algorithms.solvers import rtn
    W = torch.randn(N, 640, generator=torch.Generator().manual_seed(bits)) * 0.02
    t = fmt.encode_layer(rtn(W, bits=bits, group_size=64, scale_bits=4), "dense")
    w = from_dense_tensors(t, bits, 64, 640)
    st = TritonKernel.prepare(w)
    assert w.coded is not None and st.coded_scales
    for m in (1, 9):
        x = activations(m, torch.bfloat16, k=640, seed=m)
        check(TritonKernel.apply(st, x, kernel="gemv" if m < 8 else "mma"), x, w)


@pytest.mark.parametrize("bits,m,rate", pairwise(bits=[2, 3, 4], m=[1, 4, 9, 17, 64], rate=[0.0, 0.02]))
def test_kernel_coded_scales_match_reference(bits, m, rate):
    """Coded scales at group 64 (several groups per K step), both kernels by M."""
    w, st = state_for(bits, rate, group=64, scale_bits=4)
    assert st.coded_scales
    x = activations(m, torch.bfloat16, seed=m)
    check(TritonKernel.apply(st, x, kernel="gemv" if m < 8 else "mma"), x, w)


# K = 33000 runs long in the interpreter: the slow suite's (the int32 columns' layout: the test below)
@pytest.mark.parametrize("mode,k", [pytest.param("ell", 33000, marks=pytest.mark.slow), ("csr", K)])
def test_wide_outliers(mode, k):
    """fp32 outlier values (not fp16-exact, as from an HPTQ transcode), and for ELL K > 32768
    (int32 columns): the non-compact entry types."""
    w = make_weight(n=16, k=k, bits=4, rate=0.002 if k > K else 0.05, seed=11)
    w.val = w.val + 1e-4 * torch.rand(w.val.shape, generator=torch.Generator().manual_seed(1))
    st = TritonKernel.prepare(w, outlier_mode=mode)
    col, val = st.outl_col, st.outl_val
    assert col.dtype == (torch.int32 if k > 32768 else torch.int16) and val.dtype == torch.float32
    x = activations(1, torch.float16, k=k)
    check(TritonKernel.apply(st, x), x, w)


def test_wide_outlier_columns_are_int32():
    """ELL outliers of a layer with K > 32768 columns keep int32 columns (the kernel on them: slow above)."""
    w = make_weight(n=16, k=33000, bits=4, rate=0.002, seed=11)
    st = TritonKernel.prepare(w, outlier_mode="ell")
    assert st.outl_col.dtype == torch.int32 and int(st.outl_col.max()) > 32767


@pytest.mark.parametrize("bits,k,mode,kernel,m,cfg", pairwise(**{
    "bits,k": [(4, 600), (5, 600), (3, 1280)], "mode": ["ell", "csr"],
    "kernel,m,cfg": [("gemv", 2, dict(BN=32, SPLIT=4, num_warps=2)), ("gemv", 5, dict(BN=16, SPLIT=3, num_warps=1)),
                     ("mma", 9, dict(BN=32, SPLIT=2, BR=4, num_warps=4)),
                     ("mma", 16, dict(BN=16, SPLIT=4, BR=16, num_warps=4))]}))
def test_split_k(bits, k, kernel, m, cfg, mode):
    """K = 600 (5 steps at 4/5 bits; 1280 at 3 bits: 2 main steps + 2 tail steps, dealt to
    the splits from the last): splits get unequal step counts, one may get none; the ticket
    counters are reset, so a second call is right too."""
    w = make_weight(k=k, bits=bits, rate=0.03, seed=3)
    st = TritonKernel.prepare(w, outlier_mode=mode)
    for seed in (1, 2):
        x = activations(m, torch.float16, k=k, seed=seed)
        bias = torch.randn(N).half()
        check(TritonKernel.apply(st, x, bias, kernel=kernel, config=cfg), x, w, bias)
    assert int(st.tickets.abs().sum()) == 0


@pytest.mark.parametrize("group", [32, 64, None])
@pytest.mark.parametrize("bits,k", [(2, K), (3, K), (3, 640), (4, K), (5, K)])
def test_group_sizes(bits, k, group):
    """32/64: several scale groups per dot / per slab run; None = K: one group per row
    (HPTQ transcode form); 3 bits at K = 640: the main step's groups, then the tail's."""
    w = make_weight(bits=bits, k=k, group=group or k, rate=0.01, seed=7)
    st = TritonKernel.prepare(w)
    for m in (1, 8):
        x = activations(m, torch.bfloat16, k=k)
        check(TritonKernel.apply(st, x), x, w)


def test_fp32_activations_and_shapes():
    w, st = state_for(3, 0.01)
    for m in (1, 8, 20):                                         # fp32: SIMT for every M (tiles of 8)
        x = activations(m, torch.float32)
        bias = torch.randn(N)
        check(TritonKernel.apply(st, x, bias), x, w, bias)
    x = activations(6, torch.bfloat16).reshape(2, 3, K)          # leading dims are flattened
    y = TritonKernel.apply(st, x)
    assert y.shape == (2, 3, N)
    check(y.reshape(6, N), x.reshape(6, K), w)
    xs = activations(4, torch.float16, k=2 * K)[:, ::2]          # non-contiguous input
    check(TritonKernel.apply(st, xs), xs.contiguous(), w)
    assert TritonKernel.apply(st, torch.zeros(0, K, dtype=torch.float16)).shape == (0, N)
    with pytest.raises(ValueError):
        TritonKernel.apply(st, torch.zeros(1, K + 1))


@pytest.mark.parametrize("bits,m,rate", pairwise(bits=[2, 3, 4, 5], m=[17, 40, 100], rate=[0.0, 0.05]))
def test_mma_large_m_tiles(bits, m, rate):
    """M > 16 on the tensor-core kernel: 32-row tiles (M ≤ 32), else 64-row tiles, the M
    tiles fastest in the grid (100: a ragged last tile); no split-K there."""
    w, st = state_for(bits, rate)
    assert tk.mma_bm(m) == (32 if m <= 32 else 64)
    x = activations(m, torch.bfloat16, seed=m)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    check(TritonKernel.apply(st, x, bias, kernel="mma"), x, w, bias)


@pytest.mark.parametrize("bits,mode", each_value(bits=[2, 3, 4, 5], mode=["ell", "csr"]))
def test_mma_large_tile_configs(bits, mode):
    """The production configs of the 32- and 64-row tiles (their smaller outlier slot
    counts BR), both outlier layouts, one tile and two (the last ragged)."""
    w, st = state_for(bits, 0.05, mode)
    for bm, m in ((32, 20), (64, 70)):
        cfg = tk.mma_configs(bm, bits)[0]
        assert cfg["BR"] * bm == 128
        x = activations(m, torch.float16, seed=m)
        check(TritonKernel.apply(st, x, kernel="mma", config=dict(cfg, BM=bm)), x, w)


def test_large_m_split_refused():
    """Split-K needs one row tile and at most ``SPLITK_ROWS`` partial rows (SPLIT · BM)."""
    w, st = state_for(4, 0.05)
    x = activations(70, torch.bfloat16)
    with pytest.raises(ValueError, match="SPLIT"):                 # two 64-row tiles
        TritonKernel.apply(st, x, kernel="mma", config=dict(BN=32, SPLIT=2, BR=2))
    with pytest.raises(ValueError, match="SPLIT must be ≤ 4 at 32-row"):
        TritonKernel.apply(st, x[:20], kernel="mma", config=dict(BN=32, SPLIT=8, BR=4))


@pytest.mark.parametrize("bits,mode", each_value(bits=[3, 4], mode=["ell", "csr"]))
def test_mma_large_tile_split_k(bits, mode):
    """One 32- or 64-row tile split over K (the largest split its partial rows allow), unequal
    step counts per split: the partials reduce to the reference, twice (tickets reset)."""
    w, st = state_for(bits, 0.05, mode)
    for bm, m, split in ((32, 20, 4), (64, 33, 2)):
        cfg = dict(tk.mma_configs(bm, bits)[0], SPLIT=split, BM=bm)
        for seed in (1, 2):
            x = activations(m, torch.float16, seed=seed)
            check(TritonKernel.apply(st, x, kernel="mma", config=cfg), x, w)


def test_m_buckets_and_tiles():
    """Autotuning per M bucket: batch 1 and batch 64 never share a tuned config."""
    assert [tk.m_bucket(m) for m in (1, 2, 3, 8, 9, 64, 65, 256, 4096)] == [1, 2, 4, 8, 16, 64, 128, 256, 256]
    assert [tk.mma_bm(m) for m in (1, 8, 16, 17, 32, 33, 64, 65, 1000)] == [16, 16, 16, 32, 32, 64, 64, 64, 64]
    assert tk.tuned("mma", 4, 1) is not tk.tuned("mma", 4, 64) and tk.tuned("mma", 4, 64) is tk.tuned("mma", 4, 64)
    splits = {c.kwargs["SPLIT"] for c in tk.tuned("mma", 4, 16).configs}
    assert splits == {1, 2, 4, 8} and {c.kwargs["SPLIT"] for c in tk.tuned("mma", 4, 128).configs} == {1}
    assert all((getattr(c, "maxnreg", None) is not None) == tk.MAXNREG_OK for c in tk.tuned("gemv", 2, 1).configs)


def test_plane_pointers_are_int32(monkeypatch):
    """Every plane pointer the kernels get is int32, also for a plane the layer lacks (3 bits
    without a tail or without a whole chunk, the 1-bit plane at 2/4 bits): Triton types a
    kernel by its pointers, and the word-tile code behind a zero-trip loop must compile."""
    seen = []

    class Record:
        def __getitem__(self, grid):
            return lambda *args, **meta: seen.append(args[3:6])

    for kind in ("gemv", "mma"):
        monkeypatch.setitem(tk._KERNELS, kind, Record())
    for bits, k in ((3, 1024), (3, K), (2, K), (5, K)):
        w, st = state_for(bits, 0.0, k=k)
        for kind, m in (("gemv", 1), ("mma", 8)):
            TritonKernel.apply(st, activations(m, torch.float16, k=k), kernel=kind)
    assert len(seen) == 8 and all(t.dtype == torch.int32 for planes in seen for t in planes)


def test_state_flattens_for_the_plugin():
    """The plugin keeps flatten(state) as buffers + static ints and rebuilds it per call."""
    from vllm_latq.kernels import ops
    for bits, rate, mode, k in ((3, 0.05, "csr", K), (4, 0.0, None, K), (2, 0.01, "ell", K), (3, 0.02, None, 640),
                                (5, 0.0, None, K)):
        w, st = state_for(bits, rate, mode, k=k)
        tensors, ints = TritonKernel.flatten(st)
        assert all(t is None or isinstance(t, torch.Tensor) for t in tensors) and all(type(i) is int for i in ints)
        st2 = TritonKernel.unflatten(tensors, ints)
        x = activations(3, torch.bfloat16, k=k)
        assert torch.equal(TritonKernel.apply(st2, x), TritonKernel.apply(st, x))
        y = ops.op_for(TritonKernel)(x, tensors, ints, None, N)
        check(y, x, w)


# ----------------------------------------------------------------------------- offline compilation

def _check_static(rows):
    from tools import triton_compile as tc
    bad = [r for r in rows if "error" in r]
    assert not bad, tc.report(bad)
    spills = [r for r in rows if (r["spill_stores"] or r["spill_loads"] or r["stack"])]
    assert not spills, "register spills:\n" + tc.report(spills)
    big = [r for r in rows if r["smem"] > r["smem_limit"]]
    assert not big, "shared memory over the limit:\n" + tc.report(big)
    assert all(r["regs"] and r["regs"] <= 255 for r in rows)
    return rows


def test_offline_compile_heaviest_configs():
    """The heaviest configs compiled (uncached in CI) pass the static checks and give the
    committed record's rows."""
    from tools import triton_compile as tc
    from tools import triton_record as tr
    jobs = tc.all_jobs(quick=True)
    assert {j["cc"] for j in jobs} == {80, 86, 89, 90}
    assert {j["kernel"] for j in jobs} == {"gemv", "mma", "gemv_pipe", "mma_pipe", "moe", "dequant", "outliers",
                                           "hadamard", "e8_gemv", "e8_mma", "e8_dequant"}
    rows = _check_static(tc.summarize(jobs, tc.run(jobs)))
    tensor_cores = ("mma", "mma_pipe", "e8_mma")
    assert all(r["mma"] > 0 for r in rows if r["kernel"] in tensor_cores)        # tensor cores used
    assert all(r["mma"] == 0 for r in rows if r["kernel"] not in tensor_cores)   # SIMT only
    record = tr.read_record()
    if not tr.record_staleness(record, tc.all_jobs()):                    # else the test below fails
        assert not (bad := tr.record_mismatches(jobs, rows, record)), "\n".join(bad)


def test_compile_record_is_current():
    """tools/compile_record.json holds every job of the full sweep compiled from this checkout's
    kernels with this Triton: what the slow sweep checks is what would be compiled."""
    from tools import triton_compile as tc
    from tools import triton_record as tr
    why = tr.record_staleness(tr.read_record(), tc.all_jobs())
    assert not why, ("tools/compile_record.json is stale (" + "; ".join(why) + "): rewrite it with "
                     "`python -m tools.triton_compile --record` (docs/KERNELS.md), then "
                     "`python -m tools.launch_table` to rebuild the launch report and table from it")


def test_compile_record_holds_no_spills():
    """Every job of the committed full sweep compiled without register spills or a stack frame (the
    heaviest are compiled again above; a spill elsewhere would otherwise pass unseen)."""
    from tools import triton_record as tr
    rows = tr.read_record()["rows"]
    spilled = [k for k, r in rows.items() if r["spill_stores"] or r["spill_loads"] or r["stack"]]
    assert rows and not spilled, spilled


def test_record_keeps_the_rows_of_unchanged_kernels(monkeypatch):
    """``--record`` compiles only the jobs of kernels whose device code changed: the others' rows come
    from the record while their code, Triton and the summary are the ones it was written with."""
    from tools import triton_compile as tc
    from tools import triton_record as tr
    jobs = tc.all_jobs()
    record = tr.read_record()
    if tr.record_staleness(record, jobs):
        pytest.skip("the record is stale (test_compile_record_is_current says why)")
    assert tr.current_rows(jobs) == {tc.job_key(j): record["rows"][tc.job_key(j)] for j in jobs}
    real = tc.code_hash
    monkeypatch.setattr(tc, "code_hash", lambda k: "edited" if k == "e8_gemv" else real(k))
    kept = tr.current_rows(jobs)
    assert {tc.job_key(j) for j in jobs} - set(kept) == {tc.job_key(j) for j in jobs if j["kernel"] == "e8_gemv"}
    monkeypatch.setattr(tc, "triton_version", lambda: "0.0")
    assert tr.current_rows(jobs) == {}


SAMPLE_PER_TARGET = {"gemv": 4, "mma": 4, "gemv_pipe": 2, "mma_pipe": 2, "moe": 1, "dequant": 1, "outliers": 1,
                     "hadamard": 1, "e8_gemv": 1, "e8_mma": 1, "e8_dequant": 1}


def _record_sample(jobs: list[dict], seed: int, per_target: dict = SAMPLE_PER_TARGET) -> list[dict]:
    """``per_target[kernel]`` jobs of each kernel and target, drawn with ``seed``."""
    import random
    rng, out = random.Random(seed), []
    for kernel, n in per_target.items():
        for cc in sorted({j["cc"] for j in jobs}):
            pool = [j for j in jobs if j["kernel"] == kernel and j["cc"] == cc]
            out += rng.sample(pool, min(n, len(pool)))
    return out


@pytest.mark.slow
def test_offline_compile_every_config():
    """Every job of the full sweep passes the static checks. The sweep is too long for CI's slow
    suite (docs/KERNELS.md), so the rows come from the committed record (current: the test above)
    and a sample of them, drawn afresh each run (seed in the message; LATQ_RECORD_SEED repeats
    one), is compiled uncached and must give the record's rows exactly. A stale record: every job
    is compiled here."""
    import os
    import time
    from tools import triton_compile as tc
    from tools import triton_record as tr
    jobs, record = tc.all_jobs(), tr.read_record()
    if tr.record_staleness(record, jobs):
        _check_static(tc.summarize(jobs, tc.run(jobs)))
        return
    _check_static([record["rows"][tc.job_key(j)] for j in jobs])
    seed = int(os.environ.get("LATQ_RECORD_SEED", time.time_ns() % 2**32))
    sample = _record_sample(jobs, seed)
    bad = tr.record_mismatches(sample, tc.summarize(sample, tc.run(sample, cache=False)), record)
    assert not bad, f"LATQ_RECORD_SEED={seed}: compiled afresh, these differ from the record:\n" + "\n".join(bad)


def test_record_sample_draws_every_kernel_and_target():
    from tools import triton_compile as tc
    jobs = tc.all_jobs()
    a, b = _record_sample(jobs, 1), _record_sample(jobs, 2)
    assert len(a) == sum(n * len({j["cc"] for j in jobs if j["kernel"] == k}) for k, n in SAMPLE_PER_TARGET.items())
    assert {(j["kernel"], j["cc"]) for j in a} == {(j["kernel"], j["cc"]) for j in jobs}
    assert a == _record_sample(jobs, 1) and a != b


def test_compile_report_covers_every_launched_jit_kernel():
    """Every ``@triton.jit`` kernel the package launches (one no other jit function calls) is a
    kernel of the offline compile report, with jobs for every target in the quick sweep and
    the full one."""
    from tools import triton_sources as ts
    found = ts.package_kernels()
    assert len(found) >= 5 and found <= ts.reported_kernels(), (
        f"jit kernels missing from tools/triton_sources.KERNELS: {sorted(found - ts.reported_kernels())}")
    from vllm_latq.kernels.triton.configs import PIPE_FAMILIES
    for quick in (True, False):
        covered = {(j["kernel"], j["cc"]) for j in ts.all_jobs(quick=quick)}
        assert covered == {(k, cc) for k in ts.KERNELS for cc in ts.TARGETS
                           if not k.endswith("_pipe") or f"sm_{cc}" in PIPE_FAMILIES}


def test_kernel_scan_tells_kernels_from_device_helpers(tmp_path):
    """The scan behind the coverage test: a new launched kernel is found (so the test above
    fails on it), a jit helper called by a kernel in another file is not, nor is host code."""
    from tools import triton_sources as ts
    (tmp_path / "k").mkdir()
    (tmp_path / "helpers.py").write_text(
        "import triton\n@triton.jit\ndef _h(x):\n    return x\n")
    (tmp_path / "k" / "new.py").write_text(
        "import triton\nfrom triton import jit\nfrom ..helpers import _h\n"
        "@triton.jit(do_not_specialize=['M'])\ndef _new_kernel(p, M):\n    _h(p)\n"
        "@jit\ndef _other(p):\n    pass\n"
        "def host():\n    _new_kernel[(1,)](0, 1)\n")
    assert ts.package_kernels(tmp_path) == {("k/new.py", "_new_kernel"), ("k/new.py", "_other")}


def test_bench_bytes_model():
    """bench/kernels.py's memory-bound ceiling: fewer bits and fewer outliers → higher."""
    from bench import kernels as bk
    lines, ceil = bk.bytes_model(1)
    assert ceil[4, 0.0] == pytest.approx(2 / (0.5 + 2 / 128), rel=0.01)      # bf16 / (b/8 + scales)
    for r in bk.RATES:
        assert ceil[2, r] > ceil[3, r] > ceil[4, r]
    for b in bk.BITS:
        assert all(ceil[b, r1] > ceil[b, r2] for r1, r2 in zip(bk.RATES, bk.RATES[1:]))
    assert ceil[3, 0.01] > 3.5 and ceil[4, 0.01] > 3.0


def test_launch_allocates_on_the_input_device():
    """The output, the shared split-K scratch (reserved at load) and the large-M scratch are
    made on the activations' / layer's device: no tensor factory without ``device=``."""
    from tests.device_guard import factories_follow_inputs
    w, st = state_for(4, 0.05)
    split = dict(BN=32, SPLIT=4, num_warps=2)
    xs = {m: activations(m, torch.bfloat16, seed=m) for m in (1, 20)}
    with factories_follow_inputs():
        TritonKernel.reserve(st, torch.bfloat16)
        for m, kind, cfg in ((1, "gemv", split), (20, "mma", None), (20, "dequant", None)):
            TritonKernel.apply(st, xs[m], kernel=kind, config=cfg)
