"""latq Triton kernels: layer time vs torch bf16 matmul on a GPU; static report everywhere.

On a CUDA GPU (unless --static-only): for the Qwen3-8B linear shapes (qkv 6144×4096,
o 4096×4096, gate_up 24576×4096, down 4096×12288), M ∈ {1, 8}, inliers 2/3/4-bit and
outlier rates 0–5 % (the paper's Figure 5 setup; its claim: up to 4× at M = 1 below 1 %
outliers), the time of ``TritonKernel.apply`` (autotuned) / the time of ``x @ W.T`` with a
bf16 ``W``, both measured in this run (CUDA events, median of --repeats).

Everywhere (and only, without a GPU or with --static-only):
  1. the static report: every kernel config compiled offline for sm_80/86/89/90 (real
     ptxas; :mod:`vllm_latq.kernels.triton_compile`, cached): registers, spill bytes,
     shared memory vs the target's limit, SASS instruction counts by class;
  2. the bytes-moved model: bytes per weight of each format (inliers, fp16 scales, outliers
     in the layout the model picks for that rate: ELL-16 with its real padding for randomly
     placed outliers, or CSR; compact int16 + fp16 entries as for an SSQR checkpoint) and
     per layer with activations in/out, vs bf16 → the
     memory-bound speedup ceiling (a GEMV at M = 1 moves the weights once: time ∝ bytes).
Ends with ``HEADLINE … spills=<total over all kernel configs and targets>``.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vllm_latq.kernels import triton_layout as tlay  # noqa: E402

QWEN3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
RATES = (0.0, 0.005, 0.01, 0.02, 0.05)
BITS = (2, 3, 4)
GROUP = 128


# ----------------------------------------------------------------------------- bytes model

def outlier_counts(n: int, k: int, rate: float, seed: int = 0) -> torch.Tensor:
    """Per-row outlier counts of an n×k layer with outliers placed uniformly at ``rate``."""
    if rate == 0:
        return torch.zeros(n, dtype=torch.int64)
    g = torch.Generator().manual_seed(seed)
    return torch.binomial(torch.full((n,), float(k)), torch.full((n,), rate), generator=g).long()


def layer_bytes(n: int, k: int, bits: int, rate: float, m: int = 1) -> dict:
    """Bytes one call moves: weights in the Triton layout (+ activations in, output out)."""
    counts = outlier_counts(n, k, rate)
    crow = torch.zeros(n + 1, dtype=torch.int64)
    crow[1:] = torch.cumsum(counts, 0)
    n_pad = math.ceil(n / 16) * 16
    k_pad = math.ceil(k / tlay.step_of(bits)) * tlay.step_of(bits)
    inl = n_pad * k_pad * bits / 8
    sc = n_pad * math.ceil(k_pad / GROUP) * 2
    nnz = int(crow[-1])
    eb = 4 if k <= 32768 else 6                # compact entries: int16/int32 column + fp16 value (SSQR)
    if nnz:
        mod = tlay.outlier_model(crow, n_pad, m=m, entry_bytes=eb)
        out = (eb * mod["slots"] + 4 * (n_pad // 16 + 1)) if mod["mode"] == "ell" else (4 + eb) * nnz + 4 * (n_pad + 1)
        mode, pad = mod["mode"], mod["padding"]
    else:
        out, mode, pad = 0, "none", 1.0
    act = 2 * m * (k + n)
    w = inl + sc + out
    return dict(weights=w, total=w + act, per_weight=w / (n * k), mode=mode, padding=pad,
                bf16_total=2 * n * k + act)


def bytes_model(m: int = 1) -> tuple[list[str], dict]:
    lines = [f"bytes-moved model, M={m} (weights in the Triton layout + bf16 activations in/out), "
             f"group {GROUP}; ceiling = bf16 bytes / latq bytes (memory-bound)",
             f"{'bits':>4} {'rate':>6} {'B/weight':>8} {'outl':>5} {'pad':>5} " +
             " ".join(f"{name:>8}" for name in QWEN3_8B) + f" {'all':>8}"]
    ceil = {}
    for bits in BITS:
        for rate in RATES:
            tot, tot16, row = 0.0, 0.0, []
            pw, mode, pad = [], "", 1.0
            for name, (n, k) in QWEN3_8B.items():
                b = layer_bytes(n, k, bits, rate, m)
                row.append(b["bf16_total"] / b["total"])
                tot += b["total"]
                tot16 += b["bf16_total"]
                pw.append(b["per_weight"])
                mode, pad = b["mode"], b["padding"]
            ceil[bits, rate] = tot16 / tot
            lines.append(f"{bits:>4} {rate * 100:>5.1f}% {statistics.mean(pw):>8.4f} {mode:>5} {pad:>5.2f} " +
                         " ".join(f"{r:>7.2f}x" for r in row) + f" {tot16 / tot:>7.2f}x")
    lines.append(f"bf16: 2.0000 B/weight. Per-weight bytes: b/8 + 2/{GROUP} (fp16 scales) + outliers "
                 f"(ELL-16: 4 B per padded slot, int16 column + fp16 value; CSR: 8 B per entry); "
                 f"'pad' = ELL slots / outliers of the last layer (16 rows × K columns, random placement).")
    return lines, ceil


# ----------------------------------------------------------------------------- static report

def static_report(quick: bool = False) -> tuple[list[str], dict]:
    from vllm_latq.kernels import triton_compile as tc
    jobs = tc.all_jobs(quick=quick)
    rows = tc.summarize(jobs, tc.run(jobs))
    lines = ["static report: every kernel config compiled offline (triton.compile → ptxas; "
             "nvdisasm SASS counts); spill = spill store + load bytes", tc.report(rows)]
    agg = defaultdict(lambda: dict(n=0, regs=0, spill=0, smem=0, limit=0, err=0))
    for r in rows:
        a = agg[r["kernel"], r["cc"]]
        a["n"] += 1
        if "error" in r:
            a["err"] += 1
            continue
        a["regs"] = max(a["regs"], r["regs"] or 0)
        a["spill"] += (r["spill_stores"] or 0) + (r["spill_loads"] or 0)
        a["smem"] = max(a["smem"], r["smem"])
        a["limit"] = r["smem_limit"]
    lines.append("summary per kernel and target: configs, max registers, spill bytes, max smem / limit, errors")
    for (kern, cc), a in sorted(agg.items()):
        lines.append(f"  {kern:5} sm_{cc}: {a['n']:4} configs  max regs {a['regs']:3}  spills {a['spill']:5} B  "
                     f"smem {a['smem']:6} / {a['limit']} B  errors {a['err']}")
    # ALU-issue model of the M = 1 GEMV K loop vs its memory roofline (A100 numbers)
    issue = 108 * 4 * 32 * 1.41e9          # lane-instructions/s: 4 schedulers × 32 lanes per SM
    lines.append("M=1 GEMV K loop (sm_80, median over configs): SASS instructions per weight → "
                 "ALU-issue ceiling vs HBM ceiling (1.555 TB/s, weights at b/8 + 2/128 B)")
    for bits in (2, 3, 4):
        ipw = sorted(r["ipw"] for r in rows if "error" not in r and r["kernel"] == "gemv" and r["BM"] == 1
                     and r["bits"] == bits and r["cc"] == 80)
        if ipw:
            med = ipw[len(ipw) // 2]
            alu, mem = issue / med, 1.555e12 / (bits / 8 + 2 / 128)
            lines.append(f"  {bits}-bit: {med:.2f} instr/weight → {alu / 1e12:.1f} T weights/s (ALU) vs "
                         f"{mem / 1e12:.1f} T weights/s (memory): {'memory' if mem < alu else 'ALU'}-bound")
    totals = dict(configs=len(rows), spills=sum(a["spill"] for a in agg.values()),
                  errors=sum(a["err"] for a in agg.values()), max_regs=max(a["regs"] for a in agg.values()),
                  smem_over=sum(1 for r in rows if "error" not in r and r["smem"] > r["smem_limit"]))
    return lines, totals


# ----------------------------------------------------------------------------- GPU timing

def random_weight(n, k, bits, rate, device, seed=0):
    from vllm_latq import format as fmt
    from vllm_latq.kernels.reference import LatqWeight
    g = torch.Generator().manual_seed(seed)
    z = torch.randint(-(2 ** (bits - 1)), 2 ** (bits - 1), (n, k), generator=g, dtype=torch.int32)
    counts = outlier_counts(n, k, rate, seed)
    crow = torch.zeros(n + 1, dtype=torch.int32)
    crow[1:] = torch.cumsum(counts, 0)
    cols = torch.cat([torch.randperm(k, generator=g)[:c].sort().values for c in counts.tolist()]) \
        if rate else torch.zeros(0, dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(n), counts)
    z[rows, cols] = 0
    scales = (torch.rand(n, math.ceil(k / GROUP), generator=g) * 0.01 + 1e-3).half()
    val = torch.randn(cols.numel(), generator=g) * 0.05
    w = LatqWeight(fmt.pack(z, bits), scales, crow, cols.int(), val, bits, GROUP, k)
    return LatqWeight(*(t.to(device) for t in (w.qweight, w.scales, w.crow, w.col, w.val)), bits, GROUP, k)


def cuda_time(fn, repeats):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(10):
            fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / 10 * 1e3)
    return statistics.median(ts)   # µs


def gpu_bench(repeats: int, ms=(1, 8)) -> tuple[list[str], dict]:
    from vllm_latq.kernels.reference import latq_linear_ref
    from vllm_latq.kernels.triton_kernels import TritonKernel
    dev = torch.device("cuda")
    lines = [f"GPU {torch.cuda.get_device_name(dev)}: latq Triton time / torch bf16 matmul (µs), "
             f"speedup = bf16 / latq"]
    best = {}
    for name, (n, k) in QWEN3_8B.items():
        Wb = (torch.randn(n, k, device=dev) * 0.02).bfloat16()
        for m in ms:
            x = torch.randn(m, k, device=dev).bfloat16()
            t16 = cuda_time(lambda: x @ Wb.T, repeats)
            for bits in BITS:
                for rate in RATES:
                    w = random_weight(n, k, bits, rate, dev)
                    st = TritonKernel.prepare(w)
                    y = TritonKernel.apply(st, x)
                    ref = latq_linear_ref(x, w)
                    err = ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                    t = cuda_time(lambda: TritonKernel.apply(st, x), repeats)
                    sp = t16 / t
                    best[name, m, bits, rate] = sp
                    lines.append(f"{name:8} M={m} {bits}-bit {rate * 100:4.1f}%: latq {t:8.1f}  bf16 {t16:8.1f}  "
                                 f"speedup {sp:5.2f}x  max rel err {err:.1e}")
            del x
    return lines, best


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--static-only", action="store_true", help="no GPU timing even if a GPU is present")
    ap.add_argument("--quick", action="store_true", help="static report of the heaviest configs only")
    ap.add_argument("--repeats", type=int, default=20)
    a = ap.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)

    lines, totals = static_report(a.quick)
    print("\n".join(lines))
    print()
    ceilings = {}
    for m in (1, 8):
        bl, ceil = bytes_model(m)
        ceilings[m] = ceil
        print("\n".join(bl))
        print()
    measured = False
    if torch.cuda.is_available() and not a.static_only:
        gl, best = gpu_bench(a.repeats)
        print("\n".join(gl))
        m1 = {b: max(v for (nm, m, bb, r), v in best.items() if m == 1 and bb == b and r <= 0.01) for b in BITS}
        measured = True
    else:
        print("no GPU timing (" + ("--static-only" if a.static_only else "no CUDA device") + ")")
    c = ceilings[1]
    head = dict(configs=totals["configs"], targets="sm_80,sm_86,sm_89,sm_90", errors=totals["errors"],
                max_regs=totals["max_regs"], smem_over_limit=totals["smem_over"])
    head.update({f"ceiling_m1_{b}bit_1pct": f"{c[b, 0.01]:.2f}" for b in BITS})   # bytes model vs bf16
    if measured:
        head.update({f"measured_m1_{b}bit": f"{m1[b]:.2f}" for b in BITS})
    head["spills"] = totals["spills"]
    print("HEADLINE " + " ".join(f"{k}={v}" for k, v in head.items()))


if __name__ == "__main__":
    main()
