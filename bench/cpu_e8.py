"""``bench.cpu_layer --sections e8``: the CPU family's codebook kernel (``cpu-e8``, method e8) against bf16
``F.linear`` and the integer CPU kernel (3 and 4 bits) on the same shapes, M = 1 and 8, each with the
bits a weight it streams; then the E8 op's small-M path against its decoded tiles + GEMM for M = 8..256
(where ``set_codebook_large_m`` should sit). All at group 64, fp16 scales, no outliers, bf16
activations; timed side by side (:mod:`bench.paired_timing`)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from bench.paired_timing import med, ratio, side_by_side
from vllm_latq import format as fmt
from vllm_latq import native
from vllm_latq.kernels.cpu.codebook import CPUCodebookKernel
from vllm_latq.kernels.cpu.kernel import CPUKernel
from vllm_latq.kernels.weight import CodebookWeight, dequantize
from vllm_latq.testing.weights import random_weight

# name: (out_features, in_features)
E8_SHAPES = {"smol.up": (1536, 576), "2048x8192": (2048, 8192)}
GROUP = 64


def codebook_weight(n: int, k: int, bits: int, seed: int = 0) -> CodebookWeight:
    """Random codes (each a point of the codebook) and fp16 scales: the op's time does not depend on them."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k // fmt.codebook.DIM, fmt.codebook.CODEBOOKS[bits].index_bytes), generator=g,
                          dtype=torch.uint8)
    return CodebookWeight(codes, (torch.rand(n, k // GROUP, generator=g) * 0.02 + 0.002).half(), bits, GROUP, k)


def _bits(kernel, state, n: int, k: int) -> float:
    """Bits a weight the layer streams (a shared table not counted: read once a step)."""
    parts = kernel.served_bytes(state)
    shared = kernel.shared_tensors(state)
    return 8 * sum(v for p, v in parts.items() if p not in shared) / (n * k)


def e8(a, results: dict) -> None:
    if not native.usable():
        print("\ne8: the C++ ops are not built here")
        return
    print(f"\ne8: cpu-e8 vs bf16 F.linear vs the integer CPU kernel (cpu), g{GROUP} fp16 scales, bf16 x; E8 op ISA "
          f"{torch.ops.latq_cpu.codebook_isa() or 'scalar'} (µs: median; b/w: bits a weight streamed)")
    for name, (n, k) in E8_SHAPES.items():
        wb = dequantize(codebook_weight(n, k, 3)).bfloat16()
        fns, bpw = {}, {"bf16": 16.0}
        for bits in (2, 3, 4):
            st = CPUCodebookKernel.prepare(codebook_weight(n, k, bits))
            fns[f"e8_{bits}b"] = (lambda st=st: CPUCodebookKernel.apply(st, x))
            bpw[f"e8_{bits}b"] = _bits(CPUCodebookKernel, st, n, k)
        for bits in (3, 4):
            st = CPUKernel.prepare(random_weight(n, k, bits, 0.0, group=GROUP, seed=1))
            fns[f"int_{bits}b"] = (lambda st=st: CPUKernel.apply(st, x))
            bpw[f"int_{bits}b"] = _bits(CPUKernel, st, n, k)
        fns["bf16"] = lambda: F.linear(x, wb)
        for M in (1, 8):
            x = torch.randn(M, k).bfloat16()
            ts = side_by_side(fns, a.rounds, a.sample_us)
            for key in ts:
                results[f"e8_{name}_m{M}_{key}_us"] = med(ts[key])
            for bits in (3, 4):
                results[f"e8_{name}_m{M}_int_over_e8_{bits}b"] = ratio(ts, f"int_{bits}b", f"e8_{bits}b")
            print(f"  {name:10s} {n:>5d}x{k:<5d} M={M}: " + "  ".join(
                f"{key} {med(v):.1f} ({bpw[key]:.3f} b/w)" for key, v in ts.items()), flush=True)
    large(a, results)


def large(a, results: dict) -> None:
    """The op's two paths for M rows: decoded on the fly (small) vs tiles decoded once + fp32 GEMM."""
    n, k = E8_SHAPES["2048x8192"]
    st = CPUCodebookKernel.prepare(codebook_weight(n, k, 3))
    saved = torch.ops.latq_cpu.codebook_large_m()

    def path(large_m):
        def f():
            torch.ops.latq_cpu.set_codebook_large_m(large_m)
            return CPUCodebookKernel.apply(st, x)
        return f

    print(f"  large M, {n}x{k} 3-bit (ms: median): on-the-fly decode vs decoded tiles + GEMM")
    try:
        for M in (8, 16, 32, 64, 128, 256):
            x = torch.randn(M, k).bfloat16()
            ts = side_by_side({"small": path(1 << 30), "tiles": path(1)}, max(5, a.rounds // 4), a.sample_us)
            results[f"e8_large_m{M}_small_over_tiles"] = ratio(ts, "small", "tiles")
            print(f"    M={M:4d}: small {med(ts['small']) / 1e3:.2f}  tiles {med(ts['tiles']) / 1e3:.2f}  "
                  f"small/tiles {ratio(ts, 'small', 'tiles'):.2f}", flush=True)
    finally:
        torch.ops.latq_cpu.set_codebook_large_m(saved)
