"""The codebook layers' Triton kernels (``triton-e8``) on a GPU: per layer shape and batch, the time of
the route ``apply`` takes (the GEMV below 8 rows, else the weight decoded once + cuBLAS), below 8 rows
of the GEMV with its table in shared memory (``LDS``, the alternative not yet the default) and, from 8
rows, of the tensor-core kernel, beside dense bf16 ``F.linear`` and the integer Triton kernel at the
same bits and scales (``TritonKernel``, no outliers), operands cycled past L2 as
:mod:`bench.kernel_timing` does, each output checked against the fp32 reference. ``--dry-run``: the
shapes at 1/64 of their size in Triton's interpreter with a fake timer (no speed), the tables' shape
only.

    python -m bench.e8_kernels --shapes 8b.down,8b.gate_up --m 1,4,16 [--json FILE]

``--json``: the rows as ``{"form", "shape", "m", "served_bits", "e8_us", "lds_us", "mma_us", "int_us",
"bf16_us", "e8_err"}`` (``form`` e.g. ``e8-3b-s4-g64``), docs/gpu/latest.json's ``e8_points``.
``--sweep``: the GEMV at M = 1 over its tiles too (``SWEEP``: BN × BKB × LDS × AHEAD), each output
checked, the fastest first; in the JSON as ``e8_sweep`` rows ``{"form", "shape", "config", "us"}``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from bench.kernel_timing import _time_dense, bench_weight, copies, cuda_timer, rel_err, scale_form, time_cycled
from bench.kernels import DRY_SCALE, parse_shapes
from vllm_latq.kernels.triton.codebook import LARGE_MIN_M, route

ERR_TOL = 3e-2       # as bench.kernel_timing: bf16 output rounding is ≤ 2^-7
LDS = {"LDS": True}  # the GEMV's table through shared memory
SWEEP = [dict(BN=bn, BKB=bkb, num_warps=4, LDS=lds, AHEAD=ahead) for bn in (64, 128) for bkb in (8, 16)
         for lds in (False, True) for ahead in (False, True)]


def _copies_of(kernel, st, r: int) -> list:
    """``r`` states of ``kernel`` (``st`` and clones of its tensors but the shared ones)."""
    shared = {id(t) for t in kernel.shared_tensors(st).values()}
    tensors, ints = kernel.flatten(st)
    return [st] + [kernel.unflatten([t if t is None or id(t) in shared else t.clone() for t in tensors], ints)
                   for _ in range(r - 1)]


def e8_layer(n, k, bits, scales, dev, l2):
    """A random codebook layer of the form: (weight, prepared state, its copies cycled past L2, served bytes)."""
    from vllm_latq.kernels.triton.codebook import TritonCodebookKernel as E8
    from vllm_latq.testing.weights import random_codebook_weight
    group, scale_bits = scale_form(scales)
    w8 = random_codebook_weight(n, k, bits, group=group, scale_bits=scale_bits)
    st8 = E8.prepare(w8.to(dev))
    served = sum(v for p, v in E8.served_bytes(st8).items() if p != "codebook")
    return w8, st8, _copies_of(E8, st8, copies(served, l2)), served


def time_layer(n, k, bits, scales, ms, dev, l2, timer, log, layer=None) -> list[dict]:
    """One layer shape (``layer``: :func:`e8_layer`'s, else made here): rows {m, e8_us, lds_us, mma_us,
    int_us, bf16_us, e8_err, e8_gbps} for each batch of ``ms``."""
    from vllm_latq.kernels.reference import latq_linear_ref
    from vllm_latq.kernels.triton.codebook import TritonCodebookKernel as E8
    from vllm_latq.kernels.triton.kernel import TritonKernel as Int
    w8, st8, s8, served = layer or e8_layer(n, k, bits, scales, dev, l2)
    sti = Int.prepare(bench_weight(n, k, bits, 0.0, scales).to(dev))
    si = _copies_of(Int, sti, copies(sum(Int.served_bytes(sti).values()), l2))
    rows = []
    for m in ms:
        x = torch.randn(m, k, device=dev).to(torch.bfloat16)
        ref = latq_linear_ref(x.float().cpu(), w8)
        err = rel_err(E8.apply(st8, x).float().cpu(), ref)
        lds = None
        if m >= LARGE_MIN_M:
            err = max(err, rel_err(E8.apply(st8, x, kernel="mma").float().cpu(), ref))
        else:
            err = max(err, rel_err(E8.apply(st8, x, kernel="gemv", config=LDS).float().cpu(), ref))
            lds = time_cycled(timer, [lambda s=s: E8.apply(s, x, kernel="gemv", config=LDS) for s in s8])
        e8 = time_cycled(timer, [lambda s=s: E8.apply(s, x) for s in s8])
        mma = time_cycled(timer, [lambda s=s: E8.apply(s, x, kernel="mma") for s in s8]) if m >= LARGE_MIN_M else None
        it = time_cycled(timer, [lambda s=s: Int.apply(s, x) for s in si])
        dense = _time_dense(n, k, x, l2, timer)
        rows.append(dict(m=m, e8_us=e8, lds_us=lds, mma_us=mma, int_us=it, bf16_us=dense, e8_err=err,
                         e8_gbps=served / e8 / 1e3, served_bits=8 * served / (n * k)))
        log(f"{n:>6}x{k:<6} {m:>3} {route(m, x.dtype):>8} {e8:>9.1f} {'-' if lds is None else f'{lds:.1f}':>9} "
            f"{'-' if mma is None else f'{mma:.1f}':>9} "
            f"{it:>9.1f} {dense:>9.1f} {served / e8 / 1e3:>8.0f} {err:>8.1e}" + ("  WRONG" if err > ERR_TOL else ""))
    return rows


def sweep_layer(layer, timer, log) -> list[dict]:
    """The GEMV at M = 1 over ``SWEEP``'s tiles on :func:`e8_layer`'s ``layer``: rows {config, us}, the
    fastest first (a config whose output is off by more than ERR_TOL, or that fails to launch, is logged
    and left out)."""
    from vllm_latq.kernels.reference import latq_linear_ref
    from vllm_latq.kernels.triton.codebook import TritonCodebookKernel as E8
    w8, st8, s8, _ = layer
    n, k = st8.n, st8.k
    x = torch.randn(1, k, device=st8.codes.device).to(torch.bfloat16)
    ref = latq_linear_ref(x.float().cpu(), w8)
    rows = []
    for c in SWEEP:
        try:
            err = rel_err(E8.apply(st8, x, kernel="gemv", config=c).float().cpu(), ref)
        except Exception as e:  # noqa: BLE001 — a tile that does not compile is a finding, not a crash
            log(f"  {c}: {type(e).__name__}: {str(e)[:120]}")
            continue
        if err > ERR_TOL:
            log(f"  {c}: WRONG (rel err {err:.1e})")
            continue
        rows.append(dict(config=c, us=time_cycled(timer, [lambda s=s: E8.apply(s, x, kernel="gemv", config=c)
                                                           for s in s8])))
    rows.sort(key=lambda r: r["us"])
    for r in rows:
        log(f"  {n:>6}x{k:<6} M=1 {r['config']}: {r['us']:.1f} us")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="8b.down,8b.gate_up", help="bench.kernels' shapes (NxK or table names)")
    ap.add_argument("--m", default="1,4,16", help="batches (rows of x)")
    ap.add_argument("--bits", type=int, default=3, choices=(2, 3, 4))
    ap.add_argument("--scales", default="s4-g64", help="scale form, as bench.kernels' --scales")
    ap.add_argument("--rep-ms", type=float, default=50.0)
    ap.add_argument("--budget-s", type=float, default=60.0, help="no new shape after this many seconds")
    ap.add_argument("--json", help="write the rows here (see above), after each shape")
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, layers 1/64 the size, no speed")
    ap.add_argument("--sweep", action="store_true", help="also the GEMV's tiles at M = 1 (SWEEP), fastest first")
    a = ap.parse_args(argv)
    ms = [int(v) for v in a.m.split(",")]
    if a.dry_run:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("e8_kernels: --dry-run needs TRITON_INTERPRET=1 (set before Triton is imported)", file=sys.stderr)
            return 2
        # the shapes' names on layers 1/DRY_SCALE their size (K in whole groups of 64), as bench.kernels does
        shapes = [(name, max(16, n // DRY_SCALE), -(-max(64, k // DRY_SCALE) // 64) * 64)
                  for name, n, k in parse_shapes(a.shapes)]
        dev, l2 = torch.device("cpu"), 1 << 10
        timer = lambda fn: (fn(), 1.0)[1]  # noqa: E731
    else:
        shapes, dev = parse_shapes(a.shapes), torch.device("cuda", 0)
        l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 0) or (50 << 20)
        timer = cuda_timer(a.rep_ms)
    print(f"{'layer':>13} {'M':>3} {'route':>8} {'e8 µs':>9} {'lds µs':>9} {'mma µs':>9} {'int µs':>9} "
          f"{'bf16 µs':>9} {'e8 GB/s':>8} {'rel err':>8}"
          f"   ({a.bits} bits, {a.scales}; int: TritonKernel at the same bits and scales, no outliers)")
    t0, worst, records, sweeps = time.perf_counter(), 0.0, [], []
    for name, n, k in shapes:
        if time.perf_counter() - t0 > a.budget_s:
            print(f"{name}: not timed (budget {a.budget_s:.0f} s spent)")
            continue
        layer = e8_layer(n, k, a.bits, a.scales, dev, l2)
        rows = time_layer(n, k, a.bits, a.scales, ms, dev, l2, timer, print, layer)
        worst = max([worst] + [r["e8_err"] for r in rows])
        records += [dict(form=f"e8-{a.bits}b-{a.scales}", shape=name, m=r["m"], served_bits=round(r["served_bits"], 3),
                         **{k: None if r[k] is None else round(r[k], 2)
                            for k in ("e8_us", "lds_us", "mma_us", "int_us", "bf16_us")},
                         e8_err=float(f"{r['e8_err']:.2e}"))
                    for r in rows]
        if a.sweep:
            sweeps += [dict(form=f"e8-{a.bits}b-{a.scales}", shape=name, config=r["config"], us=round(r["us"], 2))
                       for r in sweep_layer(layer, timer, print)]
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"e8_points": records, **({"e8_sweep": sweeps} if a.sweep else {})}, f, indent=1)
        one = rows[0]
        print(f"HEADLINE e8_kernels {name} M={one['m']}: triton-e8 {one['e8_us']:.1f} us, integer "
              f"{one['int_us']:.1f} us, bf16 {one['bf16_us']:.1f} us ({one['bf16_us'] / one['e8_us']:.2f}x bf16)")
    return 1 if worst > ERR_TOL else 0


if __name__ == "__main__":
    sys.exit(main())
