"""CPU layer speed: the latq CPU kernel vs bf16 ``F.linear`` on the same shape.

Shapes: 4096×4096, Gemma3-270M (hidden 640: q 640→1024, k/v 640→256, o 1024→640,
gate/up 640→2048, down 2048→640) and SmolLM2-135M (hidden 576: q 576→576, k/v 576→192,
o 576→576, gate/up 576→1536, down 1536→576); 4-bit and 3-bit inliers (group 128), outlier
rates 0/1/2% (uniform positions, fp32 values), M = 1 and 8 tokens, bf16 activations.

Timing: both candidates run side by side in one process, interleaved (bf16, latq, bf16, …),
each sample the mean of enough back-to-back calls to last ≥ --sample-us; the reported
speedup is the median over rounds of the per-round ratio bf16/latq, so load from other
processes, which drifts between rounds, hits both sides of each ratio alike.
torch.set_num_threads(2). Sections:
  table     every shape × bits × rate × M (speedup, and both medians in µs)
  profile   M=1, 4096×4096 and two small shapes: the int4 op alone, the CSR mv alone, the
            whole kernel (where the time goes)
  large     4096×4096 4-bit 1%: int4 op vs the C++ GEMV vs per-call chunked dequant + bf16
            GEMM vs the opt-in cached bf16 weight vs bf16 F.linear, M = 8..512 (where the
            GEMV's row limit and LARGE_M should sit)
  wide      > 4-bit HPTQ-style transcodes (4096×4096, M=1): two int4 planes vs off-grid
            weights moved to the CSR
  gemv      torch's int4 op vs the C++ int4 GEMV (``latq_cpu::gemv``, same state), raw
            and inside ``latq_cpu::small_linear`` (without / with 1% outliers): M = 1 and 8 in
            situ, M = 1 for the rest; in situ = one pass over 30 SmolLM2 blocks
            of vLLM's fused shapes (qkv 960×576, o 576×576, gate_up 3072×576, down 576×1536,
            ~57 MB of int4 + scales: more than L3), passes interleaved; and 4096×4096 warm
            (one matrix) / cold (cycling through 8 matrices, 64 MB); gemv_s: the GEMV on the
            scales alone (no zeros: the kernel's layout where the GEMV runs); where the best
            GEMV is not AVX2, gemv_avx2 / kernel_gemv_avx2_1pct: the same forced onto AVX2
  outliers  the C++ op over those 30 blocks with 1% outliers as tiles in each value coding
            (fp32, fp16, int16 × row scale): time per pass next to the bytes each streams
  coded     the kernel over those 30 blocks, 4-bit, with coded group scales (--scale-bits 4)
            at g64/g32/g16 against fp16 scales at twice the group (the served bits they
            compete at) and at the same group: ms per pass next to the bits/weight each streams
  vllm      the default form (4-bit, g64, fp16 scales, no outliers): latq's CPU kernel vs vLLM's
            CPU kernel (CPUWNA16: vLLM's compressed-tensors scheme on a vLLM layer, where the build has its op) vs
            bf16 F.linear, M = 1 and 8: t_vllm / t_latq and the bits/weight each streams
  rotation  a rotated layer's cost (``--rotate hadamard``): the CPU kernel's op as a compiled layer
            calls it (the lean op where the layer has one; one C++ call that rotates, then its
            GEMV) plain vs rotated on one warm matrix of each input size of
            SmolLM2's and Gemma3's fused linears and 4096², with the transform alone; then in situ,
            whole passes over 30 SmolLM2 blocks (4-bit g64, no outliers: weights from DRAM, as in
            decode), the transform's share = t_rotated / t_plain − 1, next to the bits/weight
            streamed
  calls     the layer op as vLLM's compiled graph calls it, M = 1, over those 30 blocks (4-bit g64, no
            outliers), the 8-bit head and a 64x64 layer: latq_cpu::linear (the state as a list of ten
            optional tensors) vs latq_cpu::plain_linear (its two): t_list / t_plain
  e8        the codebook form (method e8, coded scales per 16 columns): cpu-e8 at 2/3/4 bits vs
            the integer kernel at 3/4 bits (g64) vs bf16 F.linear, SmolLM2's and Llama-3-8B's shapes
            (--e8-shapes), M = 1, 4, 8, with the bits each streams and its GB/s; the E8 op's
            small-M path vs its decoded tiles + GEMM; and E8-3b in situ (--blocks SmolLM2 blocks, M = 1):
            in the weight arenas vs on the heap vs rotated, beside the integer kernel (bench/cpu_e8.py)
  streaming those 30 blocks and the 8-bit head, M = 1, 2, 8: the GEMV prefetching its weights into
            L1 (2 KB ahead) vs L2 (8 KB ahead), and the states where prepare left them vs in the
            weight arenas a served model loads them into (huge pages, load order)
The last line is ``HEADLINE speedup_m1_4096_1pct=<x> …`` (target ≥ 3).
"""
from __future__ import annotations

