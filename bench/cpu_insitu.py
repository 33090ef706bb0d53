"""The in-situ sections of :mod:`bench.cpu_layer` (``gemv``, ``outliers``, ``coded``, ``rotation``,
``calls``, ``streaming``): whole passes over SmolLM2 blocks of vLLM's fused shapes, more int4 than
L3 holds, candidates interleaved per pass; and the wiring that runs the GEMV on each instruction
set and reads torch's int4 op from the GEMV's packed layout.
"""
from __future__ import annotations

from dataclasses import replace as dataclass_replace

import torch

from bench.paired_timing import med, passes, ratio, side_by_side
from vllm_latq import format as fmt
from vllm_latq import native
from vllm_latq.kernels.cpu import kernel as cpu, dequant as cpu_dequant, layouts as cpu_layouts
from vllm_latq.kernels.cpu.kernel import CPUKernel
from vllm_latq.testing.weights import random_weight

SMOL_VLLM = (("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536))


def layer_call(kernel, state, N):
    """(op, its arguments after x) as a compiled vLLM layer calls ``kernel`` without bias: the lean
    op where the kernel has one for this state (``ops.plain_call``), else the list op."""
    from vllm_latq.kernels import ops
    t, i = kernel.flatten(state)
    plain = ops.plain_call(kernel, state, t)
    if plain is not None:
        return plain[0], (t[0], t[1], i, N, *[t[j] for j in plain[1]])
    return ops.op_for(kernel), (t, i, None, N)


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

            ts = passes({k: one_pass(f) for k, f in impls.items()}, a.gemv_rounds)
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
        ts = passes({k: (lambda f=f: [f(x, p, sz, g) for p, sz, g in big]) for k, f in impls.items()},
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

        ts = passes({k: one_pass(v) for k, v in codings.items()}, a.gemv_rounds)
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
            ts = passes({k: (lambda v=v: [CPUKernel.apply(s, x[K]) for s, K in v]) for k, v in cands.items()},
                         a.gemv_rounds)
            print(f"g{g} M={M}: " + "  ".join(f"{k}={min(v):.2f}/{med(v):.2f} ms ({b[k]:.3f} b/w)"
                                              for k, v in ts.items()), flush=True)
            sfx = "" if M == 1 else f"_m{M}"
            results[f"coded_g{g}_vs_fp16_g{2 * g}" + sfx] = ratio(ts, f"fp16-g{2 * g}", f"s4-g{g}")
            if g != 16:
                results[f"coded_g{g}_vs_fp16_g{g}" + sfx] = ratio(ts, f"fp16-g{g}", f"s4-g{g}")
        del cands


def rotation_insitu(a, results):
    """A rotated model's decode step on the CPU: the op a compiled layer calls (:func:`layer_call`)
    over ``a.blocks`` SmolLM2 blocks of vLLM's fused shapes, 4-bit g64, no outliers, plain against
    rotated (the same weights and the signs: the transform inside the call), passes interleaved;
    ms per pass and the transform's share, next to the bits/weight each streams."""
    from vllm_latq.format.rotation import Rotation
    from vllm_latq.kernels.rotated import rotated_kernel
    if not native.available():
        print("\nrotation in situ: the C++ ops are not built here")
        return
    rot_k = rotated_kernel(CPUKernel)
    layers = {"plain": [], "rotated": []}
    for b in range(a.blocks):
        for i, (_, N, K) in enumerate(SMOL_VLLM):
            w = random_weight(N, K, 4, 0.0, group=64, seed=1000 * b + i)
            for key, k, wk in (("plain", CPUKernel, w), ("rotated", rot_k, dataclass_replace(
                    w, rotation=Rotation(0).signs(K)))):
                st = k.prepare(wk)
                layers[key].append((*layer_call(k, st, N), N, K, sum(k.served_bytes(st).values())))
    numel = sum(N * K for *_, N, K, _ in layers["plain"])
    for M in (1, 8):
        x = {K: torch.randn(M, K).to(torch.bfloat16) for _, _, K in SMOL_VLLM}
        ts = passes({key: (lambda v=v: [op(x[K], *args) for op, args, N, K, _ in v])
                     for key, v in layers.items()}, a.gemv_rounds)
        share = ratio(ts, "rotated", "plain") - 1
        sfx = "" if M == 1 else f"_m{M}"
        results["rotation_insitu_overhead" + sfx] = share
        print(f"rotation in situ, {a.blocks} SmolLM2 blocks, M={M}: " + "  ".join(
            f"{k}={min(v):.2f}/{med(v):.2f} ms ({8 * sum(e[-1] for e in layers[k]) / numel:.4f} b/w)"
            for k, v in ts.items()) + f"  → transform {share:+.1%} (median of paired ratios)", flush=True)


def layer_calls(a, results):
    """The op as vLLM's compiled graph calls it, once per linear of a decode step at M = 1: 30
    SmolLM2 blocks in situ, 4-bit g64 without outliers (latq-quantize's default), then the 8-bit
    head (49152×576, two planes): ``latq_cpu::linear`` with the state as its list of ten optional
    tensors against ``latq_cpu::plain_linear`` with its two; and one call on a 64×64 layer, where
    the call is all there is. ms per pass best/median, µs per tiny call."""
    if not (native.available() and cpu._gemv_here()):
        print("\ncalls: the C++ GEMV is not available here")
        return
    layers = []
    for b in range(a.blocks):
        for i, (_, N, K) in enumerate(SMOL_VLLM):
            layers.append(CPUKernel.prepare(random_weight(N, K, 4, 0.0, group=64, seed=2000 * b + i)))
    head = CPUKernel.prepare(random_weight(49152, 576, 8, 0.0, group=64, seed=7))
    tiny = CPUKernel.prepare(random_weight(64, 64, 4, 0.0, group=64, seed=8))
    ops = {"list": CPUKernel.native_op(), "plain": torch.ops.latq_cpu.plain_linear.default}

    def call_args(k, s):   # each op's arguments after x, as the compiled graph passes them
        t, i = CPUKernel.flatten(s)
        return (t, i, None, s.out_features) if k == "list" else (t[0], t[1], i, s.out_features)

    xs = {K: torch.randn(1, K).to(torch.bfloat16) for K in (64, 576, 1536)}
    print(f"\ncalls: {a.blocks} SmolLM2 blocks in situ, 4-bit g64, no outliers, M = 1; the 8-bit head; a 64x64 "
          "layer (ms per pass best/median; µs per call median)")
    for what, states, rounds in (("blocks", layers, a.gemv_rounds), ("head", [head], a.gemv_rounds)):
        args = {k: [(xs[s.in_features], *call_args(k, s)) for s in states] for k in ops}
        ts = passes({k: (lambda k=k: [ops[k](*c) for c in args[k]]) for k in ops}, rounds)
        print(f"{what}: " + "  ".join(f"{k}={min(v):.3f}/{med(v):.3f}" for k, v in ts.items())
              + f" | list/plain {ratio(ts, 'list', 'plain'):.3f}x", flush=True)
        results[f"calls_plain_vs_list_{what}"] = ratio(ts, "list", "plain")
    c = {k: (xs[64], *call_args(k, tiny)) for k in ops}
    ts = side_by_side({k: (lambda k=k: ops[k](*c[k])) for k in ops}, a.rounds, a.sample_us)
    print("64x64: " + "  ".join(f"{k}={med(v):.2f} µs" for k, v in ts.items())
          + f" | list/plain {ratio(ts, 'list', 'plain'):.2f}x", flush=True)
    results["calls_plain_vs_list_tiny"] = ratio(ts, "list", "plain")


def streaming(a, results):
    """How a decode step's weights stream (M = 1, 2, 8, one pass over ``a.blocks`` SmolLM2 blocks
    of vLLM's fused shapes, 4-bit g64, then the 8-bit head): the GEMV prefetching into L1 2 KB
    ahead (``set_prefetch_l2(False)``) or into L2 8 KB ahead, each layer's state where
    ``prepare`` allocated it or in the weight arenas a served model loads it into
    (``CPUKernel.place``: huge pages, load order); each layer called as vLLM's compiled graph calls
    it (:func:`layer_call`); passes interleaved, each candidate on its own copy of the weights (a
    pass must not find the previous one's weights in L3). Keys: t_L1 / t_L2 (``stream_prefetch_*``)
    and t_L2 / t_L2+arena (``stream_arena_*``)."""
    if not (native.available() and cpu._gemv_here()):
        print("\nstreaming: the C++ GEMV is not available here")
        return

    def states(what):
        if what == "head":
            return [CPUKernel.prepare(random_weight(49152, 576, 8, 0.0, group=64, seed=9))]
        return [CPUKernel.prepare(random_weight(N, K, 4, 0.0, group=64, seed=3000 * b + i))
                for b in range(a.blocks) for i, (_, N, K) in enumerate(SMOL_VLLM)]

    print(f"\nstreaming: {a.blocks} SmolLM2 blocks in situ (4.25 b/w) and the 8-bit head (8.50 b/w); ms per "
          "pass best/median, GB/s at the median")
    try:
        for what in ("blocks", "head"):
            copies = {k: states(what) for k in ("L1", "L2", "L2+arena")}
            for s in copies["L2+arena"]:
                CPUKernel.place(s)
            nbytes = sum(sum(CPUKernel.served_bytes(s).values()) for s in copies["L1"])
            calls = {k: [(s.in_features, *layer_call(CPUKernel, s, s.out_features)) for s in v]
                     for k, v in copies.items()}
            for M in (1, 2, 8):
                x = {K: torch.randn(M, K).to(torch.bfloat16) for K in (576, 1536)}

                def run(k):
                    torch.ops.latq_cpu.set_prefetch_l2(k != "L1")
                    return [op(x[K], *args) for K, op, args in calls[k]]
                ts = passes({k: (lambda k=k: run(k)) for k in copies}, a.gemv_rounds)
                sfx = f"{what}_m{M}"
                results[f"stream_prefetch_{sfx}"] = ratio(ts, "L1", "L2")
                results[f"stream_arena_{sfx}"] = ratio(ts, "L2", "L2+arena")
                print(f"{what} M={M}: " + "  ".join(f"{k}={min(v):.3f}/{med(v):.3f} ({nbytes / med(v) / 1e6:.1f})"
                                                   for k, v in ts.items())
                      + f" | L1/L2 {results['stream_prefetch_' + sfx]:.3f}x  L2/arena "
                        f"{results['stream_arena_' + sfx]:.3f}x", flush=True)
            del copies, calls
    finally:
        torch.ops.latq_cpu.set_prefetch_l2(True)
