"""The GPU figures of record: latq's layers beside bf16 and the peers per shape and M, the
targets they are held to, and ``docs/gpu/latest.json`` — its schema, written from a kernel bench's
points and an end-to-end decode's rows (``bench/decode_gpu.py``), checked and merged here.

    python -m bench.gpu_figures merge --points P.json --e2e E.json [--e8 E8.json] --device NAME --commit SHA --out latest.json
    python -m bench.gpu_figures check latest.json

The file: ``{"device", "commit", "date", "points": [{"shape", "m", "bits", "rate", "latq_us",
"bf16_us", "peers": {"torch_int4", "gemlite"}}], "e2e": [{"model", "form", "batch", "tokens",
"latq_tok_s", "bf16_tok_s", "int4_tok_s"}], "e8_points": [{"form", "shape", "m", "served_bits", "e8_us",
"lds_us", "mma_us", "int_us", "bf16_us", "e8_err"}]}`` (``bench/e8_kernels.py``: the codebook kernels' route,
the GEMV with its table in shared memory, the tensor-core kernel, the integer kernel at the same bits); a peer or figure not measured is ``null``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import sys
from pathlib import Path

from bench.kernel_peers import PEERS

POINT_KEYS = ("shape", "m", "bits", "rate", "latq_us", "bf16_us", "peers")
E2E_KEYS = ("model", "form", "batch", "tokens", "latq_tok_s", "bf16_tok_s", "int4_tok_s")
E8_KEYS = ("form", "shape", "m", "served_bits", "e8_us", "lds_us", "mma_us", "int_us", "bf16_us", "e8_err")
TOP_KEYS = ("device", "commit", "date", "points", "e2e", "e8_points")
SHAPES = ("8b.down", "8b.gate_up", "8b.qkv", "8b.o")
BIG = ("8b.down", "8b.gate_up")
# what a lent GPU's run is held to (4-bit inliers, 1 % outliers): (Ms, shapes, against, at least)
TARGETS = [((1,), SHAPES, "peer", 1.0), ((1,), BIG, "bf16", 2.0), ((2, 4), BIG, "bf16", 1.8),
           ((8, 16), SHAPES, "bf16", 1.3), ((8, 16), SHAPES, "peer", 1.0), ((32, 64), SHAPES, "bf16", 1.0)]
E2E_TARGETS = [(1, 2.0), (16, 1.3)]      # (batch, ssqr-1%-4b tok/s over bf16's at least)
HEADLINE_MS = (1, 2, 4, 8, 16, 32, 64)


def _num(v):
    """A figure as JSON holds it: rounded, or None where not measured."""
    return round(float(v), 2) if v is not None and math.isfinite(v) else None


def point_record(p) -> dict:
    """One ``kernel_timing.Point`` in the file's schema (inlier bits, the outlier rate)."""
    return {"shape": p.shape, "m": p.m, "bits": p.bits, "rate": p.rate, "latq_us": _num(p.latq_us),
            "bf16_us": _num(p.dense_us), "peers": {name: _num(p.peers_us.get(name)) for name in PEERS}}


def write_points(path: str, device: str, points) -> None:
    """``kernel_timing.Point``s in the file's schema with the device (``bench/kernels.py --json``)."""
    doc = {"device": device, "points": [point_record(p) for p in points]}
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")


def fastest_peer(p) -> float:
    """The least peer time of a point (nan where no peer ran)."""
    times = [t for t in p.peers_us.values() if math.isfinite(t)]
    return min(times) if times else math.nan


def _target_points(points, ms, shapes) -> list:
    return [p for p in points if p.bits == 4 and p.rate == 0.01 and p.m in ms and p.shape in shapes
            and p.scales.startswith("fp16")]


def speedup(p, against: str) -> float:
    """How many times faster latq ran than ``against`` (bf16 or the fastest peer) at a point."""
    other = p.dense_us if against == "bf16" else fastest_peer(p)
    return other / p.latq_us if math.isfinite(p.latq_us) else 0.0


def headline_keys(points, absent: dict) -> dict:
    """Per M, the worst over the 8b shapes (4-bit, 1 % outliers) of latq's speed against bf16
    (``latq_vs_bf16_m<M>``) and against the faster peer (``latq_vs_peer_m<M>``); ``na`` where
    not measured; and the absent peers by name."""
    head = {}
    for m in HEADLINE_MS:
        pts = _target_points(points, (m,), SHAPES)
        for against in ("bf16", "peer"):
            vals = [speedup(p, against) for p in pts]
            vals = [v for v in vals if math.isfinite(v)]
            head[f"latq_vs_{against}_m{m}"] = f"{min(vals):.2f}" if vals else "na"
    if absent:
        head["peers_absent"] = ",".join(absent)
    return head


