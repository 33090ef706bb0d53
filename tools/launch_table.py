"""Write the packaged launch-config table (``vllm_latq/kernels/triton/launch_configs.json``):
one config per GPU family × shape class of the shapes served most (8B-class projections at
TP 1 and 2), chosen offline so that serving never autotunes.

Per shape class the candidates are the kernel's own (:func:`~vllm_latq.kernels.triton.configs.candidates`,
the autotuner's pruning) that every shape of the class takes (one entry serves them all); a
candidate the offline compile report (:mod:`tools.triton_compile`) shows spilling on the
family's target is dropped. Where a GPU of the family timed the class (``launch_timings.json``,
from ``bench/launch_configs.py --json``), the candidate of least time summed over the timed
points wins — measured beats modelled; elsewhere the rest are ranked by the cost model's device constants
(:mod:`~vllm_latq.kernels.triton.cost_model`) with the report's registers (resident programs
per SM → wave quantisation) and K-loop instructions per weight, plus the split-K partials'
traffic, summed over the class's shapes. Candidates within ``TIE`` of the fastest are ranked by
:func:`~vllm_latq.kernels.triton.configs.preference` (the serving rule's order), so the
order the candidates are listed in never decides.

The table is built from the report's summary (spills, registers, i/w per tile and target),
committed beside this file (``launch_report.json``) and made from the committed compile record
(``compile_record.json``, :mod:`tools.triton_compile` ``--record``): ``tests/bench/test_launch_table.py``
checks the summary is the record's and rebuilds the packaged table from it. A report that lacks a
candidate is refused (exit 2, the missing tiles named) rather than filled in by the rule; so is a
stale record. ``--compile`` compiles every tile instead (the cache reused);
``--from-summary`` rebuilds from the committed summary alone.

    python -m tools.launch_table [--compile | --from-summary] [--add-timings FILE] [--out PATH]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

import triton

from vllm_latq.kernels.triton import configs as cfg
from vllm_latq.kernels.triton import cost_model as cm
from vllm_latq.kernels.triton import layout as tlay

# (N, K) of 8B-class dense projections (qkv, o, gate+up, down) at TP 1 and TP 2
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
          (3072, 4096), (4096, 2048), (14336, 4096), (4096, 7168)]
ROW_TILES = {"gemv": (1, 2, 4, 8), "mma": cm.MMA_BMS}
WARPS_PER_SM = {"sm_80": 64, "sm_86": 48, "sm_89": 48, "sm_90": 64}
REPORT_FILE = Path(__file__).with_name("launch_report.json")
TIMINGS_FILE = Path(__file__).with_name("launch_timings.json")
TIMING_FIELDS = ("family", "kernel", "bits", "bm", "n", "k", "m", "rate", "config", "us")
TUNED = ("BN", "SPLIT", "BR", "num_warps", "DEPTH")          # what tells two candidates apart
REPORT_FIELDS = ("kernel", "bits", "BM", "BN", "num_warps", "BR", "DEPTH", "cc")
ROUTE = "route"          # shape classes whose M < 8 rows a GPU timed faster on tensor cores
TIE = 0.02       # modelled times this close are the model's noise, not a ranking
WRONG = -1.0     # a timing record's µs where the candidate's output was off (never served)


def family_model(fam: str) -> cm.DeviceModel:
    base = cm.DEVICES["h100" if fam == "sm_90" else "a100"]
    sms = cfg.FAMILY_SMS[fam]
    return dataclasses.replace(base, sms=sms, issue=base.issue * sms / base.sms, tc_flops=base.tc_flops * sms / base.sms)


def load_report(compile_missing: bool) -> dict:
    """{(kernel, bits, BM, BN, warps, BR, cc): (worst spill bytes, max registers, median i/w)}
    over the outlier layouts, scale forms and splits compiled: from the committed compile record
    (``tools/compile_record.json``), or with ``compile_missing`` from compiling (the cache reused)."""
    from tools import triton_compile as tc
    from tools import triton_record as tr
    every = tc.all_jobs()
    jobs = [j for j in every if j["kernel"].split("_")[0] in ROW_TILES]
    if compile_missing:
        return aggregate(tc.summarize(jobs, tc.run(jobs)))
    record = tr.read_record()
    why = tr.record_staleness(record, every)
    if why:
        raise ValueError(f"compile record {tr.RECORD_FILE} is stale ({'; '.join(why)}): rewrite it with "
                         "`python -m tools.triton_compile --record`, or pass --compile")
    return aggregate([record["rows"][tc.job_key(j)] for j in jobs])


def aggregate(rows: list[dict]) -> dict:
    """Compile summary rows → the report: per tile, depth and target the worst spill, the most
    registers and the median i/w (an element, not an average: rounding it commutes); a pipelined
    kernel's rows under its unpipelined kernel's name at their DEPTH."""
    out: dict = {}
    for r in rows:
        if "error" in r:
            continue
        key = (r["kernel"].split("_")[0], r["bits"], r["BM"], r["BN"], r["num_warps"], r.get("BR"), r.get("DEPTH", 1),
               r["cc"])
        spill, regs, ipws = out.get(key, (0, 0, []))
        out[key] = (max(spill, r["spill_stores"] + r["spill_loads"]), max(regs, r["regs"]), ipws + [r["ipw"]])
    return {k: (s, g, sorted(i)[len(i) // 2]) for k, (s, g, i) in out.items()}


def modelled_time(c: dict, kernel: str, bits: int, bm: int, n: int, k: int, n_pad: int, fam: str, rep) -> float:
    """Seconds by the cost model: max(bytes / BW, instructions / issue rate) stretched by the
    last wave's idle SMs, plus the split-K partials written and read back."""
    d = family_model(fam)
    spill, regs, ipw = rep
    resident = max(1, min(65536 // (regs * 32 * c["num_warps"]), WARPS_PER_SM[fam] // c["num_warps"]))
    programs = triton.cdiv(n_pad, c["BN"]) * c["SPLIT"]
    waves = math.ceil(programs / (d.sms * resident))
    stretch = waves * d.sms * resident / programs if programs < d.sms * resident * 4 else 1.0
    body = max(cm.packed_bytes(n, k, bits, 0) / d.hbm_bw, n * k * ipw / d.issue)
    return body * stretch + (2 * c["SPLIT"] * bm * n_pad * 4 if c["SPLIT"] > 1 else 0) / d.hbm_bw


def report_key(kernel: str, bits: int, bm: int, c: dict, fam: str) -> tuple:
    return kernel, bits, bm, c["BN"], c["num_warps"], c.get("BR"), cfg.depth(c), int(fam[3:])


def classes() -> dict[tuple, list[tuple[int, int]]]:
    """{(kernel, bits, BM, shape class): the SHAPES in it}, in a fixed order."""
    out: dict = {}
    for kernel, bms in ROW_TILES.items():
        for bits in tlay.WIDTHS:
            for bm in bms:
                for n, k in SHAPES:
                    key = cfg.shape_class(kernel, bits, bm, _n_pad(n), tlay.pad_k(k, bits))
                    out.setdefault((kernel, bits, bm, key), []).append((n, k))
    return out


def _n_pad(n: int) -> int:
    return -(-n // tlay.ROWS) * tlay.ROWS


def shape_candidates(kernel: str, bits: int, bm: int, n: int, k: int, fam: str | None = None) -> list[dict]:
    ks = tlay.k_steps(bits, tlay.pad_k(k, bits))
    can_split = _n_pad(n) <= cfg.SPLITK_MAX_N
    return cfg.candidates(kernel, bits, bm, _n_pad(n), ks["nsteps"] + ks["tsteps"], can_split, fam)


def class_candidates(kernel: str, bits: int, bm: int, shapes: list[tuple[int, int]],
                     fam: str | None = None) -> list[dict]:
    """The candidates every shape of a class takes on family ``fam`` (``configs.choose`` serves
    an entry only to a shape it is a candidate of)."""
    per_shape = [shape_candidates(kernel, bits, bm, n, k, fam) for n, k in shapes]
    return [c for c in per_shape[0] if all(c in other for other in per_shape[1:])]


def missing(report: dict) -> list[tuple]:
    """Report keys some candidate of the table needs and the report lacks."""
    need = {report_key(kernel, bits, bm, c, fam) for fam in cfg.FAMILY_SMS
            for (kernel, bits, bm, _), shapes in classes().items()
            for c in class_candidates(kernel, bits, bm, shapes, fam)}
    return sorted(need - set(report), key=str)


def tuned_key(c: dict) -> tuple:
    return tuple(cfg.depth(c) if k == "DEPTH" else c.get(k) for k in TUNED)


def measured_points(timings: list[dict], fam: str, kernel: str, bits: int, bm: int,
                    shapes: list[tuple[int, int]]) -> list[dict]:
    """{tuned key: µs} per timed point (shape × M × outlier rate) of this class on this family
    (the tensor-core kernel's timings below 8 rows are the route's, :func:`routes`; ``WRONG``
    where a candidate's output was off)."""
    points: dict = {}
    for t in timings:
        if (t["family"], t["kernel"], t["bits"], t["bm"]) == (fam, kernel, bits, bm) and (t["n"], t["k"]) in shapes \
                and not (kernel == "mma" and t["m"] < 8):
            points.setdefault((t["n"], t["k"], t["m"], t["rate"]), {})[tuned_key(t["config"])] = t["us"]
    return list(points.values())


def choose(kernel: str, bits: int, bm: int, shapes: list[tuple[int, int]], fam: str, report: dict,
           timings: list[dict] = ()) -> dict:
    """The class's config among its spill-free candidates: of least measured time summed over
    the class's timed points (candidates timed at every point), else of least modelled time
    summed over its shapes (the unpipelined ones: the model has no term for a pipeline's depth);
    within ``TIE`` of the least, :func:`configs.preference` decides. A candidate timed at only
    some points (a later GPU's A/B of the pick against its pipelined twin) replaces that choice
    where it ran faster than it, beyond ``TIE``, summed over the points both ran."""
    cands = class_candidates(kernel, bits, bm, shapes, fam)
    reps = [report[report_key(kernel, bits, bm, c, fam)] for c in cands]
    clean = [(c, r) for c, r in zip(cands, reps) if r[0] == 0] or list(zip(cands, reps))
    points = measured_points(timings, fam, kernel, bits, bm, shapes)
    wrong = {key for p in points for key, us in p.items() if us == WRONG}
    clean = [(c, r) for c, r in clean if tuned_key(c) not in wrong] or clean
    timed = [(c, sum(p[tuned_key(c)] for p in points)) for c, _ in clean
             if points and all(tuned_key(c) in p for p in points)]
    if timed:
        pairs = timed
    else:
        pairs = [(c, sum(modelled_time(c, kernel, bits, bm, n, k, _n_pad(n), fam, r) for n, k in shapes))
                 for c, r in clean if cfg.depth(c) == 1]
    least = min(t for _, t in pairs)
    pick = min((c for c, t in pairs if t <= least * (1 + TIE)), key=cfg.preference)
    return _challenger(pick, [c for c, _ in clean], points) or pick


def _challenger(pick: dict, cands: list[dict], points: list[dict]) -> dict | None:
    """The candidate that ran fastest against ``pick`` (its time over pick's, summed over the
    points both ran) where that beats ``TIE``; None where none does (or ``pick`` was wrong)."""
    mine = tuned_key(pick)
    best, best_ratio = None, 1 / (1 + TIE)
    for c in cands:
        both = [p for p in points if tuned_key(c) in p and mine in p]
        if c is pick or not both or any(p[tuned_key(c)] == WRONG or p[mine] == WRONG for p in both):
            continue
        ratio = sum(p[tuned_key(c)] for p in both) / sum(p[mine] for p in both)
        if ratio < best_ratio:
            best, best_ratio = c, ratio
    return best


def routes(entries: dict, fam: str, timings: list[dict]) -> dict:
    """``route`` entries of family ``fam``: per shape class and GEMV row tile, ``{"kernel": "mma"}``
    where the tensor-core kernel at its table config ran the class's timed points of M < 8 faster
    (beyond ``TIE``) than the GEMV at its table config; none elsewhere (the GEMV serves)."""
    sums: dict = {}
    for t in timings:
        if t["family"] != fam or t["m"] >= 8:
            continue
        gbm = min(8, cfg._next_pow2(t["m"]))
        n_pad, k_pad = _n_pad(t["n"]), tlay.pad_k(t["k"], t["bits"])
        mine = entries.get(cfg.shape_class(t["kernel"], t["bits"], gbm if t["kernel"] == "gemv" else t["bm"], n_pad, k_pad))
        if mine is None or tuned_key(mine) != tuned_key(t["config"]):
            continue
        point = sums.setdefault(cfg.shape_class(ROUTE, t["bits"], gbm, n_pad, k_pad), {}).setdefault(
            (t["n"], t["k"], t["m"], t["rate"]), {})
        point[t["kernel"]] = t["us"]
    out = {}
    for key, points in sums.items():
        both = [p for p in points.values() if len(p) == 2 and WRONG not in p.values()]
        if both and sum(p["mma"] for p in both) * (1 + TIE) < sum(p["gemv"] for p in both):
            out[key] = {"kernel": "mma"}
    return out


def build(report: dict, timings: list[dict] = ()) -> dict:
    """The table from a complete report (:func:`missing` empty, else ValueError naming the gaps)."""
    gaps = missing(report)
    if gaps:
        raise ValueError(f"the compile report lacks {len(gaps)} tile(s) the table's candidates need "
                         f"({', '.join(map(str, gaps[:6]))}{', …' if len(gaps) > 6 else ''}): run "
                         "python -m tools.launch_table --compile")
    fams = {}
    for fam in cfg.FAMILY_SMS:
        entries = {key: {kk: v for kk, v in choose(kernel, bits, bm, shapes, fam, report, timings).items()
                         if kk != "maxnreg"}
                   for (kernel, bits, bm, key), shapes in classes().items()}
        fams[fam] = dict(sorted({**entries, **routes(entries, fam, timings)}.items()))
    return {"families": fams}


def dumps_report(report: dict) -> str:
    """The report's summary as JSON, one tile per line, sorted (the file the table is built from)."""
    rows = [dict(zip(REPORT_FIELDS, key), spill=s, regs=g, ipw=round(i, 4))
            for key, (s, g, i) in sorted(report.items(), key=lambda kv: str(kv[0]))]
    return "[\n" + ",\n".join(json.dumps(r, sort_keys=True) for r in rows) + "\n]\n"


def read_report(path: Path = REPORT_FILE) -> dict:
    try:
        rows = json.loads(Path(path).read_text())
        return {tuple(r[f] for f in REPORT_FIELDS): (r["spill"], r["regs"], r["ipw"]) for r in rows}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"launch report {path}: unreadable ({e}); expected a JSON list of "
                         f"{{{', '.join(REPORT_FIELDS)}, spill, regs, ipw}}") from e


def read_timings(path: Path = TIMINGS_FILE) -> list[dict]:
    """The committed GPU timings (a JSON list of records with ``TIMING_FIELDS``); none if absent."""
    path = Path(path)
    if not path.exists():
        return []
    try:
        rows = json.loads(path.read_text())
        for r in rows:
            missing_fields = [f for f in TIMING_FIELDS if f not in r]
            if missing_fields or not isinstance(r["config"], dict):
                raise KeyError(f"a record lacks {missing_fields or ['config as an object']}: {r}")
        return rows
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"launch timings {path}: unreadable ({e}); expected a JSON list of "
                         f"{{{', '.join(TIMING_FIELDS)}}} as bench/launch_configs.py --json writes") from e


def merge_timings(old: list[dict], new: list[dict]) -> list[dict]:
    """``new`` replaces ``old``'s records of the same family × kernel × bits × BM × shape × M ×
    rate × config; sorted, so the committed file diffs cleanly."""
    def ident(r):
        return tuple(r[f] for f in TIMING_FIELDS[:-2]) + tuned_key(r["config"])
    merged = {ident(r): r for r in old}
    merged.update({ident(r): r for r in new})
    return [merged[k] for k in sorted(merged, key=str)]


def dumps_timings(rows: list[dict]) -> str:
    return "[\n" + ",\n".join(json.dumps(r, sort_keys=True) for r in rows) + "\n]\n"


def _read(path: Path) -> dict:
    """A table file's families (none where it cannot be read)."""
    try:
        return json.loads(Path(path).read_text())["families"]
    except (OSError, ValueError, KeyError):
        return {}


def dumps(table: dict) -> str:
    """The table as JSON, one entry per line (diffs stay readable)."""
    fams = [f' "{fam}": {{\n' + ",\n".join(f'  "{k}": {json.dumps(v, sort_keys=True)}' for k, v in e.items()) + "}"
            for fam, e in table["families"].items()]
    return '{"families": {\n' + ",\n".join(fams) + "}}\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--compile", action="store_true",
                     help="compile every tile (the cache reused) instead of reading the committed compile record")
    src.add_argument("--from-summary", action="store_true", help=f"build from the committed {REPORT_FILE.name} alone")
    ap.add_argument("--out", default=str(cfg.TABLE_FILE))
    ap.add_argument("--report-out", default=str(REPORT_FILE), help="where the report's summary is written")
    ap.add_argument("--add-timings", metavar="FILE",
                    help=f"merge a GPU's timings (bench/launch_configs.py --json) into {TIMINGS_FILE.name} first")
    ap.add_argument("--timings", default=str(TIMINGS_FILE), help="the committed timings file")
    a = ap.parse_args(argv)
    try:
        report = read_report() if a.from_summary else load_report(a.compile)
        timings = read_timings(a.timings)
        if a.add_timings:
            timings = merge_timings(timings, read_timings(a.add_timings))
        table = build(report, timings)
    except ValueError as e:
        print(f"launch_table: {e}", file=sys.stderr)
        return 2
    if a.add_timings:
        Path(a.timings).write_text(dumps_timings(timings))
    with open(a.out, "w") as f:
        f.write(dumps(table))
    if not a.from_summary:
        Path(a.report_out).write_text(dumps_report(report))
    n = sum(len(v) for v in table["families"].values())
    packaged = _read(cfg.TABLE_FILE)
    changed = sum(packaged.get(f, {}).get(k) != v for f, e in table["families"].items() for k, v in e.items())
    pipelined = sum(cfg.depth(v) > 1 for e in table["families"].values() for v in e.values())
    routes_ = sum(k.startswith(ROUTE + "/") for e in table["families"].values() for k in e)
    print(f"HEADLINE entries={n} families={len(table['families'])} report_configs={len(report)} "
          f"timings={len(timings)} changed={changed} pipelined={pipelined} routes={routes_}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
