"""The Triton kernels for codebook layers (triton-e8), in Triton's interpreter against ``latq_linear_ref``.

* Layout: the shared table's pattern fields xor the computed sign words are every E8P code's point,
  its ball fields the ball's points; the code planes hold each block's stage codes; served bytes are
  ``codebook_bytes`` plus the shared table.
* The kernels: bits {2, 3, 4} × scale groups {16, 64, one a row} × fp16 / coded scales × M {1, 3, 17,
  40} × fp32 / bf16 / fp16 activations, on ragged shapes (N = 40 padded to 48, K = 200: a partial K
  step and a partial scale group); bias, split-K, every one of E8P's 2¹⁶ codes.
* Selection: the family's member for the codebook form, forced with ``LATQ_KERNEL=triton`` on CPU
  tensors in the interpreter, rotated layers through the wrapper; what it refuses.
"""
import pytest
import torch

from vllm_latq.format import codebook as cb
from vllm_latq.kernels.reference import latq_linear_ref
from vllm_latq.kernels.weight import CodebookWeight, dequantize
from vllm_latq.testing.weights import random_codebook_weight

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from vllm_latq.kernels.triton import codebook as tcb  # noqa: E402
from vllm_latq.kernels.triton import codebook_device as tcd  # noqa: E402
from vllm_latq.kernels.triton import kernel as tk  # noqa: E402
from vllm_latq.kernels.triton.codebook import TritonCodebookKernel  # noqa: E402

pytestmark = pytest.mark.skipif(not tk.INTERPRET, reason="kernel tests run in Triton's interpreter")

N, K = 40, 200


def make_weight(bits=3, n=N, k=K, group=16, coded=False, seed=0) -> CodebookWeight:
    """Random codes, scales in [0.002, 0.022) (``group`` None: one a row), coded to 4 bits if asked."""
    return random_codebook_weight(n, k, bits, group=group, seed=seed, scale_bits=4 if coded else None)


def check(y, x, w, bias=None, route=None):
    """Against the fp32 reference; where the route (``apply``'s own choice when None) decodes the
    weight once (``dequant``), against x·W_dtypeᵀ in fp32: the weight rounded once to x's dtype."""
    route = route or tcb.route(x.reshape(-1, x.shape[-1]).shape[0], x.dtype)
    if route == "dequant":
        ref = x.float() @ dequantize(w).to(x.dtype).float().T + (0 if bias is None else bias.float())
    else:
        ref = latq_linear_ref(x.float(), w, None if bias is None else bias.float())
    assert y.dtype == x.dtype and y.shape == ref.shape
    eps = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float32: 2.0**-20}[x.dtype]
    # the output is rounded to x.dtype (≤ ½ ulp) after an fp32 sum in another order
    torch.testing.assert_close(y.float(), ref, rtol=eps, atol=2e-6 * ref.abs().max().item() + 1e-6)


def activations(m, dtype, k=K, seed=1):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.fixture
def interpret_ok(monkeypatch):
    monkeypatch.setenv(tk.ENV_INTERPRET_OK, "1")


# ----------------------------------------------------------------------------- layout

