"""Large-M path: dequantise once into a scratch + one GEMM, in Triton's interpreter.

* The dequantised scratch equals ``weight.dequantize(w).to(dtype)`` bit for bit: bits
  {2, 3, 4, 5} × outlier rates {0, 1 %, 5 %} × fp16/bf16 on N = 40, K = 300 (rows padded to
  16, K to the step, a ragged last group); group sizes 32/64/128/one per tensor; ELL and
  CSR; 3 and 5 bits on K = 576/640/896/1280 (whole 512-column chunks + the 4-bit tail).
* ``apply_large_m`` equals ``x @ W_dtypeᵀ (+ bias)`` computed in fp32, to the output's
  rounding, for M ∈ {17, 64}; it differs from the fp32 reference only through the one
  rounding of z·s (checked to be that and nothing more).
* The workspace: one buffer per (device, dtype), grown to the largest layer, reused; under
  a byte cap, row chunks give the same scratch rows and outputs. ``use_large_m`` (the
  choice ``TritonKernel.apply`` makes) follows the layer's threshold and refuses fp32.
* Offline compilation of the two kernels for sm_80/sm_90 (real ptxas): no spills, and the
  scratch written in 16-byte vectors along K.
The crossover model is tests/kernels/test_triton_model.py.
"""

import pytest
import torch

from tests.helpers import CROWDED
from vllm_latq.kernels.weight import LatqWeight, dequantize
from vllm_latq.kernels.reference import latq_linear_ref
from vllm_latq.testing.weights import random_weight

triton = pytest.importorskip("triton")
from vllm_latq.kernels.triton import dequant as td  # noqa: E402
from vllm_latq.kernels.triton import kernel as tk  # noqa: E402
from vllm_latq.kernels.triton.kernel import TritonKernel  # noqa: E402

interp = pytest.mark.skipif(not tk.INTERPRET, reason="kernel tests run in Triton's interpreter")

N, K = 40, 300


def make_weight(n=N, k=K, bits=4, group=128, rate=0.01, seed=0, scale_bits=None) -> LatqWeight:
    """test_triton's weights, plus one outlier at column 0 (ELL padding slots also point at
    column 0); ``scale_bits``: the scales coded."""
    return random_weight(n, k, bits, rate, group=group, seed=seed, scale_lo=0.002, scale_span=0.02, val_std=0.2,
                         fp16_values=True, rows=CROWDED if rate > 0 else (), cells=((7, 0),) if rate > 0 else (),
                         scale_bits=scale_bits)


def activations(m, dtype, k=K, seed=1):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


def dequantized(st, dtype):
    out = torch.full((st.n, st.k), float("nan"), dtype=dtype)        # every element must be written
    return td.dequantize_into(st, out)


# ----------------------------------------------------------------------------- exactness (interpreter)

@interp
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rate", [0.0, 0.01, 0.05])
@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_dequantize_is_exact(bits, rate, dtype):
    w = make_weight(bits=bits, rate=rate, seed=bits)
    st = TritonKernel.prepare(w)
    assert torch.equal(dequantized(st, dtype), dequantize(w).to(dtype))


@interp
@pytest.mark.parametrize("group", [64, 128])
@pytest.mark.parametrize("k", [576, 640, 896, 1280])
@pytest.mark.parametrize("bits", [3, 5])
def test_dequantize_k_tails(bits, k, group):
    """K not a multiple of 512: 3 bits as whole 512-column chunks (one launch) and the 4-bit
    tail (a second launch from column 512·⌊K_pad/512⌋); 5 bits' last 1-bit chunk part padding."""
    w = make_weight(k=k, bits=bits, group=group, rate=0.02, seed=k)
    st = TritonKernel.prepare(w)
    assert torch.equal(dequantized(st, torch.bfloat16), dequantize(w).to(torch.bfloat16))


@interp
@pytest.mark.parametrize("mode", ["ell", "csr"])
@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_dequantize_both_outlier_layouts(bits, mode):
    w = make_weight(bits=bits, rate=0.05, seed=10 + bits)
    st = TritonKernel.prepare(w, outlier_mode=mode)
    assert st.outl == tk.OUTL_CODE[mode]
    assert torch.equal(dequantized(st, torch.bfloat16), dequantize(w).to(torch.bfloat16))


@interp
@pytest.mark.parametrize("group", [32, 64, 300])
@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_dequantize_group_sizes(bits, group):
    """32/64: several groups per K step; 300 = K: one group per row (transcoded form)."""
    w = make_weight(bits=bits, group=group, rate=0.01, seed=20 + bits)
    st = TritonKernel.prepare(w)
    assert torch.equal(dequantized(st, torch.float16), dequantize(w).to(torch.float16))


