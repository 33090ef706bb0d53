"""``bench.cpu_layer --sections e8``: the CPU family's codebook kernel (``cpu-e8``, method e8) as the study
configures it (coded scales per 16 columns: E8-2/3/4b at 2.375 / 3.375 / 4.375 stored bits) against the
integer CPU kernel at 3 and 4 bits (the default checkpoint's form: group 64) and bf16 ``F.linear``, on
SmolLM2-135M's and Llama-3-8B's shapes, M = 1, 4, 8; each with the bits a weight it streams and the
GB/s that makes. Then the E8 op's small-M path against its decoded tiles + GEMM for M = 8..2048 (where
``set_codebook_large_m`` should sit), and E8-3b in situ: whole passes over ``--blocks`` SmolLM2 blocks of
vLLM's fused shapes at M = 1 (weights from memory, as a decode step streams them) — the states in the weight
arenas as a served model's, where prepare left them, and rotated — beside the integer kernel's pass. Where
it runs, the opt-in ``cpu-e8-a8`` (x rounded to int8) beside each (``…_a8``). bf16 activations; timed side by
side (:mod:`bench.paired_timing`)."""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from bench.cpu_insitu import SMOL_VLLM
from bench.paired_timing import med, passes, ratio, side_by_side
from vllm_latq import format as fmt
from vllm_latq import native
from vllm_latq.format.rotation import Rotation
from vllm_latq.kernels.cpu.codebook import CPUCodebookA8Kernel, CPUCodebookKernel
from vllm_latq.kernels.cpu.kernel import CPUKernel
from vllm_latq.kernels.rotated import rotated_kernel
from vllm_latq.kernels.weight import CodebookWeight, dequantize
from vllm_latq.testing.weights import random_weight

# name: (out_features, in_features)
E8_SHAPES = {"smol.up": (1536, 576), "smol.down": (576, 1536), "8b.qo": (4096, 4096), "8b.up": (14336, 4096),
             "8b.down": (4096, 14336)}
E8_GROUP, INT_GROUP = 16, 64
E8_M = (1, 4, 8)