@triton.jit
def _e8p_words_of(c_ptr, lo_ptr, hi_ptr, tab_ptr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    lo, hi = tcd._e8p_words(tl.load(c_ptr + i), tab_ptr, False, False)
    tl.store(lo_ptr + i, lo)
    tl.store(hi_ptr + i, hi)


def test_table_and_sign_words_hold_the_formats_points():
    """A code's pattern entry xor its computed sign words (``_sign_words``: the eighth sign by the
    parities) holds u_j = (σ_j·2|a_j| + 7)/2 at bit 6j of its low word (j < 4) or 6(j − 4) of its high
    one, the shift at bit 31; the ball's entries its points. Checked on all 2¹⁶ E8P codes, the device's
    own decode in the interpreter."""
    words = tcb.table_words()
    assert words.dtype == torch.int64 and words.shape == (tcb.TABLE_ENTRIES,) and (words >= 0).all()
    j = torch.arange(cb.DIM)
    at = 6 * (j % 4) + 32 * (j // 4)
    e8p, ball = words[:tcb.BALL_AT], words[tcb.BALL_AT:]
    c = torch.arange(2**16, dtype=torch.int32)
    lo, hi = torch.empty_like(c), torch.empty_like(c)
    _e8p_words_of[(2**16 // 1024,)](c, lo, hi, words, BLOCK=1024)
    u = (lo.long() & 0xFFFFFFFF) | (hi.long() << 32)
    points = ((u[:, None] >> at) & 7).double() - 3.5 + torch.where((u >> 31) & 1 == 1, -0.25, 0.25)[:, None]
    assert torch.equal(points, cb.decode_e8p(c.long()).double())
    assert torch.equal((((ball[:, None] >> at) & 63) - 8).double() / 2, cb.e8_ball256())
    # bits 3–5 of each E8P field clear (room for the second stage's ×4), the ball's ≤ 12: sums ≤ 40 never carry
    assert not (u[:, None] >> at & 0b111000).any() and ((ball[:, None] >> at) & 63).max() <= 12


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_code_planes_hold_each_stage(bits):
    w = make_weight(bits)
    pa, pb = tcb.code_planes(w.codes, bits, 48)
    stages = tcb.e8p_codes(w.codes, bits)
    assert pa.dtype == (torch.int32 if bits == 4 else torch.int16) and pa.shape == (K // 8, 48)
    a = pa.long() & 0xFFFFFFFF
    assert torch.equal((a & 0xFFFF)[:, :N].t(), stages[0]) and not a[:, N:].any()
    if bits == 4:
        assert torch.equal((a >> 16)[:, :N].t(), stages[1])
    assert (pb is None) == (bits != 3)
    if bits == 3:
        assert pb.dtype == torch.uint8 and torch.equal(pb[:, :N].t().long(), stages[1])


@pytest.mark.parametrize("bits,group,coded", [(2, 16, False), (3, 64, True), (4, None, False), (3, 16, True)])
def test_served_bytes_are_codebook_bytes(bits, group, coded):
    w = make_weight(bits, group=group, coded=coded)
    st = TritonCodebookKernel.prepare(w)
    served = TritonCodebookKernel.served_bytes(st)
    assert served.pop("codebook") == tcb.TABLE_ENTRIES * 8
    assert served == TritonCodebookKernel.codebook_bytes(N, K, bits, w.group_size, 4 if coded else None)
    assert served["codes"] == 48 * (K // 8) * cb.CODEBOOKS[bits].index_bytes
    assert TritonCodebookKernel.shared_tensors(st)["codebook"] is TritonCodebookKernel.prepare(w).table
    with pytest.raises(ValueError, match="group size 24 is not a multiple of 16"):
        TritonCodebookKernel.codebook_bytes(N, K, bits, 24)


# ----------------------------------------------------------------------------- kernels (interpreter)

CASES = [(1, torch.float32), (3, torch.bfloat16), (17, torch.float16)]


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("group,coded", [(16, False), (64, True), (None, False), (16, True)])
def test_matches_reference(bits, group, coded):
    w = make_weight(bits, group=group, coded=coded)
    st = TritonCodebookKernel.prepare(w)
    assert st.coded_scales == coded
    # 40 rows: one 64-row tensor-core tile; 17 fp32 rows: three GEMV tiles of 8
    for m, dt in CASES + ([(40, torch.bfloat16), (17, torch.float32)] if group == 64 else []):
        x = activations(m, dt)
        check(TritonCodebookKernel.apply(st, x), x, w)


@pytest.mark.parametrize("kernel,m", [("gemv", 2), ("mma", 9)])
def test_bias_and_batch_dims(kernel, m):
    w = make_weight(4, group=64)
    st = TritonCodebookKernel.prepare(w)
    x = activations(m, torch.float16).reshape(1, m, K)
    bias = torch.randn(N).half()
    y = TritonCodebookKernel.apply(st, x, bias, kernel=kernel)
    assert y.shape == (1, m, N)
    check(y.reshape(m, N), x.reshape(m, K), w, bias, route=kernel)


@pytest.mark.parametrize("kernel,bits", [("gemv", 3), ("mma", 2)])
def test_split_k(kernel, bits):
    w = make_weight(bits, k=1024, group=64, coded=True)
    st = TritonCodebookKernel.prepare(w)
    x = activations(2 if kernel == "gemv" else 16, torch.bfloat16, k=1024)
    check(TritonCodebookKernel.apply(st, x, kernel=kernel, config=dict(SPLIT=4)), x, w, route=kernel)
    assert not st.tickets.any()          # the tickets are back to 0 for the next launch
    with pytest.raises(ValueError, match="split-K"):
        TritonCodebookKernel.apply(st, activations(40, torch.bfloat16, k=1024), kernel=kernel, config=dict(SPLIT=4))


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("group,coded", [(16, False), (64, True), (None, False), (16, True)])
def test_dequantize_is_exact(bits, group, coded):
    """The large-M route's decode equals ``dequantize(w).to(dtype)`` bit for bit (K = 200: a ragged
    last tile of blocks), whole and in row chunks into a wider matrix; fp32 out refused."""
    w = make_weight(bits, group=group, coded=coded, seed=bits)
    st = TritonCodebookKernel.prepare(w)
    for dt in (torch.float16, torch.bfloat16):
        ref = dequantize(w).to(dt)
        assert torch.equal(tcb.dequantize_into(st, torch.full((N, K), float("nan"), dtype=dt)), ref)
        wide = torch.zeros(N, K + 8, dtype=dt)
        for row0 in (0, 16, 32):
            tcb.dequantize_into(st, wide[row0:min(row0 + 16, N), :K], row0)
        assert torch.equal(wide[:, :K], ref) and not wide[:, K:].any()
    with pytest.raises(ValueError, match="fp16/bf16"):
        tcb.dequantize_into(st, torch.zeros(N, K))


def test_large_m_route(monkeypatch):
    """From LARGE_MIN_M rows of fp16/bf16 x, apply decodes once into the Triton kernels' shared
    scratch (reserved at load) and runs one GEMM; fp32 x and fewer rows stay on the GEMV."""
    from vllm_latq.kernels.triton import dequant
    w = make_weight(3, group=16, coded=True)
    st = TritonCodebookKernel.prepare(w)
    TritonCodebookKernel.reserve(st, torch.bfloat16)
    assert tk.TritonKernel.workspace.current(torch.bfloat16, torch.device("cpu")).numel() >= N * K
    routes = []
    real = dequant.apply_large_m
    monkeypatch.setattr(tcb, "apply_large_m", lambda *a, **k: routes.append("dequant") or real(*a, **k))
    for m, dt, route in ((tcb.LARGE_MIN_M - 1, torch.bfloat16, "gemv"), (tcb.LARGE_MIN_M, torch.bfloat16, "dequant"),
                         (tcb.LARGE_MIN_M, torch.float32, "gemv")):
        routes.clear()
        x = activations(m, dt)
        check(TritonCodebookKernel.apply(st, x), x, w, route=route)
        assert routes == ([route] if route == "dequant" else [])


@pytest.mark.parametrize("lds,ahead", [(False, False), (True, True)])
def test_every_e8p_code(lds, ahead):
    """All 2¹⁶ codes of E8P (signs, parity, shift) in one 2-bit layer, exact fp32 activations; the
    table read through L1 and through shared memory (``LDS``), the codes loaded a step ahead (``AHEAD``)."""
    codes = torch.arange(2**16).reshape(128, 512)
    w = CodebookWeight(torch.stack([codes & 255, codes >> 8], -1).to(torch.uint8), torch.ones(128, 1).half(), 2,
                       4096, 4096)
    x = activations(1, torch.float32, k=4096)
    y = TritonCodebookKernel.apply(TritonCodebookKernel.prepare(w), x, config=dict(BN=128, BKB=64, LDS=lds, AHEAD=ahead))
    check(y, x, w)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("lds,ahead", [(True, False), (False, True), (True, True)])
def test_gemv_alternatives_compute_the_same(bits, lds, ahead):
    """The GEMV with its table lookups through shared memory (``LDS``) and/or its codes loaded a K step
    ahead (``AHEAD``; both off by default until timed on a GPU) computes what the plain one does: the
    reference up to summation order, bit for bit the same output, at 1 and 3 rows of x, coded scales,
    split-K (K = 1000: 8 steps of 16 blocks, the last ragged; splits of 2 steps and of 1)."""
    w = make_weight(bits, k=1000, group=16, coded=True, seed=bits)
    st = TritonCodebookKernel.prepare(w)
    for m, split in ((1, 1), (3, 4), (1, 8)):
        x = activations(m, torch.bfloat16, k=1000)
        plain = TritonCodebookKernel.apply(st, x, kernel="gemv", config=dict(SPLIT=split, BKB=16))
        y = TritonCodebookKernel.apply(st, x, kernel="gemv", config=dict(SPLIT=split, BKB=16, LDS=lds, AHEAD=ahead))
        check(y, x, w, route="gemv")
        assert torch.equal(y, plain)


# ----------------------------------------------------------------------------- selection

def test_can_implement(monkeypatch):
    w = make_weight()
    cpu = torch.device("cpu")
    monkeypatch.delenv(tk.ENV_INTERPRET_OK, raising=False)
    ok, why = TritonCodebookKernel.can_implement(w, cpu, torch.bfloat16)
    assert not ok and "CUDA" in why
    monkeypatch.setenv(tk.ENV_INTERPRET_OK, "1")
    assert TritonCodebookKernel.can_implement(w, cpu, torch.bfloat16) == (True, None)
    ok, why = TritonCodebookKernel.can_implement(make_weight(group=24, k=192), cpu, torch.bfloat16)
    assert not ok and "group size 24" in why
    ok, why = TritonCodebookKernel.can_implement(CodebookWeight(w.codes, w.scales, 5, 16, K), cpu, torch.bfloat16)
    assert not ok and "5-bit codes" in why
    assert not TritonCodebookKernel.can_implement(w, cpu, torch.int8)[0]


def test_family_member_and_forced_selection(monkeypatch, interpret_ok):
    from vllm_latq.kernels import selector
    assert selector.family_member("triton", CodebookWeight) is TritonCodebookKernel
    monkeypatch.setenv(selector.ENV_FORCE, "triton")
    assert selector.select(make_weight(), torch.device("cpu"), torch.bfloat16) is TritonCodebookKernel


def test_rotated_layer_through_the_selector(monkeypatch, interpret_ok):
    """The wrapper rotates x (torch's transform here: the C++ one is the CPU family's to test) and the
    kernel multiplies the rotated activations, rounded to x's dtype as the reference feeds them."""
    from dataclasses import replace
    from vllm_latq import native
    from vllm_latq.format.rotation import rotate
    from vllm_latq.kernels import selector
    monkeypatch.setenv(selector.ENV_FORCE, "triton")
    g = torch.Generator().manual_seed(3)
    w = replace(make_weight(3, k=256, group=64), rotation=torch.randint(0, 2, (256,), generator=g).float() * 2 - 1)
    kern = selector.select(w, torch.device("cpu"), torch.bfloat16)
    assert kern.name == "triton-e8+hadamard" and kern.inner is TritonCodebookKernel
    st = kern.prepare(w)
    for m in (1, 12):
        x = activations(m, torch.bfloat16, k=256)
        with native.disabled():
            y = kern.apply(st, x)
        check(y, rotate(x, w.rotation), replace(w, rotation=None))


def test_served_report_counts_codebook_layers_by_this_kernel():
    from vllm_latq.kernels import selector
    from vllm_latq.kernels.served_report import layer_served
    w = make_weight(3, group=64)
    fams = [k for k in selector.families() if k.name == "triton"]
    row = layer_served({"codes": w.codes, "scales": w.scales}, "codebook", (N, K), 3, 64, fams)["triton"]
    assert row["kernel"] == "triton-e8"
    assert row["bytes"] == sum(TritonCodebookKernel.codebook_bytes(N, K, 3, 64).values())


def test_served_report_names_the_refusal_of_a_group_the_format_allows():
    """Group 24 (any multiple of 8 is a valid codebook group): triton-e8 takes groups of 16s, so the
    report serves the layer by the bf16 fallback and says why instead of raising."""
    from vllm_latq.kernels import selector
    from vllm_latq.kernels.served_report import layer_served
    w = make_weight(3, group=24)
    fams = [k for k in selector.families() if k.name == "triton"]
    row = layer_served({"codes": w.codes, "scales": w.scales}, "codebook", (N, K), 3, 24, fams)["triton"]
    assert row["kernel"] == "bf16"
    assert row["why"] == "not served by triton-e8: group size 24 is not a multiple of 16"
