"""The cost model's launch time (``vllm_latq/kernels/triton/cost_model.launch_time``) against what
the GPU checks timed, so that a kernel or table change is judged before a GPU sees it.

The timings: every tensor-core candidate of eight 8B shapes at M = 16, 32, 64 on an H200
(``launch_timings.json``) and the GEMV at M = 1, 2, 4 on the four 8B layers on an H200 and an H100
at the table's configs (``gpu_check_timings.json``), all 4-bit with 1 % outliers. Each point's
registers, shared memory and K-loop instructions per weight come from the compile record (or a
fresh compile: ``--compile``), its resident CTAs and tile bytes from ``tools/compile_proxies.py``.

    python -m tools.cost_fit             # fit error of the committed constants and of launch_table's model,
                                         # and the regret of each one's pick among the timed candidates
    python -m tools.cost_fit --fit       # refit the constants (prints them; commit them in cost_model.py)
    python -m tools.cost_fit --predict   # latq's table configs and bf16 modelled on the 8b shapes, M = 1..64

HEADLINE keys: ``median_err`` / ``worst_err`` (× off, committed constants), ``before_median_err`` /
``before_worst_err`` (launch_table's model), ``regret_median`` / ``regret_max`` and ``before_regret_*``
(the measured time of each model's pick among a point's timed candidates over the fastest's).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import statistics
import sys
from pathlib import Path

from tools import compile_proxies as cp
from tools import launch_table as lt
from tools import triton_compile as tc
from tools import triton_record as tr
from vllm_latq.kernels.triton import configs as cfg
from vllm_latq.kernels.triton import cost_model as cm
from vllm_latq.kernels.triton import layout as tlay

CHECKS_FILE = Path(__file__).with_name("gpu_check_timings.json")
DEVICE_OF = {"sm_90": "h200"}            # launch_timings.json's family → the part that timed it
SHAPES = {"8b.down": (4096, 14336), "8b.gate_up": (28672, 4096), "8b.qkv": (6144, 4096), "8b.o": (4096, 4096)}
FIT_FIELDS = [f.name for f in dataclasses.fields(cm.LaunchFit)]


KERNEL_JOBS = ("gemv", "mma", "gemv_pipe", "mma_pipe")


def _row_index(rows) -> dict:
    """Compile rows (fp16 scales, ELL outliers, sm_90) by (kernel, bits, BM, BN, warps, BR, SPLIT, DEPTH), a
    pipelined kernel's under its unpipelined kernel's name."""
    return {(r["kernel"].split("_")[0], r["bits"], r["BM"], r["BN"], r["num_warps"], r.get("BR"), r["SPLIT"],
             r.get("DEPTH", 1)): r for r in rows
            if r["kernel"] in KERNEL_JOBS and r["cc"] == 90 and r["scales"] == "fp16" and r["outl"] == "ell"}


def compile_rows(fresh: bool) -> dict:
    """The index of :func:`_row_index` from the committed record, or compiled now (``fresh``, cached)."""
    if not fresh:
        return _row_index(tr.read_record()["rows"].values())
    jobs = [j for j in tc.all_jobs(targets=(90,)) if j["kernel"] in KERNEL_JOBS and j["scales"] == "fp16"
            and j["outl"] == "ell"]
    return _row_index(tc.summarize(jobs, tc.run(jobs)))


@functools.lru_cache(maxsize=None)
def bf16_share(device: str) -> float:
    """bf16 ``F.linear``'s share of the device model's HBM peak in the checks (their median): the
    streaming rate a latq kernel is held to."""
    d = cm.DEVICES[device]
    return statistics.median(2 * t["n"] * t["k"] / (t["bf16_us"] * 1e-6) / d.hbm_bw
                             for t in json.loads(CHECKS_FILE.read_text()) if t["device"].lower() == device)


def features(p: dict, rows: dict) -> dict:
    """launch_time's arguments for one timed point (its kernel, tile, depth and shape)."""
    c, bm, bits = p["config"], p["bm"], p["bits"]
    top = max(cfg.GEMV_SPLITS) if p["kernel"] == "gemv" else max(cfg.MMA_SPLITS[bm])
    r = rows[p["kernel"], bits, bm, c["BN"], c["num_warps"], c.get("BR"), top if c["SPLIT"] == top else 1,
             cfg.depth(c)]
    ks = tlay.k_steps(bits, tlay.pad_k(p["k"], bits))
    return dict(kernel=p["kernel"], n=p["n"], m=p["m"], bm=bm, bn=c["BN"], split=c["SPLIT"],
                steps=-(-(ks["nsteps"] + ks["tsteps"]) // c["SPLIT"]), step_weights=c["BN"] * tlay.step_of(bits),
                ipw=r["ipw"], ctas_sm=cp.resident_ctas(r["regs"], c["num_warps"], r["smem"], 90),
                step_bytes=cp.step_bytes(r), bw_eff=bf16_share(p["device"]), depth=cfg.depth(c),
                report=(r["spill_stores"] + r["spill_loads"], r["regs"], r["ipw"]))


def table_config(kernel: str, bits: int, n: int, k: int, m: int) -> tuple[int, dict]:
    """(row tile, the packaged table's config) of a launch on sm_90."""
    bm = min(8, cfg._next_pow2(m)) if kernel == "gemv" else cm.mma_bm(m)
    n_pad, k_pad = -(-n // 16) * 16, tlay.pad_k(k, bits)
    ks = tlay.k_steps(bits, k_pad)
    m_tiles = -(-m // bm)
    can_split = m_tiles == 1 and n_pad <= cfg.SPLITK_MAX_N
    c = cfg.choose(kernel, bits, bm, n_pad, k_pad, ks["nsteps"] + ks["tsteps"], m_tiles, can_split, (9, 0), 132)
    return bm, {t: c[t] for t in lt.TUNED if t in c}


def in_sweep(t: dict) -> bool:
    """A launch_timings.json row of the sweep the constants are fit to: a 4-bit tensor-core candidate
    at M ≥ 16, unpipelined (the other widths, depths and small-M A/Bs feed the table directly)."""
    return t["kernel"] == "mma" and t["bits"] == 4 and t["m"] >= 16 and cfg.depth(t["config"]) == 1


def points() -> list[dict]:
    """Every timed point: the sweep's candidates (:func:`in_sweep`) and gpu_check_timings.json's GEMV rows."""
    out = [dict(t, device=DEVICE_OF[t["family"]]) for t in lt.read_timings()
           if t["family"] in DEVICE_OF and t["us"] != lt.WRONG and in_sweep(t)]
    for t in json.loads(CHECKS_FILE.read_text()):
        bm, c = table_config(t["kernel"], t["bits"], t["n"], t["k"], t["m"])
        out.append(dict(t, device=t["device"].lower(), bm=bm, config=c))
    return out


def predict(p: dict, f: dict, fit: cm.LaunchFit) -> float:
    args = {k: v for k, v in f.items() if k != "report"}
    return cm.launch_time(cm.DEVICES[p["device"]], fit, **args) * 1e6


def before(p: dict, f: dict) -> float:
    """launch_table's ranking model (what chose the table where no GPU timed a class), µs."""
    return lt.modelled_time(p["config"], p["kernel"], p["bits"], p["bm"], p["n"], p["k"], -(-p["n"] // 16) * 16,
                            "sm_90", f["report"]) * 1e6


def errors(pred: list[float], meas: list[float]) -> tuple[float, float]:
    """(median, worst) factor off: exp|log(pred / measured)|."""
    e = [math.exp(abs(math.log(a / b))) for a, b in zip(pred, meas)]
    return statistics.median(e), max(e)


def regrets(pts: list[dict], pred: list[float]) -> list[float]:
    """Per timed (family, shape, M) of the tensor-core sweep: the measured time of the model's pick
    over the fastest candidate's."""
    groups: dict = {}
    for p, t in zip(pts, pred):
        if "family" in p:
            groups.setdefault((p["n"], p["k"], p["m"]), []).append((t, p["us"]))
    return [min(g)[1] / min(u for _, u in g) for g in groups.values()]


def fit_constants(pts, feats, start: cm.LaunchFit, iters: int = 600) -> cm.LaunchFit:
    """Nelder–Mead on the logs of the constants, least squares of log(predicted / measured)."""
    meas = [p["us"] for p in pts]

    def loss(x):
        fit = cm.LaunchFit(*map(math.exp, x))
        return sum(math.log(predict(p, f, fit) / u) ** 2 for p, f, u in zip(pts, feats, meas))
    x0 = [math.log(getattr(start, k)) for k in FIT_FIELDS]
    simplex = [x0] + [[v + (0.5 if i == j else 0.0) for j, v in enumerate(x0)] for i in range(len(x0))]
    vals = [loss(x) for x in simplex]
    for _ in range(iters):
        order = sorted(range(len(simplex)), key=vals.__getitem__)
        simplex, vals = [simplex[i] for i in order], [vals[i] for i in order]
        centre = [sum(x[j] for x in simplex[:-1]) / (len(simplex) - 1) for j in range(len(x0))]
        refl = [c + (c - w) for c, w in zip(centre, simplex[-1])]
        fr = loss(refl)
        if fr < vals[0]:
            exp_ = [c + 2 * (c - w) for c, w in zip(centre, simplex[-1])]
            fe = loss(exp_)
            simplex[-1], vals[-1] = (exp_, fe) if fe < fr else (refl, fr)
        elif fr < vals[-2]:
            simplex[-1], vals[-1] = refl, fr
        else:
            con = [c + 0.5 * (w - c) for c, w in zip(centre, simplex[-1])]
            fc = loss(con)
            if fc < vals[-1]:
                simplex[-1], vals[-1] = con, fc
            else:
                simplex = [simplex[0]] + [[b + 0.5 * (x - b) for b, x in zip(simplex[0], s)] for s in simplex[1:]]
                vals = [vals[0]] + [loss(s) for s in simplex[1:]]
    return cm.LaunchFit(*(round(math.exp(v), 4) for v in simplex[min(range(len(vals)), key=vals.__getitem__)]))


def summary(fit: cm.LaunchFit, fresh: bool = False) -> tuple[list[str], dict]:
    rows = compile_rows(fresh)
    pts = points()
    feats = [features(p, rows) for p in pts]
    meas = [p["us"] for p in pts]
    after = [predict(p, f, fit) for p, f in zip(pts, feats)]
    old = [before(p, f) for p, f in zip(pts, feats)]
    head = {}
    for name, pred in (("", after), ("before_", old)):
        med, worst = errors(pred, meas)
        reg = regrets(pts, pred)
        head.update({f"{name}median_err": f"{med:.2f}", f"{name}worst_err": f"{worst:.2f}",
                     f"{name}regret_median": f"{statistics.median(reg):.2f}", f"{name}regret_max": f"{max(reg):.2f}"})
    lines = [f"{len(pts)} timed points ({sum('family' in p for p in pts)} tensor-core candidates, "
             f"{sum('family' not in p for p in pts)} GEMV at the table's configs); constants {fit}",
             f"{'device':6} {'kernel':6} {'N×K':>11} {'M':>3} {'config':28} {'measured':>9} {'model':>8} {'before':>8}"]
    for p, a, b in zip(pts, after, old):
        conf = " ".join(f"{t}={p['config'][t]}" for t in lt.TUNED if t in p["config"])
        lines.append(f"{p['device']:6} {p['kernel']:6} {p['n']:>5}×{p['k']:<5} {p['m']:>3} {conf:28} {p['us']:9.1f} "
                     f"{a:8.1f} {b:8.1f}")
    return lines, head


def _modelled(rows, fit, dev, kernel, bits, n, k, m, pipelined: bool) -> float:
    """µs the model gives the table's config of ``kernel`` (pipelined: at its ``PIPE_DEPTH``; nan where
    it has none, or its compile row is missing)."""
    bm, c = table_config(kernel, bits, n, k, m)
    if pipelined:
        c = cfg.pipelined(dict(c, BM=bm), kernel, bits)
        if c is None:
            return math.nan
        c.pop("BM")
    p = dict(kernel=kernel, bits=bits, bm=bm, n=n, k=k, m=m, rate=0.01, config=c, device=dev)
    try:
        return predict(p, features(p, rows), fit)
    except KeyError:
        return math.nan


def predictions(fit: cm.LaunchFit, fresh: bool = False, bits: int = 4) -> list[str]:
    """PREDICTED, not measured: per 8b shape and M on the H100 and H200 models, latq at the table's
    config (the kernel apply routes to), the same config pipelined, below 8 rows the tensor-core
    kernel (and pipelined), beside a bf16 weight streamed at the checks' bf16 share of the HBM peak;
    then per M the geometric mean over the shapes of table / pipelined and the worst bf16 / best."""
    rows = compile_rows(fresh)
    cols = ("table", "pipelined", "mma", "mma_pipe")
    lines = [f"PREDICTED by the cost model (tools/cost_fit.py, constants {fit}), {bits}-bit, 1 % outliers; µs",
             f"{'device':6} {'shape':11} {'M':>3} " + " ".join(f"{c:>9}" for c in cols) + f" {'bf16':>8} {'bf16/best':>9}"]
    gains: dict = {}
    for dev in ("h100", "h200"):
        d = cm.DEVICES[dev]
        lines.insert(1, f"{dev}: bf16 F.linear at {bf16_share(dev):.2f} of the HBM peak (the checks' median)")
        for shape, (n, k) in SHAPES.items():
            for m in (1, 2, 4, 8, 16, 32, 64):
                kernel = "gemv" if m < 8 else "mma"
                t = [_modelled(rows, fit, dev, kernel, bits, n, k, m, False),
                     _modelled(rows, fit, dev, kernel, bits, n, k, m, True)]
                t += [_modelled(rows, fit, dev, "mma", bits, n, k, m, pipe) if m < 8 else math.nan
                      for pipe in (False, True)]
                dense = 2 * n * k / (bf16_share(dev) * d.hbm_bw) * 1e6
                best = min(v for v in t if math.isfinite(v))
                g = gains.setdefault((dev, m), [[], []])
                g[0].append(t[0] / t[1] if math.isfinite(t[1]) else 1.0)
                g[1].append(dense / best)
                lines.append(f"{dev:6} {shape:11} {m:>3} " + " ".join(f"{v:9.1f}" for v in t)
                             + f" {dense:8.1f} {dense / best:8.2f}x")
    lines.append("per M: table / pipelined (geometric mean over the shapes), bf16 / best (worst shape) — predicted")
    for (dev, m), (g, b) in gains.items():
        lines.append(f"  {dev} M={m:<3} pipelined {math.exp(statistics.fmean(map(math.log, g))):5.2f}x  "
                     f"best vs bf16 {min(b):5.2f}x")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fit", action="store_true", help="refit the constants from the committed ones")
    ap.add_argument("--predict", action="store_true", help="model latq's table configs and bf16 on the 8b shapes")
    ap.add_argument("--compile", action="store_true", help="compile the sm_90 rows now instead of reading the record")
    a = ap.parse_args(argv)
    fit = cm.SM90_FIT
    try:
        if a.fit:
            rows, pts = compile_rows(a.compile), points()
            fit = fit_constants(pts, [features(p, rows) for p in pts], fit)
            print(f"fitted: {fit} (commit it as cost_model.SM90_FIT)")
        if a.predict:
            print("\n".join(predictions(fit, a.compile)))
        lines, head = summary(fit, a.compile)
    except (ValueError, KeyError, OSError) as e:
        print(f"cost_fit: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    print("HEADLINE " + " ".join(f"{k}={v}" for k, v in head.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
