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
The crossover model is tests/test_triton_model.py.
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
from vllm_latq.kernels.triton import cost_model as tm  # noqa: E402
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
    # TritonKernel.apply's choice (CPU: the A100 model): this 3-bit layer switches at M = 129
    big = TritonKernel.prepare(make_weight(n=1024, k=1024, bits=3, rate=0.0))
    th = td.threshold_for(big, torch.bfloat16, torch.device("cpu"))
    assert th == tm.large_m_threshold(1024, 1024, 3, 0, torch.bfloat16, None, 128) == 129
    assert not td.use_large_m(big, torch.empty(th - 1, 1024, dtype=torch.bfloat16))
    assert td.use_large_m(big, torch.empty(th, 1024, dtype=torch.bfloat16))
    assert not td.use_large_m(big, torch.empty(th, 1024, dtype=torch.float32))



@interp
def test_kernel_apply_routes_large_m(monkeypatch):
    """TritonKernel.apply takes the dequantize-once path exactly from the layer's threshold on
    (the MMA kernel below it), and reserve() sizes the shared scratch at load."""
    w = make_weight(rate=0.01)
    st = TritonKernel.prepare(w)
    calls = []
    real = td.apply_large_m
    monkeypatch.setattr(tk, "apply_large_m", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(tk, "use_large_m", lambda st_, x2: x2.shape[0] >= 17)
    TritonKernel.reserve(st, torch.bfloat16)
    x = activations(17, torch.bfloat16)
    y = TritonKernel.apply(st, x)
    assert calls == [1]
    assert torch.equal(y, real(st, x, None, TritonKernel.workspace))
    TritonKernel.apply(st, activations(16, torch.bfloat16))
    assert calls == [1]

# ----------------------------------------------------------------------------- offline compilation

# Runs in a subprocess without TRITON_INTERPRET (the interpreter cannot compile): real
# ptxas for each (kernel variant, target); prints one JSON row per job.
_COMPILE = r"""
import contextlib, io, json, os, re, subprocess, sys, tempfile
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="latq_deq_")   # a cache hit would skip ptxas
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tools import triton_compile as tc
from vllm_latq.kernels.triton import dequant as td
knobs.nvidia.dump_ptxas_log = True
div16 = [["tt.divisibility", 16]]
quick = sys.argv[1] == "quick"
jobs = []
for dt in (("bf16",) if quick else ("bf16", "fp16")):
    for bits in ((3, 5) if quick else (2, 3, 4, 5)):
        for scales in tc.SCALES:
            sig = dict(w_ptr="*" + dt, pa_ptr="*i32", ph_ptr="*i32", s_ptr=tc.S_PTR[scales], ROW0="i32", ROW1="i32",
                       K="i32", K0="i32", stride_wn="i32",
                       N_PAD="i32", NCH_A="i32", NCH_H="i32", NGP="i32")
            const = dict(BITS=bits, GROUP=128, BN=td.DEQUANT_CONFIG["BN"], DS=td.DEQUANT_CONFIG["DS"],
                         CODED=scales == "coded")
            jobs.append((f"dequant {dt} {bits}-bit {scales}", td._dequant_kernel, sig, const,
                         td.DEQUANT_CONFIG["num_warps"]))
for outl, o in ((1, ["*i32", "*fp16", "*i16", "*fp16"]), (2, ["*i32", "*i32", "*i16", "*fp16"])):
    sig = dict(w_ptr="*bf16", start_ptr=o[0], row_ptr=o[1], col_ptr=o[2], val_ptr=o[3], ROW0="i32", ROW1="i32",
               stride_wn="i32")
    jobs.append((f"outliers {'ell' if outl == 1 else 'csr'}", td._outlier_kernel, sig,
                 dict(OUTL=outl, BE=td.OUTLIER_CONFIG["BE"]), td.OUTLIER_CONFIG["num_warps"]))
for cc in map(int, sys.argv[2:]):
    for name, fn, sig, const, nw in jobs:
        names = fn.arg_names
        # K0 (0, or the first tail column: a multiple of 512) is 16-divisible in production too
        attrs = {(names.index(n),): div16 for n, t in sig.items() if t.startswith("*") or n in ("K", "K0", "stride_wn", "N_PAD")}
        src = ASTSource(fn, {**sig, **{c: "constexpr" for c in const}}, const, attrs)
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            c = triton.compile(src, target=GPUTarget("cuda", cc, 32), options=dict(num_warps=nw, num_stages=1))
        log = buf.getvalue()
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
            f.write(c.asm["cubin"])
        sass = subprocess.run([tc._bin("nvdisasm"), "-c", f.name], capture_output=True, text=True, check=True).stdout
        os.unlink(f.name)
        stores = sorted(set(re.findall(r"\b(STG\.[A-Z0-9.]+)", sass)))
        regs = re.search(r"Used (\d+) registers", log)
        sp = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
        st = re.search(r"(\d+) bytes stack frame", log)
        print(json.dumps(dict(name=name, cc=cc, regs=int(regs.group(1)), spill=int(sp.group(1)) + int(sp.group(2)),
                              stack=int(st.group(1)), stores=stores)))
"""


def _compile(quick):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    out = subprocess.run([sys.executable, "-c", _COMPILE, "quick" if quick else "all", "80", "90"], env=env,
                         cwd=root, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 2 * (2 * (2 if quick else 8) + 2) and {r["cc"] for r in rows} == {80, 90}
    bad = [r for r in rows if r["spill"] or r["stack"] or r["regs"] > 255]
    assert not bad, bad
    # the scratch is written in 16-byte vectors along K only (coalesced: W's fastest dim)
    narrow = [r for r in rows if r["name"].startswith("dequant") and r["stores"] != ["STG.E.128"]]
    assert not narrow, narrow


def test_offline_compile_no_spills():
    """The heaviest dequant variants (3 and 5 bits, bf16: two or three word planes and the
    integer RNE) and both outlier layouts, real ptxas for sm_80 and sm_90: no spills, no
    stack frame, and the dequantised tile stored as 16-byte vectors along K (STG.E.128 only)."""
    _compile(quick=True)


@pytest.mark.slow
def test_offline_compile_every_variant():
    """Dequant at 2/3/4/5 bits × bf16/fp16 and both outlier layouts, sm_80 and sm_90."""
    _compile(quick=False)
