"""Every launch config a Triton layer may take, timed on a GPU against the one serving picks.

The packaged table (``tools/launch_table.py``) is chosen offline by the cost model; this bench
measures what it leaves on the table. Per layer shape × bits × outlier rate × M (M ≤ 64, the
tensor-core kernel's largest row tile), every candidate of the kernel for M rows (GEMV below 8,
tensor cores from 8) is run forced, its output checked against the fp32 reference, and timed as
:mod:`bench.kernels` times (CUDA-graph medians over weight copies cycled past L2). ``--json``
writes every timing, the measured entries ``tools/launch_table.py --add-timings`` takes.

    python -m bench.launch_configs [--shapes 8b.down,8b.o] [--bits 4] [--rates 0.01] [--m 1,4,8,16]
                                   [--budget-s 120] [--json timings.json] [--untimed]

Prints each candidate's µs and the table's time over it; ends with ``HEADLINE`` keys
``table_over_best_max`` and ``table_over_best_median`` (the table's time / the fastest
candidate's over the points: 1.00 where the table picks the fastest), ``points``, ``wrong``
(candidates whose output was off), ``gpu``; without a CUDA device ``gpu=none`` (exit 0).
"""
from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

import torch

from bench.kernel_timing import ERR_TOL, _clone_state, bench_weight, copies, cuda_timer, family, rel_err, \
    time_cycled, weight_bytes
from bench.kernels import SHAPES, _list, parse_shapes
from tools.launch_table import TUNED, WRONG, dumps_timings, read_timings, tuned_key as key   # the table's record of a timing

def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="8b.down,8b.o", help=f"NxK literals or names ({', '.join(SHAPES)})")
    ap.add_argument("--bits", default="4", help="inlier bits, of 2,3,4,5")
    ap.add_argument("--rates", default="0.01", help="outlier rates (fractions)")
    ap.add_argument("--m", default="1,4,8,16", help="activation rows, each ≤ 64")
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    ap.add_argument("--rep-ms", type=float, default=5.0, help="do_bench_cudagraph rep (ms per measurement)")
    ap.add_argument("--budget-s", type=float, default=120.0, help="start no new layer after this many seconds")
    ap.add_argument("--json", help="write every candidate's timing here (a JSON list, rewritten after each layer)")
    ap.add_argument("--untimed", action="store_true", help="of --bits, only those tools/launch_timings.json "
                    "has no timing of for this GPU family (all of them where it has every one)")
    a = ap.parse_args(argv)
    from vllm_latq.kernels.triton.cost_model import MMA_BMS
    try:
        a.shapes = parse_shapes(a.shapes)
        a.bits = _list(a.bits, int, lambda b: b in (2, 3, 4, 5), "bits must be of 2,3,4,5")
        a.rates = _list(a.rates, float, lambda r: 0 <= r < 0.5, "rates must be in [0, 0.5)")
        a.m = sorted(_list(a.m, int, lambda m: 1 <= m <= max(MMA_BMS),
                           f"M must be in 1..{max(MMA_BMS)} (one row tile at most)"))
    except ValueError as e:
        ap.error(str(e))
    return a