import argparse
import warnings
from dataclasses import replace

import torch
import torch.nn.functional as F

# the in-situ sections stream many blocks per pass: their harness lives apart from this per-layer grid
from bench.cpu_insitu import (coded_scales, gemv, layer_call, layer_calls, op_reads_gemv_layout, outlier_codings,
                              rotation_insitu, streaming)
from bench.cpu_e8 import E8_SHAPES, e8
from bench.paired_timing import med, ratio, side_by_side
from vllm_latq import format as fmt
from vllm_latq import cpu_features, native
from vllm_latq.kernels.cpu import kernel as cpu, dequant as cpu_dequant, layouts as cpu_layouts
from vllm_latq.kernels.cpu.kernel import CPUKernel
from vllm_latq.kernels.weight import LatqWeight, dequantize
from vllm_latq.testing.weights import random_weight

warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")

SHAPES = {  # name: (out_features, in_features)
    "4096": (4096, 4096),
    "gemma.q": (1024, 640), "gemma.kv": (256, 640), "gemma.o": (640, 1024),
    "gemma.gate_up": (2048, 640), "gemma.down": (640, 2048),
    "smol.q": (576, 576), "smol.kv": (192, 576), "smol.o": (576, 576),
    "smol.gate_up": (1536, 576), "smol.down": (576, 1536),
}
# the output heads (vocab × hidden; --shapes smol.head gemma.head, e.g. with --bits 8 for
# --lm-head-bits 8): not in the default table, Gemma3's alone is 168M weights
HEADS = {"smol.head": (49152, 576), "gemma.head": (262144, 640)}
# per decoder block: how many of each shape (q, k, v, o, gate, up, down)
BLOCK = {"q": 1, "kv": 2, "o": 1, "gate_up": 2, "down": 1}


def synthetic(out: int, cin: int, bits: int, rate: float, group: int = 128, seed: int = 0) -> LatqWeight:
    return random_weight(out, cin, bits, rate, group=group, seed=seed, scale_lo=0.002, scale_span=0.02,
                         val_std=0.1)


