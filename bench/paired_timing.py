"""Paired timing for the CPU benches (:mod:`bench.cpu_layer`, :mod:`bench.cpu_moe` and the
in-situ passes of :mod:`bench.cpu_insitu`): candidates interleaved in one process, so load from
other processes, which drifts between rounds, hits both sides of each per-round ratio alike.
"""
from __future__ import annotations

import statistics as st
import time


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


def passes(fns: dict, rounds: int) -> dict:
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
