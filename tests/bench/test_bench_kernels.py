"""bench/kernels.py and its timing harness without a GPU: the command line, the shape table, the served-bytes model,
the table / crossover / HEADLINE formatting from fake measurements, the CPU exit path, and
one layer's whole measurement pipeline in Triton's interpreter with a fake timer."""
import math

import pytest
import torch

from bench import kernel_timing as kt, kernels as bk
from tests.helpers import FakeTimer
from vllm_latq.testing.weights import random_weight

triton = pytest.importorskip("triton")
from vllm_latq.kernels.triton import kernel as tk  # noqa: E402
from vllm_latq.kernels.triton.kernel import TritonKernel  # noqa: E402
from tools import launch_table as lt  # noqa: E402

L2 = 50 << 20


# ----------------------------------------------------------------------------- command line

def test_shape_table_and_parsing():
    assert bk.parse_shapes("8b") == [("8b.down", 4096, 14336), ("8b.gate_up", 28672, 4096),
                                     ("8b.qkv", 6144, 4096), ("8b.o", 4096, 4096)]
    assert bk.parse_shapes("8b.down, 4096x14336,8b.down,512X128") == [
        ("8b.down", 4096, 14336), ("4096x14336", 4096, 14336), ("512x128", 512, 128)]
    assert [s[0] for s in bk.parse_shapes("qwen3-8b")] == ["qwen3-8b.down", "qwen3-8b.gate_up", "qwen3-8b.qkv",
                                                             "qwen3-8b.o"]
    with pytest.raises(ValueError, match="unknown shape '8b.mlp'.*8b.gate_up"):
        bk.parse_shapes("8b.mlp")


def test_arguments_defaults_quick_and_overrides():
    a = bk.parse_args([])
    assert (len(a.shapes), a.bits, a.rates, a.m) == (4, [4], [0.01], [1, 2, 4, 8, 16, 32, 64, 128, 256])
    assert a.breakdown == ["gemv", "mma", "dequant"] and a.dtype == "bf16" and not a.no_static
    q = bk.parse_args(["--quick", "--no-static"])
    assert [s[0] for s in q.shapes] == ["8b.down", "8b.o"] and q.m == [1, 4, 16, 64, 256] and q.no_static
    o = bk.parse_args(["--quick", "--m", "8,1,8", "--bits", "2,3", "--rates", "0,0.05", "--breakdown", "none",
                       "--shapes", "1024x512", "--dtype", "fp16"])
    assert (o.m, o.bits, o.rates, o.breakdown, o.shapes, o.dtype) == \
        ([1, 8], [2, 3], [0.0, 0.05], [], [("1024x512", 1024, 512)], "fp16")


@pytest.mark.parametrize("argv", [["--bits", "6"], ["--rates", "0.6"], ["--m", "0"], ["--breakdown", "cpu"],
                                  ["--shapes", "70b.o"], ["--no-static", "--static-only"]])
def test_arguments_rejected(argv, capsys):
    with pytest.raises(SystemExit):
        bk.parse_args(argv)
    assert "error" in capsys.readouterr().err


# ----------------------------------------------------------------------------- served bytes

def _ell_slots(crow, n_pad):
    counts = torch.zeros(n_pad, dtype=torch.int64)
    counts[:crow.numel() - 1] = (crow[1:] - crow[:-1]).long()
    return int(counts.reshape(-1, 16).max(1).values.sum()) * 16


@pytest.mark.parametrize("bits,mode,k", [(3, "ell", 300), (4, "csr", 300), (2, None, 300), (3, None, 640),
                                         (5, "csr", 576)])
