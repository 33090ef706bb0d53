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
            CPU kernel (CPUWNA16 through ``kernels/vllm_mp``, where the build has its op) vs
            bf16 F.linear, M = 1 and 8: t_vllm / t_latq and the bits/weight each streams
The last line is ``HEADLINE speedup_m1_4096_1pct=<x> …`` (target ≥ 3).
"""
from __future__ import annotations

import argparse
import statistics as st
import time
import warnings
from dataclasses import replace as dataclass_replace

import torch
import torch.nn.functional as F

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


def _sample(fn, inner: int) -> float:
    t = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t) / inner * 1e6


def side_by_side(fns: dict, rounds: int, sample_us: float) -> dict:
    """Interleaved timing → {name: list of per-round µs}."""
    inner = {}
    for k, f in fns.items():
        for _ in range(3):
            f()
        one = min(_sample(f, 1) for _ in range(3))
        inner[k] = max(1, int(sample_us / max(one, 1.0)))
    ts = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            ts[k].append(_sample(f, inner[k]))
    return ts


def ratio(ts: dict, base: str, other: str) -> float:
    return st.median(b / o for b, o in zip(ts[base], ts[other]))


def med(v) -> float:
    return st.median(v)


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


SMOL_VLLM = (("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536))


def _int4_state(N, K, seed, latq_group=128):
    """Random 4-bit weights in the GEMV's state: (packed, scales_zeros, op group); torch's op
    reads them through :func:`op_packed`."""
    go = next(g for g in cpu.OP_GROUPS if K % g == 0 and latq_group % g == 0)
    gen = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 16, (N, K), generator=gen, dtype=torch.int32)
    s = torch.rand(K // go, N, generator=gen) * 0.02 + 0.002
    return cpu_layouts.pack_gemv(u), torch.stack([s, torch.zeros_like(s)], -1).to(torch.bfloat16).contiguous(), go


def op_reads_gemv_layout() -> bool:
    """torch's int4 op reads the GEMV's packed layout here (AVX-512 torch; its AVX2 kernel packs
    other blocks, and the C++ op then never hands small M to torch's op)."""
    return not native.available() or bool(torch.ops.latq_cpu.op_reads_gemv_layout())


_OP_PACKED: dict = {}


def op_packed(p: torch.Tensor) -> torch.Tensor:
    """The GEMV's packed weights ``p`` as torch's op here reads them (repacked once where its
    layout differs)."""
    if op_reads_gemv_layout():
        return p
    key = (p.data_ptr(), tuple(p.shape))
    if key not in _OP_PACKED:
        N, K = p.shape[0], p.shape[1] * 2
        u = cpu_layouts.unpack_int4pack(p, N, K, cpu_layouts.GEMV_LAYOUT).T.int() + 8
        _OP_PACKED[key] = cpu_layouts.int4_ops()[0](u.contiguous(), 1)
    return _OP_PACKED[key]


def isa_impls(impls: dict, best: str, set_isa) -> dict:
    """``impls`` (name → f(x, p, sz, g)) each run on the best instruction set ``best``, plus,
    where that is not AVX2, "gemv_avx2" and "kernel_gemv_avx2_1pct": "gemv" and
    "kernel_gemv_1pct" forced onto AVX2 side by side. Each wrapper sets its instruction set
    (``set_isa``) right before the raw call: wrapping an already wrapped impl would set ``best``
    back before the call and time the best ISA under AVX2's name."""
    def on(isa, f):
        def run(*args):
            set_isa(isa)
            return f(*args)
        return run

    out = {k: on(best, f) for k, f in impls.items()}
    if best != "avx2":
        out |= {"gemv_avx2": on("avx2", impls["gemv"]), "kernel_gemv_avx2_1pct": on("avx2", impls["kernel_gemv_1pct"])}
    return out


def isa_keys(ts: dict, best: str, sfx: str = "") -> dict:
    """The per-ISA keys from one interleaved timing ``ts`` of :func:`isa_impls`' impls (each a
    median of paired ratios, t_base / t_other): torch's op / the AVX2 GEMV, raw and in the
    kernel with 1 % outliers (where torch's op reads the GEMV's layout), and the AVX2 GEMV / the
    best ISA's (> 1: the best is faster). Empty where no AVX2 twin ran."""
    if "gemv_avx2" not in ts:
        return {}
    out = {"gemv_isa_avx2_vs_op" + sfx: ratio(ts, "op", "gemv_avx2"),
           f"gemv_isa_{best}_vs_avx2" + sfx: ratio(ts, "gemv_avx2", "gemv")}
    if "kernel_op_1pct" in ts:
        out["gemv_isa_avx2_kernel_1pct_vs_op" + sfx] = ratio(ts, "kernel_op_1pct", "kernel_gemv_avx2_1pct")
    return out


def _passes(fns: dict, rounds: int) -> dict:
    """Each fn is one whole pass; interleaved rounds → {name: list of ms}."""
    for f in fns.values():
        f()
    ts = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            t = time.perf_counter()
            f()
            ts[k].append((time.perf_counter() - t) * 1e3)
    return ts


def gemv(a, results):
    if not (native.available() and torch.ops.latq_cpu.gemv_max_m() > 0):
        print("\ngemv: the C++ GEMV is not available here (no build, LATQ_CPU_GEMV=0, or another layout)")
        return
    _, mm = cpu_layouts.int4_ops()
    sl = torch.ops.latq_cpu.small_linear
    saved = torch.ops.latq_cpu.gemv_max_m()

    outliers = {}

    def csr(p, rate=0.01):   # uniform 1% fp32 outliers for a packed layer (cached per layer)
        key = (p.data_ptr(), rate)
        if key not in outliers:
            N, K = p.shape[0], p.shape[1] * 2
            gen = torch.Generator().manual_seed(N + K)
            m = torch.rand(N, K, generator=gen) < rate
            crow = torch.zeros(N + 1, dtype=torch.int32)
            crow[1:] = torch.cumsum(m.sum(1), 0)
            outliers[key] = (crow, m.nonzero()[:, 1].int().contiguous(), torch.randn(int(m.sum()), generator=gen) * 0.1)
        return outliers[key]

    def tiles(p):   # the layout the kernel keeps them in (CPUKernel.prepare)
        key = (p.data_ptr(), "tiles")
        if key not in outliers:
            outliers[key] = cpu_layouts.tiles_from_csr(*csr(p))
        return outliers[key]

    def kernel(on, outl=False):
        def f(x, p, sz, g):
            torch.ops.latq_cpu.set_gemv_max_m(saved if on else 0)
            return sl(x, p, sz, None, None, None, *(tiles(p) if outl else (None,) * 4), None, None, g, 1)
        return f

    scales_alone = {}

    def gemv_scales_alone(x, p, sz, g):   # the kernel's layout where the GEMV runs: no zeros streamed
        key = (sz.data_ptr(), tuple(sz.shape))
        if key not in scales_alone:
            scales_alone[key] = sz[..., 0].contiguous()
        return torch.ops.latq_cpu.gemv(x, p, scales_alone[key], g)

    best = torch.ops.latq_cpu.gemv_isa()
    impls = {"op": lambda x, p, sz, g: mm(x, op_packed(p), g, sz),
             "gemv": lambda x, p, sz, g: torch.ops.latq_cpu.gemv(x, p, sz, g),
             "gemv_s": gemv_scales_alone,
             "kernel_op": kernel(False), "kernel_gemv": kernel(True),
             "kernel_op_1pct": kernel(False, True), "kernel_gemv_1pct": kernel(True, True)}
    if not op_reads_gemv_layout():   # small_linear never hands small M to torch's op here
        del impls["kernel_op"], impls["kernel_op_1pct"]
    impls = isa_impls(impls, best, torch.ops.latq_cpu.set_gemv_isa)
    try:
        print(f"\ngemv (M ≤ {saved} rows; ms per pass: best / median over interleaved passes; ratio = "
              "median of paired op/gemv)")
        layers = [(*_int4_state(N, K, 100 * b + i), K)
                  for b in range(a.blocks) for i, (_, N, K) in enumerate(SMOL_VLLM)]
        for p, _, _, _ in layers:
            tiles(p)
        mb = sum(p.numel() + 2 * sz.numel() for p, sz, _, _ in layers) / 1e6
        for M in (1, 8):
            xs = {K: torch.randn(M, K).to(torch.bfloat16) for _, _, K in SMOL_VLLM}

            def one_pass(impl):
                return lambda: [impl(xs[K], p, sz, g) for p, sz, g, K in layers]

            ts = _passes({k: one_pass(f) for k, f in impls.items()}, a.gemv_rounds)
            kern = "kernel_op" in ts
            print(f"smol in situ M={M}, {len(layers)} layers, {mb:.0f} MB: " + "  ".join(
                f"{k}={min(v):.2f}/{med(v):.2f}" for k, v in ts.items())
                + f" | op/gemv {ratio(ts, 'op', 'gemv'):.2f}x"
                + (f" kernel {ratio(ts, 'kernel_op', 'kernel_gemv'):.2f}x kernel+1% outliers "
                   f"{ratio(ts, 'kernel_op_1pct', 'kernel_gemv_1pct'):.2f}x" if kern else ""), flush=True)
            sfx = "" if M == 1 else f"_m{M}"
            results["gemv_smol_insitu" + sfx] = ratio(ts, "op", "gemv")
            if kern:
                results["gemv_smol_insitu_kernel" + sfx] = ratio(ts, "kernel_op", "kernel_gemv")
                results["gemv_smol_insitu_kernel_1pct" + sfx] = ratio(ts, "kernel_op_1pct", "kernel_gemv_1pct")
            results["gemv_scales_alone_vs_pairs" + sfx] = ratio(ts, "gemv", "gemv_s")
            per_isa = isa_keys(ts, best, sfx)
            results.update(per_isa)
            if per_isa:   # best times beside the paired medians: min/min of the same passes
                print(f"  per ISA ({best} vs forced avx2, median of paired ratios; min/min): op/gemv_avx2 "
                      f"{per_isa['gemv_isa_avx2_vs_op' + sfx]:.2f}x; {min(ts['op']) / min(ts['gemv_avx2']):.2f}x  "
                      f"gemv_avx2/gemv_{best} {per_isa[f'gemv_isa_{best}_vs_avx2' + sfx]:.2f}x; "
                      f"{min(ts['gemv_avx2']) / min(ts['gemv']):.2f}x", flush=True)
        xs = {K: torch.randn(1, K).to(torch.bfloat16) for _, _, K in SMOL_VLLM}
        for name, N, K in SMOL_VLLM:   # one layer, warm (in L2/L3)
            p, sz, g = _int4_state(N, K, 7)
            x = xs[K]
            ts = side_by_side({k: (lambda f=f: f(x, p, sz, g)) for k, f in impls.items()}, a.rounds, a.sample_us)
            print(f"smol.{name:8s} {N}x{K} g{g} warm (µs median): " + "  ".join(
                f"{k}={med(v):.1f}" for k, v in ts.items()) + f" | op/gemv {ratio(ts, 'op', 'gemv'):.2f}x",
                flush=True)
        del layers
        outliers.clear()
        scales_alone.clear()
        big = [_int4_state(4096, 4096, 50 + i) for i in range(8)]
        x = torch.randn(1, 4096).to(torch.bfloat16)
        ts = _passes({k: (lambda f=f: [f(x, p, sz, g) for p, sz, g in big]) for k, f in impls.items()},
                     a.gemv_rounds)
        print("4096x4096 cold (ms per matrix, 8 matrices cycled): " + "  ".join(
            f"{k}={min(v) / 8:.3f}/{med(v) / 8:.3f}" for k, v in ts.items())
            + f" | op/gemv {ratio(ts, 'op', 'gemv'):.2f}x", flush=True)
        results["gemv_4096_cold"] = ratio(ts, "op", "gemv")
        p, sz, g = big[0]
        ts = side_by_side({k: (lambda f=f: f(x, p, sz, g)) for k, f in impls.items()}, a.rounds, a.sample_us)
        print("4096x4096 warm (µs median): " + "  ".join(f"{k}={med(v):.1f}" for k, v in ts.items())
              + f" | op/gemv {ratio(ts, 'op', 'gemv'):.2f}x", flush=True)
        results["gemv_4096_warm"] = ratio(ts, "op", "gemv")
    finally:
        torch.ops.latq_cpu.set_gemv_max_m(saved)
        torch.ops.latq_cpu.set_gemv_isa(best)


def outlier_codings(a, results):
    """The C++ op (GEMV + tiles) over 30 SmolLM2 blocks in situ with 1 % outliers in each tile
    value coding (``cpu_layouts.code_values``): fp32, fp16, int16 × row scale; ms per pass and
    the outlier bytes each streams."""
    if not (native.available() and torch.ops.latq_cpu.gemv_max_m() > 0):
        print("\noutliers: the C++ GEMV is not available here")
        return
    sl = torch.ops.latq_cpu.small_linear
    layers = [(*_int4_state(N, K, 100 * b + i), K) for b in range(a.blocks)
              for i, (_, N, K) in enumerate(SMOL_VLLM)]
    codings = {}
    for p, _, _, K in layers:
        N = p.shape[0]
        gen = torch.Generator().manual_seed(N + K)
        m = torch.rand(N, K, generator=gen) < 0.01
        crow = torch.zeros(N + 1, dtype=torch.int32)
        crow[1:] = torch.cumsum(m.sum(1), 0)
        col = m.nonzero()[:, 1].int().contiguous()
        s_row = (torch.rand(N, generator=gen) * 0.02 + 0.002).half().float()
        z = torch.randint(8, 40, (col.numel(),), generator=gen) * (1 - 2 * torch.randint(0, 2, (col.numel(),),
                                                                                             generator=gen))
        zs = z.float() * s_row[fmt.csr_rows(crow, col.numel())]
        codings.setdefault("fp32", []).append((*cpu_layouts.tiles_from_csr(crow, col, zs), None))
        codings.setdefault("fp16", []).append((*cpu_layouts.tiles_from_csr(crow, col, zs.half()), None))
        codings.setdefault("int16", []).append((*cpu_layouts.tiles_from_csr(crow, col, z.to(torch.int16)), s_row))
    mb = {k: sum(cpu_layouts.nbytes(*t) for t in v) / 1e6 for k, v in codings.items()}
    weights_mb = sum(p.numel() + 2 * sz.numel() for p, sz, _, _ in layers) / 1e6
    print(f"\noutliers: {a.blocks} SmolLM2 blocks in situ, 1% outliers as tiles, GEMV ({weights_mb:.0f} MB of int4 "
          "+ scales); "
          "ms per pass best/median; outlier MB")
    for M in (1, 8):
        x = {K: torch.randn(M, K).to(torch.bfloat16) for _, _, K in SMOL_VLLM}

        def one_pass(tiles):
            return lambda: [sl(x[K], p, sz, None, None, None, *t, None, g, 1)
                            for (p, sz, g, K), t in zip(layers, tiles)]

        ts = _passes({k: one_pass(v) for k, v in codings.items()}, a.gemv_rounds)
        print(f"M={M}: " + "  ".join(f"{k}={min(v):.2f}/{med(v):.2f} ms ({mb[k]:.2f} MB)" for k, v in ts.items()),
              flush=True)
        sfx = "" if M == 1 else f"_m{M}"
        results["outliers_fp16_vs_fp32" + sfx] = ratio(ts, "fp32", "fp16")
        results["outliers_int16_vs_fp32" + sfx] = ratio(ts, "fp32", "int16")


def coded_scales(a, results):
    """The kernel (``CPUKernel.apply``) over 30 SmolLM2 blocks in situ, 4-bit, no outliers: coded
    group scales at g (read as codes by the GEMV) against fp16 scales at 2g, the served-bits
    neighbour they replace, and at g (same integers, the scales decoded): ms per pass, streamed
    bits/weight."""
    if not (native.available() and cpu._gemv_here()):
        print("\ncoded: the C++ GEMV is not available here")
        return

    def states(g, coded):
        out = []
        for b in range(a.blocks):
            for i, (_, N, K) in enumerate(SMOL_VLLM):
                w = random_weight(N, K, 4, 0.0, group=g, seed=1000 * b + i, scale_bits=4 if coded else None)
                out.append((CPUKernel.prepare(w), K))
        return out

    def bits(layers):
        return 8 * sum(sum(CPUKernel.served_bytes(s).values()) for s, _ in layers) / sum(
            s.out_features * s.in_features for s, _ in layers)

    print(f"\ncoded: {a.blocks} SmolLM2 blocks in situ, 4-bit, no outliers; ms per pass best/median "
          "(bits/weight streamed)")
    for g in (64, 32, 16):
        cands = {f"s4-g{g}": states(g, True), f"fp16-g{2 * g}": states(2 * g, False)}
        if g != 16:   # group 16 runs only with codes (no op group): its decoded twin does not exist
            plain = [(dataclass_replace(s, scales=cpu_dequant.scales_alone(s).contiguous()), K)
                     for s, K in cands[f"s4-g{g}"]]
            cands[f"fp16-g{g}"] = plain
        b = {k: bits(v) for k, v in cands.items()}
        for M in (1, 8):
            x = {K: torch.randn(M, K).to(torch.bfloat16) for _, _, K in SMOL_VLLM}
            ts = _passes({k: (lambda v=v: [CPUKernel.apply(s, x[K]) for s, K in v]) for k, v in cands.items()},
                         a.gemv_rounds)
            print(f"g{g} M={M}: " + "  ".join(f"{k}={min(v):.2f}/{med(v):.2f} ms ({b[k]:.3f} b/w)"
                                              for k, v in ts.items()), flush=True)
            sfx = "" if M == 1 else f"_m{M}"
            results[f"coded_g{g}_vs_fp16_g{2 * g}" + sfx] = ratio(ts, f"fp16-g{2 * g}", f"s4-g{g}")
            if g != 16:
                results[f"coded_g{g}_vs_fp16_g{g}" + sfx] = ratio(ts, f"fp16-g{g}", f"s4-g{g}")
        del cands


def vllm_cpu(a, results):
    from vllm_latq.kernels.vllm_mp import VllmMPKernel, op_available
    if not op_available("cpu_gemm_wna16"):
        print("\nvllm: this vLLM build has no cpu_gemm_wna16 (vLLM's CPU kernel cannot run here)")
        return
    print("\nvllm: latq CPU kernel vs vLLM's CPU kernel, 4-bit g64 fp16 scales, no outliers, bf16 activations")
    for name in ("4096", "smol.gate_up", "smol.down"):
        N, K = SHAPES[name]
        w = synthetic(N, K, 4, 0.0, group=64)
        ls, vs = CPUKernel.prepare(w), VllmMPKernel.prepare(w)
        CPUKernel.reserve(ls, torch.bfloat16)
        VllmMPKernel.reserve(vs, torch.bfloat16)
        bpw = {k: 8 * sum(K_.served_bytes(s_).values()) / (N * K)
               for k, K_, s_ in (("latq", CPUKernel, ls), ("vllm", VllmMPKernel, vs))}
        wb = dequantize(w).bfloat16()
        for M in a.m:
            x = torch.randn(M, K).bfloat16()
            ts = side_by_side({"latq": lambda: CPUKernel.apply(ls, x), "vllm": lambda: VllmMPKernel.apply(vs, x),
                               "bf16": lambda: F.linear(x, wb)}, a.rounds, a.sample_us)
            r = ratio(ts, "vllm", "latq")
            results[f"vllm_over_latq_{name}_m{M}"] = r
            print(f"  {name:13s} M={M:3d}: latq {med(ts['latq']):8.1f} µs ({bpw['latq']:.3f} b/w), "
                  f"{VllmMPKernel.label(vs)} {med(ts['vllm']):8.1f} µs ({bpw['vllm']:.3f} b/w, w4a8 "
                  f"{bool(getattr(vs.layer, 'use_w4a8', False))}), bf16 {med(ts['bf16']):8.1f} µs; "
                  f"t_vllm/t_latq {r:.2f}")


def geomean(xs):
    xs = list(xs)
    return float(torch.tensor(xs).log().mean().exp()) if xs else float("nan")


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
                                                      "vllm"],
                    choices=["table", "profile", "large", "wide", "gemv", "outliers", "coded", "vllm"])
    ap.add_argument("--gemv-rounds", type=int, default=40, help="interleaved whole passes (gemv, outliers, coded)")
    ap.add_argument("--blocks", type=int, default=30, help="SmolLM2 blocks of an in-situ pass (gemv, outliers, "
                    "coded): 30, ~57 MB of int4, more than L3")
    ap.add_argument("--large-m", nargs="+", type=int, default=[8, 16, 32, 64, 128, 256, 512])
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"capability {cpu_features.capability()}, LARGE_M={cpu.large_m()}, "
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
               and k.startswith(("outliers_", "gemv_scales", "gemv_isa_", "coded_", "vllm_"))}}
    isa = torch.ops.latq_cpu.gemv_isa() if native.available() else ""
    print(f"HEADLINE cpu={cpu_features.capability()} gemv_isa={isa or 'none'} "
          + " ".join(f"{k}={v:.2f}" for k, v in head.items() if v is not None))


if __name__ == "__main__":
    main()