def layer_configs(spec, bits, rate, ms, dtype, dev, l2_bytes, timer, log, timings=None) -> list[dict]:
    """One layer: per M, every candidate forced (checked, timed) → a point per M: the table's
    config and time, the fastest candidate and its time, and the wrong candidates; each timing
    also appended to ``timings``."""
    from vllm_latq.kernels.triton.kernel import TritonKernel, launch_candidates, launch_config
    from vllm_latq.kernels.weight import dequantize
    name, n, k = spec
    w = bench_weight(n, k, bits, rate).to(dev)
    st = TritonKernel.prepare(w)
    TritonKernel.reserve(st, dtype)
    states = [st] + [_clone_state(st) for _ in range(copies(weight_bytes(st), l2_bytes) - 1)]
    w_ref = dequantize(w).float()
    del w
    points = []
    for m in ms:
        kind = "gemv" if m < 8 else "mma"
        x = torch.randn(m, k, device=dev).to(dtype)
        ref = x.float() @ w_ref.T
        table = launch_config(st, m, kind, dev)
        bm, cands = launch_candidates(st, m, kind)
        times, wrong = {}, []
        for c in cands:
            cc = dict(c, BM=bm)
            what = " ".join(f"{t}={c[t]}" for t in TUNED if t in c)
            try:
                err = rel_err(TritonKernel.apply(st, x, kernel=kind, config=cc), ref)
            except Exception as e:  # noqa: BLE001 — one candidate lost, not the run
                log(f"  FAILED {name} M={m} {kind} {what}: {type(e).__name__}: {str(e).strip()[:200]}")
                err = math.inf
            if not err <= ERR_TOL:
                wrong.append(what)
                if timings is not None:       # recorded as wrong: the table never serves it
                    timings.append(dict(family=family(dev), kernel=kind, bits=bits, bm=bm, n=n, k=k, m=m, rate=rate,
                                        config={t: c[t] for t in TUNED if t in c}, us=WRONG))
                continue
            times[key(c)] = us = time_cycled(timer, [lambda s=s: TritonKernel.apply(s, x, kernel=kind, config=cc)
                                                     for s in states])
            if timings is not None:
                timings.append(dict(family=family(dev), kernel=kind, bits=bits, bm=bm, n=n, k=k, m=m, rate=rate,
                                    config={t: c[t] for t in TUNED if t in c}, us=round(us, 2)))
            log(f"  {name:12} {bits}-bit {rate * 100:g}% M={m:<3} {kind:4} {what:38} {us:9.1f} us"
                f"{'   <- table' if key(c) == key(table) else ''}")
        if key(table) not in times or not times:
            log(f"  {name} M={m}: the table's config was not timed (wrong or not a candidate)")
            continue
        best = min(times, key=times.get)
        points.append(dict(shape=name, bits=bits, rate=rate, m=m, kernel=kind, table=key(table),
                           table_us=times[key(table)], best=best, best_us=times[best], wrong=wrong))
        log(f"  {name} M={m}: table {times[key(table)]:.1f} us, best {dict(zip(TUNED, best))} {times[best]:.1f} us "
            f"(table / best {times[key(table)] / times[best]:.2f})")
    return points


def untimed_bits(bits: list[int], fam: str, timings: list[dict]) -> list[int]:
    """Of ``bits``, those without a timing of family ``fam`` in ``timings``; all of them where each
    has one (a second look at the timed ones)."""
    timed = {r["bits"] for r in timings if r["family"] == fam}
    return [b for b in bits if b not in timed] or bits


def sweep(a, dev, l2_bytes, timer, log=print, timings=None) -> list[dict]:
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    t0 = time.perf_counter()
    points = []
    for spec in a.shapes:
        for bits in a.bits:
            for rate in a.rates:
                if time.perf_counter() - t0 > a.budget_s:
                    log(f"SKIPPED {spec[0]} {bits}-bit {rate * 100:g}%: --budget-s {a.budget_s:g} spent")
                    continue
                points += layer_configs(spec, bits, rate, a.m, dtype, dev, l2_bytes, timer, log, timings)
                if a.json and timings is not None:   # kept if a time limit stops the sweep
                    Path(a.json).write_text(dumps_timings(timings))
    return points


def headline(points: list[dict], gpu: str) -> str:
    over = [p["table_us"] / p["best_us"] for p in points]
    worst = f"{max(over):.2f}" if over else "na"
    median = f"{statistics.median(over):.2f}" if over else "na"
    wrong = sum(len(p["wrong"]) for p in points)
    return (f"HEADLINE table_over_best_max={worst} table_over_best_median={median} points={len(points)} "
            f"wrong={wrong} gpu={gpu.replace(' ', '_')}")


def main(argv=None) -> int:
    a = parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing timed")
        print(headline([], "none"))
        return 0
    dev = torch.device("cuda", 0)
    props = torch.cuda.get_device_properties(dev)
    l2 = getattr(props, "L2_cache_size", 0) or (50 << 20)
    print(f"GPU {props.name} (sm_{props.major}{props.minor}, {props.multi_processor_count} SMs); µs per call, "
          f"CUDA-graph medians, {a.dtype} activations")
    if a.untimed:
        a.bits = untimed_bits(a.bits, family(dev), read_timings())
        print(f"bits to time (--untimed, {family(dev)}): {','.join(map(str, a.bits))}")
    timings = []
    points = sweep(a, dev, l2, cuda_timer(a.rep_ms), timings=timings)
    if a.json:
        Path(a.json).write_text(dumps_timings(timings))
    print(headline(points, props.name))
    return 1 if any(p["wrong"] for p in points) else 0


if __name__ == "__main__":
    raise SystemExit(main())