def test_weight_bytes_are_the_served_layout(bits, mode, k):
    """Inlier planes at b/8 B per padded weight (3 bits: whole 512-column chunks, then 4 bits
    per tail column; 5 bits: the 1-bit plane padded to 512 columns), fp16 scales per 16-row
    group and padded group, outliers as stored (ELL with its padding slots, or CSR with row
    indices); the split-K tickets are not weights."""
    n, rate = 40, 0.0 if mode is None else 0.05
    w = random_weight(n, k, bits, rate, seed=1)
    st = TritonKernel.prepare(w, mode)
    n_pad, k_pad = 48, math.ceil(k / 128) * 128
    if bits == 2:
        k_pad = math.ceil(k / 256) * 256
    main = k_pad // 512 * 512 if bits == 3 else k_pad
    bits_per_row = {3: 3 * main + 4 * (k_pad - main), 5: 4 * k_pad + math.ceil(k_pad / 512) * 512}.get(bits, bits * k_pad)
    expect = n_pad * bits_per_row // 8 + n_pad * math.ceil(k_pad / 128) * 2
    entry = 2 + 4                           # int16 column (K ≤ 32768) + fp32 value (randn: not fp16-exact)
    if mode == "ell":
        expect += 4 * (n_pad // 16 + 1) + entry * _ell_slots(w.crow, n_pad)
    elif mode == "csr":
        expect += 4 * (n_pad + 1) + (4 + entry) * w.nnz
    assert w.nnz > 0 or mode is None
    assert kt.weight_bytes(st) == expect
    assert kt.act_bytes(8, n, k, 2) == 8 * (k + n) * 2


def test_copies_span_several_l2_sizes():
    assert kt.copies(10_000_000, L2) == math.ceil(4 * L2 / 10_000_000) == 21
    assert kt.copies(4 * L2, L2) == 1 and kt.copies(10**12, L2) == 1
    assert kt.copies(1000, L2) == kt.MAX_COPIES


# ----------------------------------------------------------------------------- report formatting

def _pt(shape="8b.down", m=1, latq=10.0, dense=30.0, bits=4, rate=0.01, err=1e-3, n=4096, k=14336):
    return kt.Point(shape, n, k, bits, rate, m, "gemv" if m < 8 else "mma", latq, dense, 8.0, 9_000_000,
                    16384, {"gemv": latq, "dequant": 40.0}, err)


def test_point_numbers_and_row():
    p = _pt()
    assert (p.ratio, p.served_bytes, p.pct_copy) == (3.0, 9_016_384, 80.0)
    assert p.gbps == pytest.approx(901.6384) and p.bits_per_weight == pytest.approx(8 * 9e6 / (4096 * 14336))
    row = kt.format_point(p)
    assert row.split() == ["8b.down", "4096x14336", "4", "1.0%", "fp16-g128", "1", "gemv", "10.0", "30.0", "3.00x",
                           "10.0",
                           "-", "40.0", "1.23", "902", "80.0%", "1.0e-03"]
    assert len(row) == len(kt.table_header())
    bad = kt.format_point(_pt(latq=math.nan, err=math.inf))
    assert bad.split()[7] == "-" and bad.split()[9] == "-x" and bad.endswith("WRONG")


def test_crossovers_and_gpu_headline():
    pts = [_pt("8b.down", m, latq, 30.0) for m, latq in ((1, 10.0), (8, 20.0), (64, 40.0), (256, 25.0))]
    pts += [_pt("8b.o", m, 10.0, 25.0, n=4096, k=4096) for m in (1, 8, 64, 256)]      # ratio 2.5 everywhere
    pts += [_pt("8b.o", 1, 50.0, 25.0, bits=3), _pt("8b.o", 512, 50.0, 25.0)]        # not 4-bit / M > 256
    pts += [_pt("8b.o", 2, math.nan, 25.0, rate=0.0, err=math.inf)]                   # a failed kernel
    f = "fp16-g128"
    assert bk.first_losses(pts) == {("8b.down", 4, 0.01, f): 64, ("8b.o", 4, 0.01, f): 512,
                                    ("8b.o", 3, 0.01, f): 1, ("8b.o", 4, 0.0, f): 2}
    res = dict(device="NVIDIA H100 80GB HBM3", copy_gbps=2987.4, points=pts, skipped=[("8b.qkv", 4, 0.01)],
               seconds=151.2)
    lines, head = bk.gpu_summary(res)
    assert "  8b.down          4-bit  1.0% fp16-g128: slower than dense from M=64" in lines
    assert any("M=1 ≥ 2.5× dense: worst 3.00× (met); ≥ 1× at every M ≤ 256: worst 0.75× (NOT met)" in s
               for s in lines)
    # target keys: 4-bit 1 % on layers ≥ 4096×14336 weights (8b.down here, not 8b.o), M ≤ 256
    per_m = {k: head.pop(k) for k in list(head) if k.startswith("latq_vs_")}
    assert head == {"gpu": "NVIDIA_H100_80GB_HBM3", "m1_4b_1pct_ratio": "3.00", "min_4b_1pct_ratio_m_le_256": "0.75",
                    "first_loss_m_4b_1pct": 64, "m1_4b_1pct_pct_of_copy": "80.0", "m1_4b_1pct_ratio_all": "2.50",
                    "copy_gbps": "2987", "points": 11, "wrong": 1, "skipped": 1, "gpu_s": "151"}
    # per M, the worst 8b shape at 4-bit 1 %: bf16's speed-up; no peer ran, so na against the peers
    assert (per_m["latq_vs_bf16_m1"], per_m["latq_vs_bf16_m8"], per_m["latq_vs_bf16_m64"]) == ("2.50", "1.50", "0.75")
    assert per_m["latq_vs_bf16_m2"] == "na" and set(per_m[f"latq_vs_peer_m{m}"] for m in (1, 8, 64)) == {"na"}
    line = bk.headline({"spills": 0, "configs": 864, "errors": 0, "max_regs": 255, "smem_over": 0},
                       {(b, 0.01): 3.5 for b in bk.BITS}, head)
    kv = dict(t.split("=") for t in line.split()[1:])
    assert line.startswith("HEADLINE spills=0 configs=864 ") and kv["gpu"] == "NVIDIA_H100_80GB_HBM3"
    assert kv["ceiling_m1_4bit_1pct"] == "3.50" and kv["first_loss_m_4b_1pct"] == "64"
    none = bk.gpu_summary(dict(res, points=[], skipped=[]))[1]
    assert none["m1_4b_1pct_ratio"] == "na" and none["first_loss_m_4b_1pct"] == "na"
    failed = bk.gpu_summary(dict(res, points=[_pt(latq=math.nan, err=math.inf), _pt(m=8)]))[1]
    assert failed["m1_4b_1pct_ratio"] == "0.00" and failed["first_loss_m_4b_1pct"] == 1     # a failure is a loss


def test_main_without_cuda_says_so_and_exits_0(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bk.main(["--no-static"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("cost model") and any("no CUDA device" in line for line in out)
    assert out[-1] == ("HEADLINE model_min_4b_1pct_ratio_m_le_256_a100=0.45 "
                       "model_min_4b_1pct_ratio_m_le_256_h100=0.45 gpu=none")
    assert tk.INTERPRET and __import__("os").environ.get("TRITON_INTERPRET") == "1"   # env left alone


# ----------------------------------------------------------------------------- the pipeline

def test_picked_kernel_is_apply_routing(monkeypatch):
    """bench's picked_kernel names the kernel TritonKernel.apply runs (its launch or the
    large-M path), for gemv (M < 8, fp32), mma (8 ≤ M ≤ 16) and dequant."""
    st = TritonKernel.prepare(random_weight(1024, 1024, 3, 0.01))
    ran = []
    monkeypatch.setattr(tk, "launch", lambda st, x2, bias, kernel, config, scratch: ran.append(kernel) or x2)
    monkeypatch.setattr(tk, "apply_large_m", lambda st, x2, bias, ws: ran.append("dequant") or x2)
    seen = set()
    for m, dt in ((1, torch.bfloat16), (7, torch.float16), (8, torch.bfloat16), (300, torch.float32),
                  (16, torch.bfloat16), (17, torch.bfloat16), (300, torch.bfloat16)):
        x = torch.zeros(m, 1024, dtype=dt)
        ran.clear()
        TritonKernel.apply(st, x)                 # the fakes return x2: [M, K] is [M, N] here
        assert ran == [kt.picked_kernel(st, x)]
        seen.add(ran[0])
    assert seen == {"gemv", "mma", "dequant"}


def test_one_layer_in_the_interpreter(monkeypatch):
    """weights → prepare → copies → warm-up + check → per M: picked, forced, dense, copy."""
    monkeypatch.setenv(tk.ENV_INTERPRET_OK, "1")
    timer, cache, log = FakeTimer(), {}, []
    cpu = torch.device("cpu")
    pts = kt.bench_layer(("t", 32, 256), 4, 0.02, [1, 8], ["gemv", "mma"], torch.bfloat16, cpu, 1, timer, cache,
                         log.append)
    assert [(p.m, p.kernel, sorted(p.kernels_us)) for p in pts] == [(1, "gemv", ["gemv", "mma"]),
                                                                   (8, "mma", ["gemv", "mma"])]
    assert all(p.err < kt.ERR_TOL and not p.bad for p in pts)
    w = kt.bench_weight(32, 256, 4, 0.02)
    st = TritonKernel.prepare(w)
    assert st.outl_val.dtype == torch.float16 and w.nnz > 0           # compact entries, as an SSQR checkpoint's
    assert all(p.weight_bytes == kt.weight_bytes(st) and p.act_bytes == p.m * (32 + 256) * 2 for p in pts)
    # per M: picked, the other forced kernel, dense, copy — in that order
    assert (pts[0].latq_us, pts[0].kernels_us["mma"], pts[0].dense_us, pts[0].copy_us) == (1.0, 2.0, 3.0, 4.0)
    assert timer.n == 8 and set(cache) == {(32, 256, 1), (32, 256, 8)}
    again = kt.bench_layer(("t", 32, 256), 4, 0.0, [1], [], torch.bfloat16, cpu, 1, timer, cache, log.append)
    assert timer.n == 10 and again[0].dense_us == 3.0          # dense reused per shape × M
    assert "FAILED" not in "\n".join(log)


def test_a_failing_kernel_costs_its_numbers_not_the_run(monkeypatch):
    monkeypatch.setenv(tk.ENV_INTERPRET_OK, "1")
    real = tk.launch

    def launch(st, x2, bias, kernel, config=None, scratch=None):
        if kernel == "mma":
            raise RuntimeError("no mma today")
        return real(st, x2, bias, kernel, config, scratch)
    monkeypatch.setattr(tk, "launch", launch)
    log = []
    pts = kt.bench_layer(("t", 32, 256), 4, 0.0, [1, 8], ["gemv", "mma"], torch.bfloat16, torch.device("cpu"),
                         1, FakeTimer(), {}, log.append)
    assert [p.bad for p in pts] == [True, True]          # the mma check failed at both M
    assert math.isnan(pts[0].kernels_us["mma"]) and pts[0].latq_us == 1.0
    assert math.isnan(pts[1].latq_us) and math.isfinite(pts[1].kernels_us["gemv"])
    assert bk.first_losses(pts) == {("t", 4, 0.0, "fp16-g128"): 8}
    assert sum("FAILED" in s and "no mma today" in s for s in log) == 3   # M=8 picked, M=1 and 8 forced
    rows = {(t["m"], t["kernel"]): t["us"] for t in kt.timing_rows(pts, "cpu")}
    assert rows == {(1, "gemv"): 1.0, (1, "mma"): lt.WRONG, (8, "mma"): lt.WRONG, (8, "gemv"): pts[1].kernels_us["gemv"]}


def test_sweep_with_budget_and_summary(monkeypatch):
    """The GPU driver's loop on the CPU: one tiny layer measured, then the budget spent."""
    monkeypatch.setenv(tk.ENV_INTERPRET_OK, "1")
    a = bk.parse_args(["--no-static", "--shapes", "32x256", "--bits", "4", "--rates", "0,0.01", "--m", "1",
                       "--breakdown", "none", "--budget-s", "0"])
    log, timer = [], FakeTimer()
    res = kt.sweep(a, torch.device("cpu"), "Fake GPU", 1, timer, log.append, big=1 << 12)
    assert res["points"] == [] and res["skipped"] == [("32x256", 4, 0.0, "fp16-g128"), ("32x256", 4, 0.01, "fp16-g128")]
    assert res["copy_gbps"] == 2 * 4096 / 1.0 / 1e3 and timer.n == 1
    a.budget_s = 1e9
    res = kt.sweep(a, torch.device("cpu"), "Fake GPU", 1, FakeTimer(), log.append, big=1 << 12)
    assert [(p.shape, p.rate, p.m, p.kernel) for p in res["points"]] == [("32x256", 0.0, 1, "gemv"),
                                                                        ("32x256", 0.01, 1, "gemv")]
    head = bk.gpu_summary(res)[1]
    assert head["gpu"] == "Fake_GPU" and head["m1_4b_1pct_ratio"] == "na"        # 32x256: not target-class
    assert head["m1_4b_1pct_ratio_all"] != "na" and head["points"] == 2 and head["skipped"] == 0
    assert sum(s.startswith("SKIPPED") for s in log) == 2 and kt.table_header() in log


@pytest.mark.parametrize("new_api", [True, False])
def test_cuda_timer_reads_the_median_in_us(monkeypatch, new_api):
    import triton.testing
    seen = {}
    if new_api:
        def fake(fn, rep=20, grad_to_none=None, quantiles=None, return_mode="mean"):
            seen.update(rep=rep, mode=return_mode)
            fn()
            return 0.0125
    else:
        def fake(fn, rep=20, grad_to_none=None, quantiles=None):
            seen.update(rep=rep, q=quantiles)
            fn()
            return [0.0125]
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", fake)
    ran = []
    assert kt.cuda_timer(3.0)(lambda: ran.append(1)) == 12.5 and ran == [1]
    assert seen == ({"rep": 3.0, "mode": "median"} if new_api else {"rep": 3.0, "q": [0.5]})


def test_sweep_survives_a_failing_configuration(monkeypatch):
    a = bk.parse_args(["--no-static", "--shapes", "32x256,16x128", "--m", "1"])

    def bench_layer(spec, *args):
        if spec[1] == 32:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return [kt.Point(spec[0], spec[1], spec[2], 4, 0.01, 1, "gemv", 1.0, 2.0, 1.0, 100, 10, {}, 0.0)]
    monkeypatch.setattr(kt, "bench_layer", bench_layer)
    log = []
    res = kt.sweep(a, torch.device("cpu"), "Fake GPU", 1, FakeTimer(), log.append, big=1 << 12)
    assert [p.shape for p in res["points"]] == ["16x128"]
    assert res["skipped"] == [("32x256", 4, 0.01, "fp16-g128")]
    assert any(s.startswith("FAILED 32x256 4-bit 1% fp16-g128: RuntimeError: CUDA error") for s in log)


def test_sweep_times_each_group_scale_form_against_the_first(monkeypatch):
    """--scales: each layer in each form (coded scales through the kernels' decode, checked
    against the reference in the warm-up), one after the other; the summary reads each form's
    time against the first's at the same point, next to the bits/weight each streams."""
    monkeypatch.setenv(tk.ENV_INTERPRET_OK, "1")
    a = bk.parse_args(["--no-static", "--shapes", "32x256", "--bits", "4", "--rates", "0", "--m", "1",
                       "--breakdown", "none", "--scales", "fp16-g128,s4-g64"])
    assert a.scales == ["fp16-g128", "s4-g64"] and kt.scale_form("s4-g64") == (64, 4)
    log = []
    res = kt.sweep(a, torch.device("cpu"), "Fake GPU", 1, FakeTimer(), log.append, big=1 << 12)
    fp16, s4 = res["points"]
    assert (fp16.scales, s4.scales) == ("fp16-g128", "s4-g64") and not fp16.bad and not s4.bad
    assert s4.bits_per_weight < fp16.bits_per_weight + 0.05   # 6 bits per 64 weights vs 16 per 128 (+ padding)
    lines, head = bk.gpu_summary(res)
    assert head["s4_g64_vs_fp16_g128_m1"] == f"{fp16.latq_us / s4.latq_us:.3f}"
    assert any("s4-g64" in line and "b/w" in line for line in lines)
    with pytest.raises(SystemExit):
        bk.parse_args(["--scales", "int8-g64"])
