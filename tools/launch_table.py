"""Write the packaged launch-config table (``vllm_latq/kernels/triton/launch_configs.json``):
one config per GPU family × shape class of the shapes served most (8B-class projections at
TP 1 and 2), chosen offline so that serving never autotunes.

Per shape class the candidates are the kernel's own (:func:`~vllm_latq.kernels.triton.configs.candidates`,
the autotuner's pruning); a candidate the offline compile report (:mod:`tools.triton_compile`)
shows spilling on the family's target is dropped; the rest are ranked by the cost model's
device constants (:mod:`~vllm_latq.kernels.triton.cost_model`) with the report's registers
(resident programs per SM → wave quantisation) and K-loop instructions per weight, plus the
split-K partials' traffic. A candidate the report does not cover is ranked by
:func:`~vllm_latq.kernels.triton.configs.rule` alone (the serving fallback), behind those it
covers. ``--compile`` compiles the missing report entries first (minutes per family).

    python -m tools.launch_table [--compile] [--out PATH]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math

import triton

from vllm_latq.kernels.triton import configs as cfg
from vllm_latq.kernels.triton import cost_model as cm
from vllm_latq.kernels.triton import layout as tlay

# (N, K) of 8B-class dense projections (qkv, o, gate+up, down) at TP 1 and TP 2
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
          (3072, 4096), (4096, 2048), (14336, 4096), (4096, 7168)]
ROW_TILES = {"gemv": (1, 2, 4, 8), "mma": cm.MMA_BMS}
WARPS_PER_SM = {"sm_80": 64, "sm_86": 48, "sm_89": 48, "sm_90": 64}


def family_model(fam: str) -> cm.DeviceModel:
    base = cm.DEVICES["h100" if fam == "sm_90" else "a100"]
    sms = cfg.FAMILY_SMS[fam]
    return dataclasses.replace(base, sms=sms, issue=base.issue * sms / base.sms, tc_flops=base.tc_flops * sms / base.sms)


def load_report(compile_missing: bool) -> dict:
    """{(kernel, bits, BM, BN, warps, BR, cc): (worst spill bytes, max registers, median i/w)}
    over the outlier layouts, scale forms and splits the report holds."""
    from tools import triton_compile as tc
    jobs = [j for j in tc.all_jobs() if j["kernel"] in ROW_TILES]
    if compile_missing:
        res = tc.run(jobs)
    else:
        res = {}
        for k in ROW_TILES:
            p = tc.CACHE / f"{tc.source_hash(k)}.json"
            if p.exists():
                res.update(json.loads(p.read_text()))
    rows = [r for r in tc.summarize([j for j in jobs if tc.job_key(j) in res], res) if "error" not in r]
    out: dict = {}
    for r in rows:
        key = (r["kernel"], r["bits"], r["BM"], r["BN"], r["num_warps"], r.get("BR"), r["cc"])
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


def choose(kernel: str, bits: int, bm: int, n: int, k: int, fam: str, report: dict) -> dict:
    n_pad = -(-n // tlay.ROWS) * tlay.ROWS
    k_pad = tlay.pad_k(k, bits)
    ks = tlay.k_steps(bits, k_pad)
    can_split = bm <= cfg.SPLITK_BM and n_pad <= cfg.SPLITK_MAX_N
    cands = cfg.candidates(kernel, bits, bm, n_pad, ks["nsteps"] + ks["tsteps"], can_split)
    cc = int(fam[3:])
    reps = {id(c): report.get((kernel, bits, bm, c["BN"], c["num_warps"], c.get("BR"), cc)) for c in cands}
    clean = [c for c in cands if reps[id(c)] is None or reps[id(c)][0] == 0] or cands
    if all(reps[id(c)] is not None for c in clean):
        return min(clean, key=lambda c: modelled_time(c, kernel, bits, bm, n, k, n_pad, fam, reps[id(c)]))
    return cfg.rule(clean, n_pad, 1, cfg.FAMILY_SMS[fam])


def build(report: dict) -> dict:
    fams = {}
    for fam in cfg.FAMILY_SMS:
        entries = {}
        for kernel, bms in ROW_TILES.items():
            for bits in tlay.WIDTHS:
                for bm in bms:
                    for n, k in SHAPES:
                        n_pad = -(-n // tlay.ROWS) * tlay.ROWS
                        key = cfg.shape_class(kernel, bits, bm, n_pad, tlay.pad_k(k, bits))
                        c = choose(kernel, bits, bm, n, k, fam, report)
                        entries[key] = {kk: v for kk, v in c.items() if kk != "maxnreg"}
        fams[fam] = dict(sorted(entries.items()))
    return {"families": fams}


def dumps(table: dict) -> str:
    """The table as JSON, one entry per line (diffs stay readable)."""
    fams = [f' "{fam}": {{\n' + ",\n".join(f'  "{k}": {json.dumps(v, sort_keys=True)}' for k, v in e.items()) + "}"
            for fam, e in table["families"].items()]
    return '{"families": {\n' + ",\n".join(fams) + "}}\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compile", action="store_true", help="compile the report entries the cache lacks first")
    ap.add_argument("--out", default=str(cfg.TABLE_FILE))
    a = ap.parse_args(argv)
    report = load_report(a.compile)
    table = build(report)
    with open(a.out, "w") as f:
        f.write(dumps(table))
    n = sum(len(v) for v in table["families"].values())
    print(f"HEADLINE entries={n} families={len(table['families'])} report_configs={len(report)}")


if __name__ == "__main__":
    main()