def codebook_weight(n: int, k: int, bits: int, group: int = E8_GROUP, seed: int = 0) -> CodebookWeight:
    """Random codes (each a point of the codebook) and coded scales: the op's time does not depend on them."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k // fmt.codebook.DIM, fmt.codebook.CODEBOOKS[bits].index_bytes), generator=g,
                          dtype=torch.uint8)
    cs = fmt.scale_codes.code_scales(torch.rand(n, -(-k // group), generator=g) * 0.02 + 0.002)
    return CodebookWeight(codes, cs.decode().half(), bits, group, k, cs)


def _bytes(kernel, state) -> int:
    """Bytes the layer streams a call (a shared table not counted: read once a step)."""
    shared = kernel.shared_tensors(state)
    return sum(v for p, v in kernel.served_bytes(state).items() if p not in shared)


def e8(a, results: dict) -> None:
    if not native.usable():
        print("\ne8: the C++ ops are not built here")
        return
    shapes = [s for s in (a.e8_shapes or E8_SHAPES)]
    a8 = CPUCodebookA8Kernel.unavailable_here() is None
    print(f"\ne8: cpu-e8 (coded scales, g{E8_GROUP}) vs the integer CPU kernel (g{INT_GROUP}) vs bf16 F.linear, "
          f"bf16 x; E8 op ISA {torch.ops.latq_cpu.codebook_isa() or 'scalar'}, GEMV ISA "
          f"{torch.ops.latq_cpu.gemv_isa() or 'none'} (µs: median; b/w: bits a weight streamed; GB/s)")
    for name in shapes:
        n, k = E8_SHAPES[name]
        fns, nbytes = {}, {}
        for bits in (2, 3, 4):
            for kern, key in ((CPUCodebookKernel, f"e8_{bits}b"), (CPUCodebookA8Kernel, f"e8_{bits}b_a8"))[:1 + a8]:
                st = kern.prepare(codebook_weight(n, k, bits))
                fns[key] = (lambda st=st, kern=kern: kern.apply(st, x))
                nbytes[key] = _bytes(kern, st)
        for bits in (3, 4):
            st = CPUKernel.prepare(random_weight(n, k, bits, 0.0, group=INT_GROUP, seed=1))
            fns[f"int_{bits}b"] = (lambda st=st: CPUKernel.apply(st, x))
            nbytes[f"int_{bits}b"] = _bytes(CPUKernel, st)
        wb = dequantize(codebook_weight(n, k, 3)).bfloat16()
        fns["bf16"] = lambda: F.linear(x, wb)
        nbytes["bf16"] = 2 * n * k
        for M in E8_M:
            x = torch.randn(M, k).bfloat16()
            ts = side_by_side(fns, a.rounds, a.sample_us)
            for key in ts:
                results[f"e8_{name}_m{M}_{key}_us"] = med(ts[key])
            for bits in (2, 3, 4):
                results[f"e8_{name}_m{M}_e8_{bits}b_over_int_4b"] = ratio(ts, f"e8_{bits}b", "int_4b")
                results[f"e8_{name}_m{M}_e8_{bits}b_over_bf16"] = ratio(ts, f"e8_{bits}b", "bf16")
                if a8:
                    results[f"e8_{name}_m{M}_e8_{bits}b_a8_over_int_4b"] = ratio(ts, f"e8_{bits}b_a8", "int_4b")
                    results[f"e8_{name}_m{M}_e8_{bits}b_a8_over_exact"] = ratio(ts, f"e8_{bits}b_a8", f"e8_{bits}b")
            print(f"  {name:9s} {n:>5d}x{k:<5d} M={M}: " + "  ".join(
                f"{key} {med(v):.1f} ({8 * nbytes[key] / (n * k):.3f} b/w, {nbytes[key] / med(v) / 1e3:.1f} GB/s)"
                for key, v in ts.items()), flush=True)
            print(f"  {'':9s} {'':11s}     time / int_4b: " + "  ".join(
                f"e8_{b}b {ratio(ts, f'e8_{b}b', 'int_4b'):.2f}" for b in (2, 3, 4)) + "   time / bf16: " + "  ".join(
                f"e8_{b}b {ratio(ts, f'e8_{b}b', 'bf16'):.2f}" for b in (2, 3, 4)) + ("   a8 / exact: " + "  ".join(
                f"e8_{b}b {ratio(ts, f'e8_{b}b_a8', f'e8_{b}b'):.2f}" for b in (2, 3, 4)) if a8 else ""), flush=True)
    fp32_row(a, results)
    large(a, results)
    insitu(a, results)


def fp32_row(a, results: dict) -> None:
    """One row of fp32 x — what a CPU without AVX-512 BF16 serves (``cpu_features.fastest_float``): the tiles'
    fp32 dots where they run (VBMI + GFNI) against the row path on the same codes, the integer kernel and
    fp32 ``F.linear``, each with fp32 x."""
    if CPUCodebookKernel.tile_rows(64) != 64:
        print("\n  fp32 x: the tiles' path does not run here (AVX-512 VBMI + GFNI)")
        return
    print("  one row of fp32 x (µs: median): the tiles' fp32 dots vs the row path on the same codes vs the integer "
          "kernel vs fp32 F.linear")
    for name in a.e8_shapes or E8_SHAPES:
        n, k = E8_SHAPES[name]
        fns = {}
        for bits in (2, 3, 4):
            w = codebook_weight(n, k, bits)
            st = CPUCodebookKernel.prepare(w)
            rows = replace(st, codes=w.codes.contiguous(), tile_rows=1)   # the same codes as rows
            fns[f"e8_{bits}b"] = lambda st=st: CPUCodebookKernel.apply(st, x)
            fns[f"e8_{bits}b_rows"] = lambda st=rows: CPUCodebookKernel.apply(st, x)
        st = CPUKernel.prepare(random_weight(n, k, 4, 0.0, group=INT_GROUP, seed=1))
        fns["int_4b"] = lambda st=st: CPUKernel.apply(st, x)
        wf = dequantize(codebook_weight(n, k, 3))
        fns["fp32"] = lambda: F.linear(x, wf)
        x = torch.randn(1, k)
        ts = side_by_side(fns, a.rounds, a.sample_us)
        for bits in (2, 3, 4):
            for base in ("rows", "int_4b", "fp32"):
                other = f"e8_{bits}b_rows" if base == "rows" else base
                results[f"e8_{name}_f32_e8_{bits}b_over_{base}"] = ratio(ts, f"e8_{bits}b", other)
        print(f"    {name:9s} {n:>5d}x{k:<5d}: " + "  ".join(f"{key} {med(v):.1f}" for key, v in ts.items())
              + "   tiles/rows: "
              + "  ".join(f"e8_{b}b {ratio(ts, f'e8_{b}b', f'e8_{b}b_rows'):.2f}" for b in (2, 3, 4))
              + "   /int_4b: " + "  ".join(f"e8_{b}b {ratio(ts, f'e8_{b}b', 'int_4b'):.2f}" for b in (2, 3, 4)),
              flush=True)


def large(a, results: dict) -> None:
    """The op's two paths for M rows: decoded on the fly (small) vs tiles decoded once + fp32 GEMM; bf16 x
    (the tiles' bf16 dots where they run) and fp32 x (their fp32 dots; the row path elsewhere)."""
    n, k = E8_SHAPES["8b.qo"]
    st = CPUCodebookKernel.prepare(codebook_weight(n, k, 3))
    saved = torch.ops.latq_cpu.codebook_large_m()

    def path(large_m):
        def f():
            torch.ops.latq_cpu.set_codebook_large_m(large_m)
            return CPUCodebookKernel.apply(st, x)
        return f

    print(f"  large M, {n}x{k} 3-bit (ms: median): on-the-fly decode vs decoded tiles + GEMM")
    try:
        for dtype, ms in ((torch.bfloat16, (8, 16, 32, 64, 128, 256, 512, 1024, 2048)),
                          (torch.float32, (64, 128, 256, 512))):
            tag = "" if dtype == torch.bfloat16 else "_f32"
            for M in ms:
                x = torch.randn(M, k).to(dtype)
                ts = side_by_side({"small": path(1 << 30), "tiles": path(1)}, max(5, a.rounds // 4), a.sample_us)
                results[f"e8_large{tag}_m{M}_small_over_tiles"] = ratio(ts, "small", "tiles")
                print(f"    {str(dtype)[6:]} x, M={M:4d}: small {med(ts['small']) / 1e3:.2f}  "
                      f"tiles {med(ts['tiles']) / 1e3:.2f}  small/tiles {ratio(ts, 'small', 'tiles'):.2f}", flush=True)
    finally:
        torch.ops.latq_cpu.set_codebook_large_m(saved)


def insitu(a, results: dict) -> None:
    """E8-3b over ``a.blocks`` SmolLM2 blocks at M = 1 through ``apply`` (eager's call): placed in the
    arenas (``e8``), left on the heap (``e8_heap``), rotated and placed (``e8_rot``); the integer 4-bit
    kernel placed (``int_4b``, g64); where it runs, ``cpu-e8-a8`` rotated and placed (``e8_a8_rot``)."""
    rot = rotated_kernel(CPUCodebookKernel)
    kernels = {"e8": CPUCodebookKernel, "e8_heap": CPUCodebookKernel, "e8_rot": rot, "int_4b": CPUKernel}
    if CPUCodebookA8Kernel.unavailable_here() is None:
        kernels["e8_a8_rot"] = rotated_kernel(CPUCodebookA8Kernel)
    layers = {key: [] for key in kernels}
    for b in range(a.blocks):
        for i, (_, n, k) in enumerate(SMOL_VLLM):
            w = codebook_weight(n, k, 3, seed=1000 * b + i)
            for key, kern in kernels.items():
                lw = (random_weight(n, k, 4, 0.0, group=INT_GROUP, seed=1000 * b + i) if key == "int_4b" else
                      replace(w, rotation=Rotation(0).signs(k)) if key.endswith("_rot") else w)
                st = kern.prepare(lw)
                if key != "e8_heap":
                    kern.place(st)
                layers[key].append((kern, st, k, _bytes(kern, st), n * k))
    x = {k: torch.randn(1, k).bfloat16() for _, _, k in SMOL_VLLM}
    ts = passes({key: (lambda v=v: [kern.apply(st, x[k]) for kern, st, k, _, _ in v]) for key, v in layers.items()},
                a.rounds)
    numel = sum(e[-1] for e in layers["e8"])
    results["e8_insitu_ms"] = med(ts["e8"])
    results["e8_insitu_heap_over_placed"] = ratio(ts, "e8_heap", "e8")
    results["e8_insitu_rot_over_plain"] = ratio(ts, "e8_rot", "e8")
    results["e8_insitu_over_int_4b"] = ratio(ts, "e8", "int_4b")
    if "e8_a8_rot" in ts:
        results["e8_insitu_a8_rot_over_rot"] = ratio(ts, "e8_a8_rot", "e8_rot")
    print(f"  in situ, {a.blocks} SmolLM2 blocks (vLLM's fused shapes), M=1, E8-3b (ms: median): " + "  ".join(
        f"{key} {med(v):.2f} ({8 * sum(e[3] for e in layers[key]) / numel:.3f} b/w)" for key, v in ts.items())
        + f"   heap/placed {results['e8_insitu_heap_over_placed']:.2f}  rotated/plain "
        f"{results['e8_insitu_rot_over_plain']:.2f}  e8/int_4b {results['e8_insitu_over_int_4b']:.2f}", flush=True)