@interp
@pytest.mark.parametrize("rate", [0.0, 0.02])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_dequantize_coded_scales_is_exact(bits, rate):
    """Coded scales (group 64, 3 bits: K = 640, main chunk and tail) decode to the format's fp16
    scales: z·s rounded to fp16 equals the reference's, bit for bit."""
    w = make_weight(k=640, bits=bits, group=64, rate=rate, seed=40 + bits, scale_bits=4)
    st = TritonKernel.prepare(w)
    assert st.coded_scales
    assert torch.equal(dequantized(st, torch.float16), dequantize(w).to(torch.float16))


@interp
def test_dequantize_fp32_outlier_values_and_strided_out():
    """Non-fp16-exact outlier values (stored fp32) are rounded once; ``out`` may be a row
    slice of a wider matrix (row stride ≠ K)."""
    w = make_weight(bits=3, rate=0.05, seed=5)
    w.val = w.val + 1e-4 * torch.rand(w.val.shape, generator=torch.Generator().manual_seed(1))
    st = TritonKernel.prepare(w, outlier_mode="csr")
    assert st.outl_val.dtype == torch.float32
    wide = torch.zeros(N, K + 20, dtype=torch.bfloat16)
    td.dequantize_into(st, wide[:, :K])
    assert torch.equal(wide[:, :K], dequantize(w).to(torch.bfloat16)) and not wide[:, K:].any()
    with pytest.raises(ValueError):
        td.dequantize_into(st, torch.zeros(N, K, dtype=torch.float32))


@interp
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [17, 64])
@pytest.mark.parametrize("bits,scale_bits", [(2, None), (3, None), (4, None), (5, None), (3, 4), (4, 4)])
def test_apply_large_m(bits, scale_bits, m, dtype):
    w = make_weight(bits=bits, rate=0.01, seed=30 + bits, scale_bits=scale_bits)
    st = TritonKernel.prepare(w)
    x = activations(m, dtype, seed=m)
    W = dequantize(w).to(dtype).float()
    eps = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}[dtype]
    ws = td.Workspace()
    for bias in (None, torch.randn(N, generator=torch.Generator().manual_seed(5)).to(dtype)):
        y = td.apply_large_m(st, x, bias, ws)
        assert y.dtype == dtype and y.shape == (m, N)
        ref = x.float() @ W.T + (0 if bias is None else bias.float())
        # the output is rounded to dtype after an fp32 sum in another order
        torch.testing.assert_close(y.float(), ref, rtol=eps, atol=ref.abs().max().item() * 2e-6 + 1e-6)
        # vs the fp32 reference: only the rounding of z·s to dtype (≤ ½ ulp per weight) more
        ref32 = latq_linear_ref(x.float(), w, None if bias is None else bias.float())
        bound = (x.float().abs() @ (W - dequantize(w)).abs().T).max().item()
        assert (y.float() - ref32).abs().max().item() <= bound + eps * ref32.abs().max().item()
    if dtype == torch.bfloat16:                  # the rounding is real (fp16 holds 2-bit z·s exactly)
        assert not torch.equal(W, dequantize(w))


@interp
def test_workspace_is_shared_and_grows():
    ws = td.Workspace()
    small = TritonKernel.prepare(make_weight(n=24, k=100, bits=4, rate=0.0))
    big = TritonKernel.prepare(make_weight(bits=2, rate=0.05, seed=2))
    x = activations(20, torch.bfloat16)
    td.apply_large_m(big, x, None, ws)
    buf = ws.current(torch.bfloat16, "cpu")
    td.apply_large_m(small, activations(20, torch.bfloat16, k=100), None, ws)      # reuses the big buffer
    assert ws.current(torch.bfloat16, "cpu") is buf and ws.nbytes() == N * K * 2
    td.apply_large_m(big, x.half(), None, ws)                                       # one more per dtype
    assert len(ws._bufs) == 2
    ws.reserve(64, 400, torch.bfloat16, torch.device("cpu"))                        # grows on demand
    assert ws.current(torch.bfloat16, "cpu").numel() == 64 * 400
    y = td.apply_large_m(big, x, None, ws)
    torch.testing.assert_close(y, td.apply_large_m(big, x))                         # temporary scratch


