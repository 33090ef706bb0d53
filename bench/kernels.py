"""latq Triton kernels: layer time vs dense bf16 ``F.linear`` on a GPU; static report everywhere.

GPU part (a CUDA device, unless --static-only; the harness is :mod:`bench.kernel_timing`): per
layer shape × inlier bits × outlier rate × M, the time of **latq** (``TritonKernel.apply`` with
the kernel it picks, and each other kernel forced: ``--breakdown``), **dense** ``F.linear`` with
a bf16 (``--dtype``) weight, and a **copy** of latq's served bytes; ``--scales fp16-g128,s4-g64,…``
times each layer in each group-scale form against the first. Reported: latq and dense µs,
ratio = dense / latq, served bits/weight, GB/s, % of copy, and per layer the first M at which
latq is slower than dense.

Static part (unless --no-static): every kernel config compiled offline for sm_80/86/89/90
(:mod:`tools.triton_compile`: registers, spills, shared memory, SASS counts) and the
bytes-moved model (the memory-bound speedup ceiling). Cost model (always):
:mod:`vllm_latq.kernels.triton.cost_model`'s prediction per shape × bits × rate × M ≥ 8 on the
A100 and H100 models and on the GPU present.

Ends with ``HEADLINE key=value …`` (docs/BENCHMARKS.md lists the keys): the static totals, and
``gpu=<name>`` with the measured ratios, or ``gpu=none`` without a CUDA device.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import sys
from collections import defaultdict

import torch

from bench import gpu_figures
from bench.kernel_peers import PEERS, parse_peers
from bench.kernel_timing import GROUP, KERNELS, SCALES, VARIANTS, Point, gpu_bench, number_cell
from vllm_latq.kernels.triton import layout as tlay

# (out features N, in features K). Llama-3-8B: hidden 4096, 32 query + 8 KV heads of 128,
# MLP 14336 — vLLM's fused qkv and gate_up; the 4096×14336 target layer first (within a bit
# width the --budget-s guard skips from the end). Qwen3-8B (MLP 12288): the paper's Figure 5 setup.
SHAPES = {"8b.down": (4096, 14336), "8b.gate_up": (28672, 4096), "8b.qkv": (6144, 4096), "8b.o": (4096, 4096),
          "qwen3-8b.down": (4096, 12288), "qwen3-8b.gate_up": (24576, 4096), "qwen3-8b.qkv": (6144, 4096),
          "qwen3-8b.o": (4096, 4096)}
RATES = (0.0, 0.005, 0.01, 0.02, 0.05)       # the bytes model's rates
BITS = tlay.WIDTHS
# GPU subsets. Default: the target's configuration (4-bit, 1 % outliers) on the four
# Llama-3-8B shapes; --quick: two shapes, five M (and the static report of the heaviest configs).
DEFAULT = dict(shapes="8b", bits="4", rates="0.01", m="1,2,4,8,16,32,64,128,256")
QUICK = dict(shapes="8b.down,8b.o", bits="4", rates="0.01", m="1,4,16,64,256")
TARGET_WEIGHTS = 4096 * 14336   # the target: 4096×14336-class layers (8b.down, 8b.gate_up)
DRY_SCALE = 64                  # --dry-run: N and K divided by this, K rounded up to whole groups of 128


# ----------------------------------------------------------------------------- command line

def parse_shapes(spec: str) -> list[tuple[str, int, int]]:
    """``8b.o,8b.down,4096x14336,8b`` → [(name, N, K)]: table names, ``NxK`` literals, or a
    table prefix (``8b`` = every ``8b.*``), duplicates dropped, order kept."""
    out = []
    for tok in (t.strip() for t in spec.split(",") if t.strip()):
        lit = re.fullmatch(r"(\d+)[xX×](\d+)", tok)
        if tok in SHAPES:
            names = [tok]
        elif lit:
            out.append((f"{int(lit[1])}x{int(lit[2])}", int(lit[1]), int(lit[2])))
            continue
        else:
            names = [s for s in SHAPES if s.startswith(tok + ".")]
            if not names:
                raise ValueError(f"unknown shape {tok!r}: use NxK or one of {', '.join(SHAPES)} "
                                 f"(or a prefix: {', '.join(sorted({s.split('.')[0] for s in SHAPES}))})")
        out += [(s, *SHAPES[s]) for s in names]
    if not out:
        raise ValueError("no shapes given")
    return list(dict.fromkeys(out))


def _list(spec: str, conv, ok, what: str) -> list:
    vals = [conv(t) for t in spec.split(",") if t.strip()]
    bad = [v for v in vals if not ok(v)]
    if not vals or bad:
        raise ValueError(f"{what}: {spec!r}")
    return list(dict.fromkeys(vals))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    part = ap.add_mutually_exclusive_group()
    part.add_argument("--static-only", action="store_true", help="no GPU timing even if a GPU is present")
    part.add_argument("--no-static", action="store_true", help="skip the offline-compile report and bytes model")
    ap.add_argument("--quick", action="store_true",
                    help=f"static report of the heaviest configs only; GPU subset {QUICK} (≤ 3 min)")
    ap.add_argument("--shapes", help=f"NxK literals or names ({', '.join(SHAPES)}) or a prefix (8b); "
                                     f"default {DEFAULT['shapes']}")
    ap.add_argument("--bits", help=f"inlier bits, of 2,3,4,5; default {DEFAULT['bits']}")
    ap.add_argument("--rates", help=f"outlier rates (fractions); default {DEFAULT['rates']}")
    ap.add_argument("--m", help=f"activation rows M; default {DEFAULT['m']}")
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16",
                    help="activations and the dense baseline's weight")
    ap.add_argument("--breakdown", default=",".join(KERNELS),
                    help="kernels also timed forced (gemv,mma,dequant), the picked kernel's table config "
                         "pipelined (pipelined) and the tensor-core kernel's (mma_pipelined), or none")
    ap.add_argument("--scales", default=SCALES, help="group-scale forms timed, the first the baseline of the others: "
                    "fp16-gG (fp16 scales, group G) or s4-gG (4-bit coded scales, --scale-bits 4); "
                    f"default {SCALES}")
    ap.add_argument("--rep-ms", type=float, default=5.0, help="do_bench_cudagraph rep (ms per measurement)")
    ap.add_argument("--budget-s", type=float, default=210.0,
                    help="start no new layer configuration after this many seconds of the GPU part")
    ap.add_argument("--peers", default=",".join(PEERS),
                    help=f"peers timed beside latq at 4-bit g128 (bench/kernel_peers.py): of {','.join(PEERS)}, or none")
    ap.add_argument("--json", help="write the GPU points here in docs/gpu/latest.json's schema (bench/gpu_figures.py)")
    ap.add_argument("--timings-json", help="write every GEMV / tensor-core launch timed here as launch timings "
                    "(python -m tools.launch_table --from-summary --add-timings FILE)")
    ap.add_argument("--dry-run", action="store_true",
                    help=f"the GPU part on the CPU in Triton's interpreter (TRITON_INTERPRET=1), every shape about "
                         f"1/{DRY_SCALE} of its size, a fake timer: the pipeline and its output, no speed")
    a = ap.parse_args(argv)
    base = QUICK if a.quick else DEFAULT
    try:
        a.shapes = parse_shapes(a.shapes or base["shapes"])
        a.bits = _list(a.bits or base["bits"], int, lambda b: b in BITS, "bits must be of 2,3,4,5")
        a.rates = _list(a.rates or base["rates"], float, lambda r: 0 <= r < 0.5, "rates must be in [0, 0.5)")
        a.m = sorted(_list(a.m or base["m"], int, lambda m: m >= 1, "M must be ≥ 1"))
        a.breakdown = [] if a.breakdown == "none" else \
            _list(a.breakdown, str.strip, lambda k: k in KERNELS + VARIANTS,
                  f"breakdown entries must be of {KERNELS + VARIANTS}")
        a.scales = list(dict.fromkeys(_list(a.scales, str.strip, lambda f: re.fullmatch(r"(fp16|s4)-g\d+", f),
                                            "scale forms must be fp16-gG or s4-gG")))
        a.peers = parse_peers(a.peers)
    except ValueError as e:
        ap.error(str(e))
    return a


# ----------------------------------------------------------------------------- bytes model

def outlier_counts(n: int, k: int, rate: float, seed: int = 0) -> torch.Tensor:
    """Per-row outlier counts of an n×k layer with outliers placed uniformly at ``rate``."""
    if rate == 0:
        return torch.zeros(n, dtype=torch.int64)
    g = torch.Generator().manual_seed(seed)
    return torch.binomial(torch.full((n,), float(k)), torch.full((n,), rate), generator=g).long()


def layer_bytes(n: int, k: int, bits: int, rate: float, m: int = 1) -> dict:
    """Bytes one call moves: weights in the Triton layout (+ activations in, output out)."""
    counts = outlier_counts(n, k, rate)
    crow = torch.zeros(n + 1, dtype=torch.int64)
    crow[1:] = torch.cumsum(counts, 0)
    n_pad = math.ceil(n / 16) * 16
    k_pad = tlay.pad_k(k, bits)
    inl = tlay.inlier_bytes(n_pad, bits, k_pad)
    sc = n_pad * math.ceil(k_pad / GROUP) * 2
    nnz = int(crow[-1])
    eb = 4 if k <= 32768 else 6                # compact entries: int16/int32 column + fp16 value (SSQR)
    if nnz:
        mod = tlay.outlier_model(crow, n_pad, m=m, entry_bytes=eb)
        out = (eb * mod["slots"] + 4 * (n_pad // 16 + 1)) if mod["mode"] == "ell" else (4 + eb) * nnz + 4 * (n_pad + 1)
        mode, pad = mod["mode"], mod["padding"]
    else:
        out, mode, pad = 0, "none", 1.0
    act = 2 * m * (k + n)
    w = inl + sc + out
    return dict(weights=w, total=w + act, per_weight=w / (n * k), mode=mode, padding=pad,
                bf16_total=2 * n * k + act)


def bytes_model(m: int = 1, shapes=None) -> tuple[list[str], dict]:
    """The memory-bound ceiling bf16 bytes / latq bytes over ``shapes`` (default: 8b.*)."""
    shapes = shapes or parse_shapes("8b")
    lines = [f"bytes-moved model, M={m} (weights in the Triton layout + bf16 activations in/out), "
             f"group {GROUP}; ceiling = bf16 bytes / latq bytes (memory-bound)",
             f"{'bits':>4} {'rate':>6} {'B/weight':>8} {'outl':>5} {'pad':>5} " +
             " ".join(f"{name[-10:]:>10}" for name, _, _ in shapes) + f" {'all':>8}"]
    ceil = {}
    for bits in BITS:
        for rate in RATES:
            tot, tot16, row = 0.0, 0.0, []
            pw, mode, pad = [], "", 1.0
            for _, n, k in shapes:
                b = layer_bytes(n, k, bits, rate, m)
                row.append(b["bf16_total"] / b["total"])
                tot += b["total"]
                tot16 += b["bf16_total"]
                pw.append(b["per_weight"])
                mode, pad = b["mode"], b["padding"]
            ceil[bits, rate] = tot16 / tot
            lines.append(f"{bits:>4} {rate * 100:>5.1f}% {statistics.mean(pw):>8.4f} {mode:>5} {pad:>5.2f} " +
                         " ".join(f"{r:>9.2f}x" for r in row) + f" {tot16 / tot:>7.2f}x")
    lines.append(f"bf16: 2.0000 B/weight. Per-weight bytes: b/8 + 2/{GROUP} (fp16 scales) + outliers "
                 f"(ELL-16: 4 B per padded slot, int16 column + fp16 value; CSR: 8 B per entry); "
                 f"'pad' = ELL slots / outliers of the last layer (16 rows × K columns, random placement).")
    return lines, ceil


# ----------------------------------------------------------------------------- static report

def static_report(quick: bool = False) -> tuple[list[str], dict]:
    from tools import triton_compile as tc
    jobs = tc.all_jobs(quick=quick)
    rows = tc.summarize(jobs, tc.run(jobs))
    lines = ["static report: every kernel config compiled offline (triton.compile → ptxas; "
             "nvdisasm SASS counts); spill = spill store + load bytes", tc.report(rows)]
    agg = defaultdict(lambda: dict(n=0, regs=0, spill=0, smem=0, limit=0, err=0))
    for r in rows:
        a = agg[r["kernel"], r["cc"]]
        a["n"] += 1
        if "error" in r:
            a["err"] += 1
            continue
        a["regs"] = max(a["regs"], r["regs"] or 0)
        a["spill"] += (r["spill_stores"] or 0) + (r["spill_loads"] or 0)
        a["smem"] = max(a["smem"], r["smem"])
        a["limit"] = r["smem_limit"]
    lines.append("summary per kernel and target: configs, max registers, spill bytes, max smem / limit, errors")
    for (kern, cc), a in sorted(agg.items()):
        lines.append(f"  {kern:5} sm_{cc}: {a['n']:4} configs  max regs {a['regs']:3}  spills {a['spill']:5} B  "
                     f"smem {a['smem']:6} / {a['limit']} B  errors {a['err']}")
    # ALU-issue model of the M = 1 GEMV K loop vs its memory roofline (A100 numbers)
    issue = 108 * 4 * 32 * 1.41e9          # lane-instructions/s: 4 schedulers × 32 lanes per SM
    lines.append("M=1 GEMV K loop (sm_80, median over configs): SASS instructions per weight → "
                 "ALU-issue ceiling vs HBM ceiling (1.555 TB/s, weights at b/8 + 2/128 B)")
    for bits in BITS:
        ipw = sorted(r["ipw"] for r in rows if "error" not in r and r["kernel"] == "gemv" and r["BM"] == 1
                     and r["bits"] == bits and r["cc"] == 80 and r["scales"] == "fp16")
        if ipw:
            med = ipw[len(ipw) // 2]
            alu, mem = issue / med, 1.555e12 / (bits / 8 + 2 / 128)
            lines.append(f"  {bits}-bit: {med:.2f} instr/weight → {alu / 1e12:.1f} T weights/s (ALU) vs "
                         f"{mem / 1e12:.1f} T weights/s (memory): {'memory' if mem < alu else 'ALU'}-bound")
    lines += mma_ipw_lines(rows)
    totals = dict(configs=len(rows), spills=sum(a["spill"] for a in agg.values()),
                  errors=sum(a["err"] for a in agg.values()), max_regs=max(a["regs"] for a in agg.values()),
                  smem_over=sum(1 for r in rows if "error" not in r and r["smem"] > r["smem_limit"]))
    return lines, totals


def mma_ipw_lines(rows: list[dict]) -> list[str]:
    """The tensor-core K loop's instructions per weight per program, median over each BM's
    configs with fp16 scales, next to the cost model's constants (``triton_model.MMA_IPW``, sm_80)."""
    rows = [r for r in rows if r.get("scales") == "fp16"]
    from vllm_latq.kernels.triton.cost_model import MMA_IPW
    lines = ["MMA K loop, SASS instructions per weight per BM-row program (median over configs) "
             "vs the cost model's constant:"]
    for (bits, bm), model in sorted(MMA_IPW.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        med = {cc: statistics.median(r["ipw"] for r in rows if "error" not in r and r["kernel"] == "mma"
                                     and (r["bits"], r["BM"], r["cc"]) == (bits, bm, cc))
               for cc in (80, 90) if any(r["kernel"] == "mma" and (r["bits"], r["BM"], r["cc"]) == (bits, bm, cc)
                                          and "error" not in r for r in rows)}
        got = "  ".join(f"sm_{cc} {v:5.2f}" for cc, v in med.items()) or "not compiled"
        lines.append(f"  {bits}-bit BM={bm:>2}: {got}   model {model:5.2f} ({model * 16 / bm:.2f} per 16 rows)")
    return lines


# ----------------------------------------------------------------------------- cost model

MODEL_DEVICES = ("a100", "h100")


def cost_model(a, props=None) -> tuple[list[str], dict]:
    """The cost model's (``triton_model``) prediction for each shape × bits × rate × M of
    ``a``: µs of the MMA kernel, of dequantise-once + GEMM and of dense ``F.linear``, the
    path ``TritonKernel.apply`` takes (gemv below M = 8 is not modelled: its M = 1 ceiling
    is the bytes model's) and dense / latq. On the A100 and H100 models, and on ``props``
    (a GPU's properties) when given. HEADLINE keys: the worst predicted 4-bit 1 % ratio at
    8 ≤ M ≤ 256 over the target layers, per model."""
    from vllm_latq.kernels.triton.cost_model import large_m_threshold, model_times
    from vllm_latq.kernels.triton.dequant import MMA_MAX_M
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    devs = list(MODEL_DEVICES) + ([props] if props is not None else [])
    lines = [f"cost model (kernels/triton/cost_model.py), {a.dtype}: µs per call; path = the one TritonKernel.apply "
             f"takes for M ≥ 8; ratio = dense / path", f"{'device':8} {'shape':16} {'bits':>4} {'rate':>5} {'M':>4} "
             f"{'mma_us':>8} {'deq_us':>8} {'dense_us':>8} {'path':>7} {'ratio':>6}"]
    head = {}
    for dev in devs:
        name = dev if isinstance(dev, str) else "gpu"
        worst = math.inf
        for label, n, k in a.shapes:
            for bits in a.bits:
                for rate in a.rates:
                    nnz = int(outlier_counts(n, k, rate).sum())
                    th = large_m_threshold(n, k, bits, nnz, dtype, dev, GROUP)
                    lines.append(f"{name:8} {label:16} {bits:>4} {rate * 100:>4.1f}%: the model's crossover to "
                                 f"dequant at M = {th} (served: above M = {MMA_MAX_M})")
                    for m in (m for m in a.m if m >= 8):
                        t = model_times(m, n, k, bits, nnz, dtype, dev, GROUP)
                        path = "dequant" if m > MMA_MAX_M else "mma"
                        ratio = t["unquantized"] / t["mma" if path == "mma" else "deq"]
                        lines.append(f"{name:8} {label:16} {bits:>4} {rate * 100:>4.1f}% {m:>4} {t['mma'] * 1e6:>8.1f} "
                                     f"{t['deq'] * 1e6:>8.1f} {t['unquantized'] * 1e6:>8.1f} {path:>7} {ratio:>5.2f}x")
                        if bits == 4 and rate == 0.01 and m <= 256 and n * k >= TARGET_WEIGHTS:
                            worst = min(worst, ratio)
        if math.isfinite(worst):
            head[f"model_min_4b_1pct_ratio_m_le_256_{name}"] = f"{worst:.2f}"
    return lines, head


# ----------------------------------------------------------------------------- report

def first_losses(points: list[Point]) -> dict:
    """{(shape, bits, rate, scales): the smallest measured M with latq slower than dense, or None}."""
    out = {}
    for p in sorted(points, key=lambda p: p.m):
        key = (p.shape, p.bits, p.rate, p.scales)
        out.setdefault(key, None)
        if out[key] is None and not p.ratio >= 1:    # nan (failed) counts as a loss
            out[key] = p.m
    return out


def crossover_lines(points: list[Point]) -> list[str]:
    lines = []
    for (shape, bits, rate, scales), m in first_losses(points).items():
        top = max(p.m for p in points if (p.shape, p.bits, p.rate, p.scales) == (shape, bits, rate, scales))
        lines.append(f"  {shape:16} {bits}-bit {rate * 100:4.1f}% {scales}: " +
                     (f"slower than dense from M={m}" if m else f"faster than dense at every M ≤ {top}"))
    return lines


def _target(points, m=None, all_shapes=False) -> list[Point]:
    """The target's points: 4-bit, 1 % outliers, fp16 scales at group 128, M ≤ 256 (or
    M = ``m``), on layers of ≥ 4096×14336 weights (8b.down, 8b.gate_up; ``all_shapes``: every layer)."""
    return [p for p in points if p.bits == 4 and p.rate == 0.01 and p.scales == SCALES and p.m <= 256
            and m in (None, p.m) and (all_shapes or p.n * p.k >= TARGET_WEIGHTS)]


def scale_form_lines(points: list[Point]) -> tuple[list[str], dict]:
    """Each group-scale form's latq time against the first form's (the baseline, ``--scales``)
    at the same shape, bits, rate and M, with both forms' streamed bits/weight; HEADLINE keys
    ``<form>_vs_<base>_m<M>``: the worst (lowest) base/form time ratio over the layers."""
    forms = list(dict.fromkeys(p.scales for p in points))
    if len(forms) < 2:
        return [], {}
    base = {(p.shape, p.bits, p.rate, p.m): p for p in points if p.scales == forms[0]}
    lines = [f"group-scale forms against {forms[0]} (latq time ratio {forms[0]} / form; bits/weight streamed):"]
    ratios = {}
    for p in points:
        b = base.get((p.shape, p.bits, p.rate, p.m))
        if p.scales == forms[0] or b is None:
            continue
        r = b.latq_us / p.latq_us
        ratios.setdefault((p.scales, p.m), []).append(r)
        lines.append(f"  {p.shape:16} {p.bits}-bit {p.rate * 100:4.1f}% M={p.m:<4} {p.scales} {number_cell(r, '.3f', 6)}x "
                     f"({p.bits_per_weight:.3f} vs {b.bits_per_weight:.3f} b/w)")
    key = lambda f: re.sub(r"\W", "_", f)  # noqa: E731
    return lines, {f"{key(f)}_vs_{key(forms[0])}_m{m}": f"{_worst(v):.3f}" for (f, m), v in ratios.items()}


def _worst(values) -> float:
    """Minimum, a failed (nan) value counting as 0; nan when there is none."""
    vals = [v if math.isfinite(v) else 0.0 for v in values]
    return min(vals) if vals else math.nan


def gpu_summary(res: dict) -> tuple[list[str], dict]:
    """Crossover and target lines, and the GPU HEADLINE keys: the worst over the target's
    points (``_target``), ``na`` where none was measured."""
    pts = res["points"]
    m1, upto = _target(pts, m=1), _target(pts)
    worst_m1, worst = _worst(p.ratio for p in m1), _worst(p.ratio for p in upto)
    losses = [m for m in first_losses(upto).values() if m is not None]
    lines = ["first M where latq is slower than dense, per layer configuration:"] + crossover_lines(pts)
    form_lines, form_head = scale_form_lines(pts)
    variant_lines, variant_head = gpu_figures.variant_lines(pts)
    lines += form_lines + variant_lines + gpu_figures.peer_table(pts) + gpu_figures.target_lines(pts)
    if upto:
        lines.append(f"target (4-bit 1 %, layers ≥ 4096×14336 weights): M=1 ≥ 2.5× dense: worst "
                     f"{worst_m1:.2f}× ({'met' if worst_m1 >= 2.5 else 'NOT met'}); ≥ 1× at every M ≤ 256: worst "
                     f"{worst:.2f}× ({'met' if worst >= 1 else 'NOT met'})")
    na = lambda v, f: f"{v:{f}}" if math.isfinite(v) else "na"  # noqa: E731
    head = {"gpu": re.sub(r"\s+", "_", res["device"].strip()),
            "m1_4b_1pct_ratio": na(worst_m1, ".2f"),
            "min_4b_1pct_ratio_m_le_256": na(worst, ".2f"),
            "first_loss_m_4b_1pct": (min(losses) if losses else "none") if upto else "na",
            "m1_4b_1pct_pct_of_copy": na(_worst(p.pct_copy for p in m1), ".1f"),
            "m1_4b_1pct_ratio_all": na(_worst(p.ratio for p in _target(pts, m=1, all_shapes=True)), ".2f"),
            "copy_gbps": f"{res['copy_gbps']:.0f}",
            **form_head, **variant_head, **gpu_figures.headline_keys(pts, res.get("peers_absent", {})),
            "points": len(pts), "wrong": sum(p.bad for p in pts), "skipped": len(res["skipped"]),
            "gpu_s": f"{res['seconds']:.0f}"}
    return lines, head


def headline(static: dict | None, ceilings: dict | None, gpu: dict | str, model: dict | None = None) -> str:
    """``HEADLINE spills=… <static totals> <bytes-model ceilings> <cost-model ratios> gpu=…
    <GPU keys>``; ``gpu`` is gpu_summary's keys or a word (none / skipped) when no GPU part ran."""
    head = {}
    if static is not None:
        head = dict(spills=static["spills"], configs=static["configs"], targets="sm_80,sm_86,sm_89,sm_90",
                    errors=static["errors"], max_regs=static["max_regs"], smem_over_limit=static["smem_over"])
    if ceilings is not None:
        head.update({f"ceiling_m1_{b}bit_1pct": f"{ceilings[b, 0.01]:.2f}" for b in BITS})
    head.update(model or {})
    head.update(gpu if isinstance(gpu, dict) else {"gpu": gpu})
    return "HEADLINE " + " ".join(f"{k}={v}" for k, v in head.items())


def dry_run(a) -> dict:
    """The GPU part's pipeline on the CPU: Triton's interpreter, shapes scaled down by DRY_SCALE
    (their names kept), the fake timer (``vllm_latq.testing.timers``): no figure is a speed."""
    from bench.kernel_timing import sweep
    from vllm_latq.kernels.triton import kernel as tk
    from vllm_latq.testing.timers import FakeTimer
    if not tk.INTERPRET:
        raise SystemExit("bench.kernels --dry-run: set TRITON_INTERPRET=1 (Triton's interpreter runs the kernels)")
    os.environ[tk.ENV_INTERPRET_OK] = "1"
    a.shapes = [(name, max(16, n // DRY_SCALE), -(-k // DRY_SCALE // 128) * 128) for name, n, k in a.shapes]
    return sweep(a, torch.device("cpu"), "dry run (CPU interpreter, fake timer)", 1, FakeTimer(),
                 lambda s: print(s, flush=True), big=1 << 12)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.dry_run:
        lines, gpu = gpu_summary(dry_run(a))
        print("\n".join(lines))
        print(headline(None, None, gpu), flush=True)
        return 0
    gpu_part = torch.cuda.is_available() and not a.static_only
    if gpu_part:       # real kernels: before anything (the static part too) imports triton_kernels
        os.environ.pop("TRITON_INTERPRET", None)
    static = ceilings = None
    if not a.no_static:
        lines, static = static_report(a.quick)
        print("\n".join(lines) + "\n")
        for m in (1, 8):
            bl, ceil = bytes_model(m, a.shapes)
            ceilings = ceilings or ceil
            print("\n".join(bl) + "\n")
    props = torch.cuda.get_device_properties(0) if gpu_part else None
    lines, model_head = cost_model(a, props)
    print("\n".join(lines) + "\n")
    if a.static_only:
        print("no GPU timing (--static-only)")
        gpu = "skipped"
    elif not gpu_part:
        print("no GPU timing: no CUDA device on this machine (torch.cuda.is_available() is False)")
        gpu = "none"
    else:
        res = gpu_bench(a, log=lambda s: print(s, flush=True))
        lines, gpu = gpu_summary(res)
        print("\n".join(lines))
    print(headline(static, ceilings, gpu, model_head), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