def table(a, results):
    print(f"{'shape':14s} {'NxK':>10s} bits rate   M | bf16 µs  latq µs | speedup (median of paired "
          f"ratios) | min/min")
    for name in a.shapes:
        N, K = {**SHAPES, **HEADS}[name]
        for bits in a.bits:
            for rate in a.rates:
                w = synthetic(N, K, bits, rate)
                state = CPUKernel.prepare(w)
                Wb = dequantize(w).to(torch.bfloat16)
                for M in a.m:
                    x = torch.randn(M, K, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
                    ts = side_by_side({"bf16": lambda: F.linear(x, Wb), "latq": lambda: CPUKernel.apply(state, x)},
                                      a.rounds, a.sample_us)
                    r = ratio(ts, "bf16", "latq")
                    results[(name, bits, rate, M)] = (r, med(ts["bf16"]), med(ts["latq"]))
                    print(f"{name:14s} {N:>5d}x{K:<5d} {bits:4d} {rate:4.0%} {M:3d} | {med(ts['bf16']):7.1f} "
                          f"{med(ts['latq']):8.1f} | {r:6.2f}x | {min(ts['bf16']) / min(ts['latq']):6.2f}x",
                          flush=True)


def _torch_path(state, x):
    with native.disabled():
        return CPUKernel.apply(state, x)


def profile(a):
    print("\nprofile, 4-bit, M=1 (median µs): the int4 op alone, the CSR mv alone, the whole kernel "
          "(C++ op), the whole kernel through its pure-torch path")
    _, mm = cpu_layouts.int4_ops()
    for name in ("4096", "gemma.gate_up", "smol.q", "smol.kv"):
        N, K = {**SHAPES, **HEADS}[name]
        for rate in a.rates:
            w = synthetic(N, K, 4, rate)
            s = CPUKernel.prepare(w)
            Wb = dequantize(w).to(torch.bfloat16)
            x = torch.randn(1, K).to(torch.bfloat16)
            xf = x.float()
            sz, go = cpu._op_scales_zeros(s)
            fns = {"bf16": lambda: F.linear(x, Wb), "op": lambda: mm(x, cpu._op_packed(s), go, sz),
                   "kernel": lambda: CPUKernel.apply(s, x)}
            if native.usable():
                fns["kernel_torch"] = lambda: _torch_path(s, x)
            if s.crow is not None:
                csr = torch.sparse_csr_tensor(s.crow, s.col, s.val, (N, K), check_invariants=False)
                fns["csr_mv"] = lambda: torch.mv(csr, xf[0])
            ts = side_by_side(fns, a.rounds, a.sample_us)
            print(f"{name:14s} rate {rate:4.0%} nnz {w.nnz:7d}: "
                  + "  ".join(f"{k}={med(v):.1f}" for k, v in ts.items())
                  + f"  | bf16/op={ratio(ts, 'bf16', 'op'):.2f}x bf16/kernel={ratio(ts, 'bf16', 'kernel'):.2f}x",
                  flush=True)


def large(a):
    N, K = SHAPES["4096"]
    print("\nlarge M, 4096x4096 4-bit 1% (median ms; speedups vs bf16 F.linear)")
    w = synthetic(N, K, 4, 0.01)
    s = CPUKernel.prepare(w)
    Wb = dequantize(w).to(torch.bfloat16)
    saved = cpu.LARGE_M, cpu_dequant.PREFILL_CACHE
    gemv_ok = native.available() and torch.ops.latq_cpu.gemv_max_m() > 0
    saved_m = torch.ops.latq_cpu.gemv_max_m() if gemv_ok else 0
    try:
        for M in a.large_m:
            x = torch.randn(M, K).to(torch.bfloat16)

            def path(large_m, cache, gemv_m=0):
                def f():
                    cpu.LARGE_M, cpu_dequant.PREFILL_CACHE = large_m, cache
                    if gemv_ok:
                        torch.ops.latq_cpu.set_gemv_max_m(gemv_m)
                    return CPUKernel.apply(s, x)
                return f

            fns = {"bf16": lambda: F.linear(x, Wb), "op": path(1 << 30, False),
                   "dequant": path(1, False), "cached": path(1, True)}
            if gemv_ok:
                fns["gemv"] = path(1 << 30, False, 1 << 30)
                if not op_reads_gemv_layout():   # "op" would run the GEMV: small M never goes to torch's op here
                    del fns["op"]
            ts = side_by_side(fns, max(5, a.rounds // 4), a.sample_us)
            print(f"M={M:4d}: " + "  ".join(f"{k}={med(v) / 1e3:.2f}" for k, v in ts.items()) + " | vs bf16: "
                  + " ".join(f"{k} {ratio(ts, 'bf16', k):.2f}x" for k in ts if k != "bf16")
                  + (f" | dequant/op {ratio(ts, 'op', 'dequant'):.2f}x" if "op" in ts else ""), flush=True)
    finally:
        cpu.LARGE_M, cpu_dequant.PREFILL_CACHE = saved
        if gemv_ok:
            torch.ops.latq_cpu.set_gemv_max_m(saved_m)
        cpu.clear_prefill_cache()


def wide(a, results):
    """> 4-bit inliers (HPTQ transcodes): two int4 planes vs off-grid weights in the CSR."""
    from vllm_latq.kernels.transcode import transcode
    N, K = SHAPES["4096"]
    print("\n> 4-bit HPTQ-style transcodes, 4096x4096, M=1 (median µs; speedup vs bf16 F.linear)")
    g = torch.Generator().manual_seed(0)
    saved = cpu.SPLIT_MAX_EXTRA_RATE
    try:
        for spread in (6.0, 40.0):
            z = torch.round(torch.distributions.Laplace(0.0, spread).sample((N, K))).int().clamp(-4000, 4000)
            w = transcode(z, float(torch.tensor(0.0137).half()))
            zw = fmt.unpack(w.qweight, w.bits, K)
            off = float(((zw < -8) | (zw > 7)).float().mean())
            Wb = dequantize(w).to(torch.bfloat16)
            x = torch.randn(1, K, generator=g).to(torch.bfloat16)
            fns = {"bf16": lambda: F.linear(x, Wb)}
            for label, rate in (("2 planes", 0.0), ("split to CSR", 1.0)):
                cpu.SPLIT_MAX_EXTRA_RATE = rate
                st_ = CPUKernel.prepare(w)
                fns[label] = (lambda st_=st_: CPUKernel.apply(st_, x))
            ts = side_by_side(fns, a.rounds, a.sample_us)
            print(f"{w.bits}-bit, {w.nnz / N / K:.2%} outliers, {off:.1%} off the 4-bit grid: "
                  + "  ".join(f"{k}={med(v):.0f}" for k, v in ts.items()) + " | "
                  + "  ".join(f"{k} {ratio(ts, 'bf16', k):.2f}x" for k in fns if k != "bf16"), flush=True)
            results[("wide", w.bits)] = ratio(ts, "bf16", "2 planes")
    finally:
        cpu.SPLIT_MAX_EXTRA_RATE = saved


def vllm_cpu(a, results):
    import os

    from vllm_latq.kernels.vllm_mp import op_available
    if not op_available("cpu_gemm_wna16"):
        print("\nvllm: this vLLM build has no cpu_gemm_wna16 (vLLM's CPU kernel cannot run here)")
        return
    from vllm_latq.plugin.vllm_scheme import ServedScheme
    from vllm_latq.testing.boundary_layers import replicated_layer
    from vllm_latq.testing.boundary_run import free_port, init_ranks
    init_ranks(1, 0, free_port())          # vLLM's parameter classes ask the TP group
    os.environ["LATQ_KERNEL"] = "vllm"     # vLLM's CPU kernel is opt-in
    print("\nvllm: latq CPU kernel vs vLLM's CPU kernel (its compressed-tensors scheme on a vLLM layer), 4-bit g64 "
          "fp16 scales, no outliers, bf16 activations")
    for i, name in enumerate(("4096", "smol.gate_up", "smol.down")):
        N, K = SHAPES[name]
        w = synthetic(N, K, 4, 0.0, group=64)
        ls = CPUKernel.prepare(w)
        CPUKernel.reserve(ls, torch.bfloat16)
        layer = replicated_layer(w, torch.bfloat16, prefix=f"bench.{i}")
        bpw = {"latq": 8 * sum(CPUKernel.served_bytes(ls).values()) / (N * K),
               "vllm": 8 * sum(ServedScheme.served_bytes(layer).values()) / (N * K)}
        wb = dequantize(w).bfloat16()
        for M in a.m:
            x = torch.randn(M, K).bfloat16()
            ts = side_by_side({"latq": lambda: CPUKernel.apply(ls, x), "vllm": lambda: layer(x)[0],
                               "bf16": lambda: F.linear(x, wb)}, a.rounds, a.sample_us)
            r = ratio(ts, "vllm", "latq")
            results[f"vllm_over_latq_{name}_m{M}"] = r
            print(f"  {name:13s} M={M:3d}: latq {med(ts['latq']):8.1f} µs ({bpw['latq']:.3f} b/w), "
                  f"{ServedScheme.label(layer)} {med(ts['vllm']):8.1f} µs ({bpw['vllm']:.3f} b/w, w4a8 "
                  f"{bool(getattr(layer, 'use_w4a8', False))}), bf16 {med(ts['bf16']):8.1f} µs; "
                  f"t_vllm/t_latq {r:.2f}")


# the input sizes of vLLM's fused linears of SmolLM2 and Gemma3 and 4096² (out, in): one transform per input
ROTATED = {"smol.qkv": (960, 576), "smol.down": (576, 1536), "gemma.qkv": (1536, 640), "gemma.o": (640, 1024),
           "gemma.down": (640, 2048), "4096": (4096, 4096)}


def rotation(a, results):
    """Per layer (warm: one matrix): the CPU kernel's op plain and rotated, and the transform
    alone (``latq_cpu::hadamard``); then the decode-sized pass over many blocks
    (:func:`~bench.cpu_insitu.rotation_insitu`), where weights stream from DRAM as in decode."""
    from vllm_latq.format.rotation import Rotation
    from vllm_latq.kernels.rotated import rotated_kernel
    if not native.usable():
        print("\nrotation: the C++ ops are not built here")
        return
    rot_k = rotated_kernel(CPUKernel)
    print(f"\nrotation: the CPU kernel's op plain vs rotated (--rotate hadamard), 4-bit g64, no outliers, bf16, "
          f"M=1, one warm matrix; transform ISA {torch.ops.latq_cpu.hadamard_isa() or 'scalar'}, GEMV ISA "
          f"{cpu.gemv_isa() or 'none'} (µs: min/median)")
    for name, (N, K) in ROTATED.items():
        w = synthetic(N, K, 4, 0.0, group=64)
        ps, rs = CPUKernel.prepare(w), rot_k.prepare(replace(w, rotation=Rotation(0).signs(K)))
        (pop, pargs), (rop, rargs) = layer_call(CPUKernel, ps, N), layer_call(rot_k, rs, N)
        x = torch.randn(1, K).bfloat16()
        ts = side_by_side({"plain": lambda: pop(x, *pargs), "rotated": lambda: rop(x, *rargs),
                           "transform": lambda: torch.ops.latq_cpu.hadamard(x, rs.signs)}, a.rounds, a.sample_us)
        results[f"rotation_layer_{name}"] = ratio(ts, "rotated", "plain") - 1
        print(f"  {name:11s} {N:>5d}x{K:<5d} block {rs.signs.numel():3d} ({pop.name()}, {rop.name()}): "
              + "  ".join(f"{k} {min(v):.2f}/{med(v):.2f}" for k, v in ts.items())
              + f"  → {ratio(ts, 'rotated', 'plain') - 1:+.1%}", flush=True)
    rotation_insitu(a, results)


def block_speedup(results, prefix, bits, rate, M):
    """A decoder block's linears (q, k, v, o, gate, up, down): Σ t_bf16 / Σ t_latq of the
    median times."""
    num = den = 0.0
    for k, n in BLOCK.items():
        key = (f"{prefix}.{k}", bits, rate, M)
        if key not in results:
            return None
        num += n * results[key][1]
        den += n * results[key][2]
    return num / den


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES) + list(HEADS))
    ap.add_argument("--bits", nargs="+", type=int, default=[4, 3])
    ap.add_argument("--rates", nargs="+", type=float, default=[0.0, 0.01, 0.02])
    ap.add_argument("--m", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--rounds", type=int, default=41)
    ap.add_argument("--sample-us", type=float, default=3000.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sections", nargs="+", default=["table", "profile", "large", "wide", "gemv", "outliers", "coded",
                                                      "vllm", "rotation", "calls", "streaming", "e8"],
                    choices=["table", "profile", "large", "wide", "gemv", "outliers", "coded", "vllm", "rotation", "calls",
                             "streaming", "e8"])
    ap.add_argument("--gemv-rounds", type=int, default=40, help="interleaved whole passes (gemv, outliers, coded)")
    ap.add_argument("--blocks", type=int, default=30, help="SmolLM2 blocks of an in-situ pass (gemv, outliers, e8, "
                    "coded): 30, ~57 MB of int4, more than L3")
    ap.add_argument("--large-m", nargs="+", type=int, default=[8, 16, 32, 64, 128, 256, 512])
    ap.add_argument("--e8-shapes", nargs="+", choices=list(E8_SHAPES), help="the e8 section's shapes (default: all)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{cpu_features.describe()}, LARGE_M={cpu.large_m()}, "
          f"load average at start {open('/proc/loadavg').read().split()[0]} (other processes skew timings)")
    results = {}
    if "table" in a.sections:
        table(a, results)
    if "profile" in a.sections:
        profile(a)
    if "large" in a.sections:
        large(a)
    if "wide" in a.sections:
        wide(a, results)
    if "gemv" in a.sections:
        gemv(a, results)
    if "outliers" in a.sections:
        outlier_codings(a, results)
    if "coded" in a.sections:
        coded_scales(a, results)
    if "vllm" in a.sections:
        vllm_cpu(a, results)
    if "rotation" in a.sections:
        rotation(a, results)
    if "calls" in a.sections:
        layer_calls(a, results)
    if "streaming" in a.sections:
        streaming(a, results)
    if "e8" in a.sections:
        e8(a, results)
    one = lambda *k: results[k][0] if k in results else None  # noqa: E731
    # gemv results are plain ratios under string keys
    head = {"speedup_m1_4096_1pct": one("4096", 4, 0.01, 1),
            "speedup_m8_4096_1pct": one("4096", 4, 0.01, 8),
            "speedup_m1_4096_0pct": one("4096", 4, 0.0, 1),
            "speedup_m1_4096_2pct": one("4096", 4, 0.02, 1),
            "gemma_block_m1_1pct": block_speedup(results, "gemma", 4, 0.01, 1),
            "smol_block_m1_1pct": block_speedup(results, "smol", 4, 0.01, 1),
            "gemma_block_m8_1pct": block_speedup(results, "gemma", 4, 0.01, 8),
            "smol_block_m8_1pct": block_speedup(results, "smol", 4, 0.01, 8),
            "gemv_smol_insitu": results.get("gemv_smol_insitu"),
            "gemv_smol_insitu_kernel": results.get("gemv_smol_insitu_kernel"),
            "gemv_smol_insitu_kernel_1pct": results.get("gemv_smol_insitu_kernel_1pct"),
            "gemv_4096_cold": results.get("gemv_4096_cold"), "gemv_4096_warm": results.get("gemv_4096_warm"),
            **{k: v for k, v in results.items() if isinstance(k, str)
               and k.startswith(("outliers_", "gemv_scales", "gemv_isa_", "coded_", "vllm_", "rotation_insitu",
                                 "calls_", "stream_", "e8_"))}}
    isa = torch.ops.latq_cpu.gemv_isa() if native.available() else ""
    e8_isa = torch.ops.latq_cpu.codebook_isa() if native.available() else ""
    print(f"HEADLINE cpu={cpu_features.capability()} gemv_isa={isa or 'none'} e8_isa={e8_isa or 'none'} "
          + " ".join(f"{k}={v:.2f}" for k, v in head.items() if v is not None))


if __name__ == "__main__":
    main()
