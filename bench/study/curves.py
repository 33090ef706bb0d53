"""Perplexity against served bits: each method's curve, and a comparison at equal served
bits instead of nominal widths.

A method's *series* are its configurations that differ only in width (``GPTQ g64``: GPTQ-2b/3b/4b
at group size 64); its *curve* in a kernel family is the series' non-dominated points (served
bits/weight, perplexity) — a point that streams more and predicts worse than another of the same
series is no operating point anyone would pick — joined piecewise linearly in log perplexity.
A configuration is compared with a baseline's curve at its own served bits; outside the range the
curve covers the answer is "no data", never an extrapolation.
"""
from __future__ import annotations

import math

from .configs import E8_FAMILY, E8_TAGS, NOISE_TAGS, ROT_TAGS
from .served import served_bits

# the configurations that are a method's operating points (variants and controls, other
# calibration draws, are not)
SERIES_TAGS = {"": None, "g32": 32, "g64": 64, "llmc": None, "tc": None, "tc-g32": 32, "tc-g64": 64,
               "s4-g64": 64, "s4-g32": 32, "s4-g16": 16, **{t: None for t in ROT_TAGS},
               **{t: g for t, g in E8_TAGS.items() if not t.endswith(NOISE_TAGS)}}
# the families whose series are one per group size
GROUPED = ("RTN", "GPTQ", E8_FAMILY)


def series_of(r: dict) -> str | None:
    """The series a result belongs to (``GPTQ g128``, ``llm-compressor GPTQ g128``, ``HPTQ``,
    ``SSQR-1%``, ``E8+rot+s4 g16``; with its group size where the family has one), or None (bf16,
    variants)."""
    if r["family"] == "bf16" or r["tag"] not in SERIES_TAGS:
        return None
    g = (r.get("options") or {}).get("group_size")
    parts = r["tag"].split("-")
    lever = "".join(f"+{name}" for name, part in (("rot", "rot"), ("TC", "tc"), ("s4", "s4")) if part in parts)
    name = ("llm-compressor " if r["tag"] == "llmc" else "") + r["family"] + lever
    return f"{name} g{g}" if r["family"] in GROUPED and g else name


def points(results: list[dict], series, family: str | None) -> list[tuple[float, float, str]]:
    """(bits, ppl, label) of the results in ``series`` (a name, or a collection of names), at
    ``family``'s served bits (None: stored bits); results without them are left out."""
    names = {series} if isinstance(series, str) else set(series)
    out = []
    for r in results:
        b = r["bits"] if family is None else served_bits(r, family)
        if series_of(r) in names and b is not None and math.isfinite(r["ppl"]):
            out.append((b, r["ppl"], r["label"]))
    return sorted(out)


def frontier(pts: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """The non-dominated points of ``pts`` (sorted by bits): each has a lower perplexity than
    every point with fewer or equal bits."""
    out = []
    for b, p, label in sorted(pts, key=lambda x: (x[0], x[1])):
        if not out or p < out[-1][1]:
            out.append((b, p, label))
    return out


def global_front(results: list[dict], family: str | None) -> set[str]:
    """The labels on the front of every operating point of every series in ``family``: no other
    configuration streams at most as many bits with a lower perplexity."""
    names = {s for r in results if (s := series_of(r))}
    return {label for _, _, label in frontier(points(results, names, family))}


def ppl_at(curve: list[tuple[float, float, str]], bits: float) -> tuple[float, str] | None:
    """The curve's perplexity at ``bits`` (piecewise linear in log ppl between its points) and
    the points it lies between; None outside the curve's range (no extrapolation)."""
    if not curve or not curve[0][0] <= bits <= curve[-1][0]:
        return None
    for (b0, p0, l0), (b1, p1, l1) in zip(curve, curve[1:]):
        if b0 <= bits <= b1:
            t = (bits - b0) / (b1 - b0)
            return math.exp((1 - t) * math.log(p0) + t * math.log(p1)), (l0 if t == 0 else l1 if t == 1
                                                                         else f"{l0}–{l1}")
    return curve[0][1], curve[0][2]   # a single point, hit exactly


def compare(r: dict, baseline: list[tuple[float, float, str]], family: str) -> dict | None:
    """The result ``r`` against the ``baseline`` curve at r's served bits in ``family``:
    {"bits", "ppl", "base_ppl", "between", "gap"} (gap: log ppl, negative where r wins). Outside
    the curve's range only dominance is read, never an extrapolation: past its last point, r
    loses if that point (fewer bits) already predicts better; before its first, r wins if it
    predicts better than that point (more bits) — ``"end"`` then names that point; else
    {"bits", "ppl", "no_data": True}. None without served bits."""
    b = served_bits(r, family)
    if b is None:
        return None
    p = r["ppl"]
    at = ppl_at(baseline, b)
    if at is not None:
        return {"bits": b, "ppl": p, "base_ppl": at[0], "between": at[1], "gap": math.log(p / at[0])}
    ends = [e for e in baseline[-1:] if b > e[0] and p >= e[1]] + [e for e in baseline[:1] if b < e[0] and p <= e[1]]
    if not ends:
        return {"bits": b, "ppl": p, "no_data": True}
    eb, ep, label = ends[0]
    return {"bits": b, "ppl": p, "base_ppl": ep, "between": label, "end": eb, "gap": math.log(p / ep)}