def variant_lines(points) -> tuple[list[str], dict]:
    """The pipelined kernels and the tensor-core route against the launch table's pick, where
    ``--breakdown`` timed them (bench/kernel_timing.VARIANTS): per point the table's time and each
    variant's; HEADLINE keys per M, the worst over the 8b shapes at 4-bit 1 %: table / pipelined
    (``pipelined_vs_table_m<M>``) and bf16 / the fastest of them (``best_vs_bf16_m<M>``)."""
    names = [n for n in ("pipelined", "mma", "mma_pipelined") if any(n in p.kernels_us for p in points)]
    if "pipelined" not in names and "mma_pipelined" not in names:
        return [], {}
    lines = ["the table's pick against the pipelined kernels and (M < 8) the tensor-core kernel, µs:",
             f"{'shape':12} {'bits':>4} {'M':>3} {'table':>8} " + " ".join(f"{n:>13}" for n in names)
             + f" {'best/bf16':>9}"]
    head, pipe, best = {}, {}, {}
    for p in points:
        times = {n: p.kernels_us.get(n, math.nan) for n in names}
        if p.m >= 8:
            times.pop("mma", None)                      # the table's pick itself
        fastest = min([p.latq_us] + [t for t in times.values() if math.isfinite(t)])
        lines.append(f"{p.shape:12} {p.bits:>4} {p.m:>3} {_cell(p.latq_us)} "
                     + " ".join(f"{_cell(times.get(n, math.nan)):>13}" for n in names)
                     + f" {p.dense_us / fastest:8.2f}x")
        if p in _target_points([p], (p.m,), SHAPES):
            pipe.setdefault(p.m, []).append(p.latq_us / times.get("pipelined", math.nan))
            best.setdefault(p.m, []).append(p.dense_us / fastest)
    for m in HEADLINE_MS:
        vals = [v for v in pipe.get(m, []) if math.isfinite(v)]
        head[f"pipelined_vs_table_m{m}"] = f"{min(vals):.2f}" if vals else "na"
        head[f"best_vs_bf16_m{m}"] = f"{min(best[m]):.2f}" if best.get(m) else "na"
    return lines, head


def target_lines(points) -> list[str]:
    """Each target's worst point and whether it is met (``NOT met`` also where unmeasured)."""
    lines = ["targets (4-bit inliers, 1 % outliers; speed = other's time / latq's):"]
    for ms, shapes, against, floor in TARGETS:
        pts = _target_points(points, ms, shapes)
        vals = [(speedup(p, against), p) for p in pts]
        worst = min(vals, key=lambda vp: vp[0] if math.isfinite(vp[0]) else -1, default=None)
        what = f"M={','.join(map(str, ms))} {'every shape' if shapes == SHAPES else '/'.join(shapes)} ≥ {floor}× {against}"
        if worst is None or not math.isfinite(worst[0]):
            lines.append(f"  {what}: NOT measured")
            continue
        v, p = worst
        lines.append(f"  {what}: worst {v:.2f}× ({p.shape} M={p.m}) {'met' if v >= floor else 'NOT met'}")
    return lines


def peer_table(points) -> list[str]:
    """latq, bf16 and each peer per shape × bits × M, with the served bits/weight of each."""
    if not any(p.peers_us for p in points):
        return []
    names = list(dict.fromkeys(n for p in points for n in p.peers_us))
    lines = ["latq beside bf16 and the peers (µs per call; served bits/weight in brackets):",
             f"{'shape':12} {'bits':>4} {'M':>3} {'latq':>16} {'bf16':>13} " + " ".join(f"{n:>17}" for n in names)
             + f" {'vs bf16':>7} {'vs peer':>7}"]
    for p in points:
        cells = [f"{_cell(p.peers_us.get(n))} ({p.peer_bits.get(n, math.nan):4.2f})" for n in names]
        lines.append(f"{p.shape:12} {p.bits:>4} {p.m:>3} {_cell(p.latq_us)} ({p.bits_per_weight:5.2f}) "
                     f"{_cell(p.dense_us)} (16) " + " ".join(f"{c:>17}" for c in cells)
                     + f" {speedup(p, 'bf16'):6.2f}x {speedup(p, 'peer'):6.2f}x")
    return lines


def _cell(v) -> str:
    return f"{v:8.1f}" if v is not None and math.isfinite(v) else f"{'-':>8}"


# ----------------------------------------------------------------------------- the file