@interp
def test_row_chunks():
    """A capped workspace: row chunks (multiples of 16) dequantised from row0 and one GEMM
    each — the same scratch rows, the same outputs as one GEMM."""
    w = make_weight(n=72, bits=3, rate=0.05, seed=4)
    for mode in ("ell", "csr"):
        st = TritonKernel.prepare(w, outlier_mode=mode)
        ref = dequantize(w).to(torch.bfloat16)
        assert torch.equal(td.dequantize_into(st, torch.empty(24, K, dtype=torch.bfloat16), 48), ref[48:])
        ws = td.Workspace(max_bytes=40 * K * 2)
        assert ws.rows(72, K, torch.bfloat16) == 32 and td.Workspace(max_bytes=1).rows(72, K, torch.float16) == 16
        x = activations(20, torch.bfloat16)
        bias = torch.randn(72).to(torch.bfloat16)
        y = td.apply_large_m(st, x, bias, ws)
        assert ws.nbytes() == 32 * K * 2
        torch.testing.assert_close(y, td.apply_large_m(st, x, bias), rtol=0, atol=0)
    with pytest.raises(ValueError):
        td.dequantize_into(st, torch.empty(16, K, dtype=torch.bfloat16), 8)          # row0 % 16


def test_reasons_and_choice():
    w = make_weight(rate=0.0)
    st = TritonKernel.prepare(w)
    why = td.large_m_reason(torch.float32)
    assert why and "SIMT" in why
    assert td.large_m_reason(torch.bfloat16) is None and td.large_m_reason(torch.float16) is None
    with pytest.raises(ValueError, match="SIMT"):
        td.apply_large_m(st, activations(20, torch.float32))
    # TritonKernel.apply's choice: above MMA_MAX_M rows of fp16/bf16 activations
    m = td.MMA_MAX_M
    assert not td.use_large_m(torch.empty(m, 1024, dtype=torch.bfloat16))
    assert td.use_large_m(torch.empty(m + 1, 1024, dtype=torch.float16))
    assert not td.use_large_m(torch.empty(m + 1, 1024, dtype=torch.float32))



@interp
def test_kernel_apply_routes_large_m(monkeypatch):
    """TritonKernel.apply takes the dequantize-once path above ``MMA_MAX_M`` rows (the MMA kernel
    at and below it), and reserve() sizes the shared scratch at load."""
    w = make_weight(rate=0.01)
    st = TritonKernel.prepare(w)
    calls = []
    real = td.apply_large_m
    monkeypatch.setattr(tk, "apply_large_m", lambda *a: calls.append(1) or real(*a))
    TritonKernel.reserve(st, torch.bfloat16)
    x = activations(td.MMA_MAX_M + 1, torch.bfloat16)
    y = TritonKernel.apply(st, x)
    assert calls == [1]
    assert torch.equal(y, real(st, x, None, TritonKernel.workspace))
    TritonKernel.apply(st, activations(td.MMA_MAX_M, torch.bfloat16))
    assert calls == [1]

# ----------------------------------------------------------------------------- offline compilation

def _stores(quick):
    """The large-M kernels through the offline compile report (real ptxas and nvdisasm for
    every target; spills and shared memory are checked by tests/kernels/test_triton.py's report tests)."""
    from tools import triton_compile as tc
    jobs = [j for j in tc.all_jobs(quick=quick) if j["kernel"] in ("dequant", "outliers")]
    rows = tc.summarize(jobs, tc.run(jobs))
    assert {r["cc"] for r in rows} == set(tc.TARGETS) and not [r for r in rows if "error" in r]
    assert {r["kernel"] for r in rows} == {"dequant", "outliers"}
    bad = [r for r in rows if r["spill_stores"] or r["spill_loads"] or r["stack"] or r["regs"] > 255]
    assert not bad, tc.report(bad)
    # the scratch is written in 16-byte vectors along K only (coalesced: W's fastest dim)
    narrow = [r for r in rows if r["kernel"] == "dequant" and r["stores"] != ["STG.E.128"]]
    assert not narrow, tc.report(narrow)


def test_offline_compile_no_spills():
    """The heaviest dequant variants (3 and 5 bits, bf16: two or three word planes and the
    integer RNE) and both outlier layouts, for sm_80/86/89/90: no spills, no stack frame, and
    the dequantised tile stored as 16-byte vectors along K (STG.E.128 only)."""
    _stores(quick=True)


@pytest.mark.slow
def test_offline_compile_every_variant():
    """Dequant at 2/3/4/5 bits × bf16/fp16 and both outlier layouts, sm_80/86/89/90."""
    _stores(quick=False)