def check(doc: dict) -> list[str]:
    """Where ``doc`` departs from the file's schema (empty: nowhere)."""
    bad = []
    if not isinstance(doc, dict) or set(doc) != set(TOP_KEYS):
        return [f"top-level keys must be {TOP_KEYS} (got {sorted(doc) if isinstance(doc, dict) else type(doc).__name__})"]
    for key in ("device", "commit", "date"):
        if not isinstance(doc[key], str) or not doc[key]:
            bad.append(f"{key}: a non-empty string (got {doc[key]!r})")
    if not re.fullmatch(r"[0-9a-f]{7,40}", doc["commit"] or ""):
        bad.append(f"commit: a git commit id (got {doc['commit']!r})")
    for i, p in enumerate(doc["points"] if isinstance(doc["points"], list) else [None]):
        if not isinstance(p, dict) or tuple(p) != POINT_KEYS:
            bad.append(f"points[{i}]: keys {POINT_KEYS} in order (got {p})")
        elif p["shape"] not in SHAPES or not all(isinstance(p[k], int) for k in ("m", "bits")) \
                or not isinstance(p["peers"], dict) or set(p["peers"]) != set(PEERS) \
                or not _figures([p["rate"], p["latq_us"], p["bf16_us"], *p["peers"].values()]):
            bad.append(f"points[{i}]: shape of {SHAPES}, integer m and bits, numbers, peers {PEERS} (got {p})")
    for i, e in enumerate(doc["e2e"] if isinstance(doc["e2e"], list) else [None]):
        if not isinstance(e, dict) or tuple(e) != E2E_KEYS:
            bad.append(f"e2e[{i}]: keys {E2E_KEYS} in order (got {e})")
        elif not (isinstance(e["model"], str) and isinstance(e["form"], str) and isinstance(e["batch"], int)
                  and isinstance(e["tokens"], int) and _figures([e["latq_tok_s"], e["bf16_tok_s"], e["int4_tok_s"]])):
            bad.append(f"e2e[{i}]: model and form strings, integer batch and tokens, numbers (got {e})")
    for i, e in enumerate(doc["e8_points"] if isinstance(doc["e8_points"], list) else [None]):
        if not isinstance(e, dict) or tuple(e) != E8_KEYS:
            bad.append(f"e8_points[{i}]: keys {E8_KEYS} in order (got {e})")
        elif not (isinstance(e["form"], str) and e["shape"] in SHAPES and isinstance(e["m"], int)
                  and _figures([e[k] for k in E8_KEYS[3:]])):
            bad.append(f"e8_points[{i}]: form string, shape of {SHAPES}, integer m, numbers (got {e})")
    return bad


def _figures(values) -> bool:
    """Every value a non-negative finite number or None (not measured)."""
    return all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0)
               for v in values)


def assemble(points: list[dict], e2e: list[dict], device: str, commit: str, date: str | None = None,
             e8_points: list[dict] = ()) -> dict:
    date = date or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    e8 = [{k: p.get(k) for k in E8_KEYS} for p in e8_points]
    return {"device": device, "commit": commit, "date": date, "points": points, "e2e": e2e, "e8_points": e8}


def _read_list(path: str | None, key: str) -> list[dict]:
    if not path or not Path(path).exists():
        return []
    doc = json.loads(Path(path).read_text())
    return doc[key] if isinstance(doc, dict) else doc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    mg = sub.add_parser("merge", help="assemble latest.json from a kernel bench's and a decode's --json files")
    mg.add_argument("--points", help="bench/kernels.py --json FILE (absent: no points)")
    mg.add_argument("--e2e", help="bench/decode_gpu.py --json FILE (absent: no e2e rows)")
    mg.add_argument("--e8", help="bench/e8_kernels.py --json FILE (absent: no e8 rows)")
    mg.add_argument("--device", required=True)
    mg.add_argument("--commit", required=True)
    mg.add_argument("--out", required=True)
    ck = sub.add_parser("check", help="check a latest.json against the schema")
    ck.add_argument("file")
    a = ap.parse_args(argv)
    try:
        doc = json.loads(Path(a.file).read_text()) if a.cmd == "check" else \
            assemble(_read_list(a.points, "points"), _read_list(a.e2e, "e2e"), a.device, a.commit,
                     e8_points=_read_list(a.e8, "e8_points"))
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"gpu_figures: {getattr(a, 'file', None) or a.points or a.e2e}: unreadable ({e})", file=sys.stderr)
        return 2
    bad = check(doc)
    if bad:
        print("gpu_figures: not the latest.json schema:\n  " + "\n  ".join(bad[:10]), file=sys.stderr)
        return 2
    if a.cmd == "merge":
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"HEADLINE file={a.out if a.cmd == 'merge' else a.file} points={len(doc['points'])} e2e={len(doc['e2e'])} "
          f"e8_points={len(doc['e8_points'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
