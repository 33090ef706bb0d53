"""The study's report: docs/RESULTS.md (protocol, the claims table, per model the Table-3 grid,
every configuration, variants beside their defaults, certificate, tr(D), layer-level peers), the
Pareto plot beside it, and the ``HEADLINE`` line the script ends with."""
from __future__ import annotations

import math
import os
import statistics
from pathlib import Path

from .claims import PEERS, claims_table
from .configs import E8_FAMILY, EXTRA_TAGS, FAMILIES, TAGGED, slug
from .e8 import e8_section
from .curves import frontier, global_front, points, series_of
from .served import served_bits
from .ordering import LAYER_TYPES, ORDERS
from .runner import Settings
from .summary import cert_summary, fmt_delta, fmt_ppl


def compute_hours(by_model: dict[str, list[dict]], ordering: dict[str, dict]) -> tuple[float, float]:
    """(study proper, extras) in hours of elapsed time: a configuration that ran beside others
    counts its share of its wall time."""
    def secs(extra: bool) -> float:
        return sum((r["quantize_seconds"] + r["eval_seconds"]) / r.get("jobs", 1) for res in by_model.values()
                   for r in res if (r["tag"] in EXTRA_TAGS) == extra)
    return (secs(False) + sum(o.get("seconds", 0) for o in ordering.values())) / 3600, secs(True) / 3600


def headline(by_model: dict[str, list[dict]], ordering: dict[str, dict]) -> str:
    """The study's last line: per model the perplexities of the paper's headline configurations
    and our GPTQ's gap to each peer (%), the certificate's largest per-row ratio, compute hours."""
    out = []
    for model, res in by_model.items():
        r = {x["label"]: x for x in res}
        short = model.split("-")[0]
        for label in ("bf16", "HPTQ-3.125", "GPTQ-3b", "HPTQ-4.125", "SSQR-1%-4b", "GPTQ-4b"):
            if label in r:
                out.append(f"{short}_{slug(label).replace('-', '_')}_ppl={r[label]['ppl']:.2f}")
                if label != "bf16" and (t := served_bits(r[label], "triton")) is not None:
                    out.append(f"{short}_{slug(label).replace('-', '_')}_served_triton={t:.3f}")
        for tag in PEERS:
            for b in (3, 4):
                v = r.get(f"GPTQ-{b}b-{tag}")
                base = v and r.get(f"GPTQ-{b}b" + (f"-{v['base']}" if v.get("base") else ""))
                if v and base:
                    out.append(f"{short}_{tag}{b}_vs_ours_pct={100 * (v['ppl'] / base['ppl'] - 1):+.2f}")
        for b in (3, 4):   # ours given llm-compressor's scales, against it
            v, peer = r.get(f"GPTQ-{b}b-llmc-scales"), r.get(f"GPTQ-{b}b-llmc")
            if v and peer:
                out.append(f"{short}_ours_llmc_scales{b}_vs_llmc_pct={100 * (v['ppl'] / peer['ppl'] - 1):+.2f}")
    cs = cert_summary([x for res in by_model.values() for x in res])
    if cs:
        out.append(f"cert_row_max={cs['row_max']:.3f} cert_median={cs['ratio_median']:.3f}")
    core, extra = compute_hours(by_model, ordering)
    out.append(f"hours_core={core:.2f} hours_all={core + extra:.2f}")
    return "HEADLINE " + " ".join(out)


# 20 colours told apart at a glance (matplotlib's tab10, then tab20's lighter tints), and markers
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#c7c7c7",
           "#dbdb8d", "#9edae5")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h")


def series_styles(names: list[str]) -> dict[str, tuple[str, str]]:
    """{series: (colour, marker)}: a colour of its own for each of the first 20 series and a marker
    that also differs from its colour neighbours', so no two series share both."""
    return {n: (COLOURS[i % len(COLOURS)], MARKERS[(i + i // len(COLOURS)) % len(MARKERS)])
            for i, n in enumerate(names)}


def pareto_figure(by_model: dict[str, list[dict]]):
    """Per model two panels: perplexity against served bits/weight (Triton kernels: what a GPU
    decode step streams), then against stored bits/weight. Each series' non-dominated points are
    joined, its dominated ones drawn hollow. → the matplotlib figure (ImportError without it)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(by_model), 2, figsize=(13, 4.8 * len(by_model)), squeeze=False)
    # one style per series across every panel, so a series reads the same in each
    styles = series_styles(list(dict.fromkeys(s for res in by_model.values() for r in res if (s := series_of(r)))))
    for (served_ax, stored_ax), (model, res) in zip(axes, by_model.items()):
        bf = [r for r in res if r["family"] == "bf16"]
        # the top of the axis at 20× bf16: the 2-bit baselines (up to 1e11) would squash the rest;
        # points above it are drawn on the edge as ▲
        top = 20 * bf[0]["ppl"] if bf else math.inf
        series = [s for s in styles if any(series_of(r) == s for r in res)]
        for ax, fam, what in ((served_ax, "triton", "served bits per weight, Triton kernels (what a decode step "
                                                   "streams)"),
                              (stored_ax, None, "stored bits per weight (the checkpoint's accounting)")):
            for i, name in enumerate(series):
                pts = points(res, name, fam)
                if not pts:
                    continue
                front = frontier(pts)
                color, marker = styles[name]
                ax.plot([b for b, _, _ in front], [min(p, top) for _, p, _ in front], marker=marker, color=color,
                        label=name)
                rest = [(b, min(p, top)) for b, p, label in pts if (b, p, label) not in front]
                if rest:
                    ax.plot(*zip(*rest), ls="none", marker=marker, mfc="none", color=color)
                off = [(b, top) for b, p, _ in pts if p > top]
                if off:
                    ax.plot(*zip(*off), ls="none", marker="^", ms=9, color=color)
            if bf:
                ax.axhline(bf[0]["ppl"], color="k", ls="--", lw=1, label=f"bf16 ({bf[0]['ppl']:.2f})")
                ax.set_ylim(0.9 * bf[0]["ppl"], top * 1.1)
            ax.set_yscale("log")
            ax.set_title(f"{model}: {'served' if fam else 'stored'} bits" + (" (▲: off the chart)" if bf else ""))
            ax.set_xlabel(what)
            ax.set_ylabel("Wikipedia perplexity")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def pareto_plot(by_model: dict[str, list[dict]], path: Path) -> str | None:
    """:func:`pareto_figure` saved to ``path``. → None, or why no plot was made."""
    try:
        fig = pareto_figure(by_model)
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib), so no plot was made"
    import matplotlib.pyplot as plt
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# ============================================================================ the markdown

def write_report(by_model: dict[str, list[dict]], ordering: dict[str, dict], st: Settings, report: Path,
                 plot: Path, command: str, missing: list[str] = ()) -> None:
    """Write the report to ``report`` and its Pareto plot to ``plot``."""
    why = pareto_plot(by_model, plot)
    L = _preamble(by_model, ordering, st, command, missing)
    L += claims_table(by_model, ordering)
    for model, res in by_model.items():
        L += _sweep_section(model, res)
        L += _variants_section(res)
        L += _certificate_section(res)
        o = ordering.get(model)
        if o:
            L += _ordering_section(o, st)
    L += e8_section(by_model)
    L += ["## Pareto plot", ""]
    if why:
        L += [f"_{why}._", ""]
    else:
        L += ["Left: perplexity against served bits/weight (Triton kernels); right: against stored bits/weight. "
              "Each series' non-dominated points are joined; hollow: dominated by another point of its series.", "",
              f"![served and stored bits vs perplexity]({os.path.relpath(plot, report.parent)})", ""]
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text("\n".join(L))


# what the reference models really are (their GGUF headers: the tensor type of each block linear,
# by share of weights): the study's "bf16" is the bf16 of these dequantized weights
SOURCES = {"gemma3-270m": "Gemma3-270M ships as a Q4_K_M GGUF: its block linears are 63 % Q5_0, 24 % Q4_K, 12 % "
                          "Q6_K and 1.5 % Q8_0 (5.5, 4.5, 6.5625 and 8.5 bits/weight in llama.cpp's formats)",
           "smollm2-135m": "SmolLM2-135M ships as a Q4_1 GGUF: every block linear is asymmetric 4-bit in groups of "
                           "32 columns (5.0 bits/weight with its fp16 scale and minimum)"}


def _preamble(by_model, ordering, st: Settings, command: str, missing) -> list[str]:
    """Title, command, protocol, compute hours and what is not run yet."""
    L = [f"# Accuracy study{' (tiny CI configuration — not the paper-scale results)' if st.tiny else ''}",
         "",
         f"Generated by `{command}` — do not edit by hand; re-run the script (cached configurations are "
         "skipped).",
         "",
         f"Protocol (`shared/data.md`): calibration {st.nsamples} × {st.seqlen} tokens of the Wikipedia "
         f"calibration split (seed 0, sequential block pipeline, damp 0.01, act-order unless noted); "
         f"perplexity on the first {st.nwindows} non-overlapping {st.eval_seqlen}-token windows of the eval "
         f"split (Gemma: BOS + {st.eval_seqlen - 1}), fp32 compute, checkpoints dequantized by the format's reference; "
         "the pipeline's calibration forwards run in bf16, the models' dtype (Hessians summed in fp64). "
         f"Group size {st.group_size} (SmolLM2: 576 = 4·128 + 64, a ragged last group). Bits = average "
         "stored bits per weight of the quantized linears from the checkpoint's accounting (scales, "
         "outliers, Huffman codebooks included); embeddings and lm_head stay bf16 unless a configuration "
         "says otherwise. Served bits = the bytes/weight one decode step streams for the same linears in a kernel "
         "family's prepared form (Triton: the GPU kernels; CPU: the int4-op path), see the served-bits table."
         + (f" **Models truncated to their first {st.max_blocks} decoder blocks** (a pipeline test: the "
            "perplexities mean nothing)." if st.max_blocks else ""),
         ""]
    sources = [SOURCES[m] for m in by_model if m in SOURCES]
    if sources:
        L += ["**Source precision.** Neither reference model ships in bf16: " + "; ".join(sources) + ". The study "
              "converts each once to bf16, so its \"bf16\" rows are the bf16 of these dequantized weights, not the "
              "models' original bf16 weights (not available here, their perplexity not measured), and every Δ vs "
              "bf16 is a loss against the dequantized model. Re-quantizing weights that already lie on a 4–6-bit "
              "grid flatters the 4-bit results, most where the grids match (SmolLM2's 4-bit groups of 32): from "
              "real bf16 weights a 4-bit method would lose more than it does here.", ""]
    L += ["**Certificate.** Only layers quantized without clipping carry the bound ‖X(q−w)‖² ≤ ¼·sᵀDs: SSQR and "
          "HPTQ (and E8 on the rows without an overloaded block, see its section). GPTQ as latq-quantize runs it — "
          "the default, and every GPTQ lever here: coded scales, target correction, rotation — clips its scales and "
          "carries no certificate; neither do RTN and HRTN (no Hessian).", ""]
    core, extra = compute_hours(by_model, ordering)
    L += [f"Compute: {core + extra:.1f} h of this machine's time for everything below (the "
          "per-configuration wall times, divided by the number of configurations that ran side by side; a "
          f"re-run skips cached configurations): {core:.1f} h for the study proper (`--core`: sweep, "
          f"ordering, min-pivot, peers) and {extra:.1f} h for the extras (the peer gap's controls, "
          "the quantized-head variants).", ""]
    if missing:
        L += ["**Not run yet** (this report was written from the cached results with `--report-only`): "
              + ", ".join(missing) + ".", ""]
    return L


def _sweep_section(model: str, res: list[dict]) -> list[str]:
    """A model's heading, bf16 perplexity, the Table-3 grid and every configuration."""
    bf = next((r for r in res if r["family"] == "bf16"), None)
    L = [f"## {model}", ""]
    if bf:
        L += [f"bf16 perplexity **{bf['ppl']:.3f}** ({bf['windows']} windows, {bf['tokens']} predicted "
              "tokens).", ""]
    levels = sorted({r["level"] for r in res if r["level"]}, reverse=True)
    L += ["Perplexity (average stored bits/weight; served bits/weight in the Triton (T) and CPU (C) kernels "
          "where computed) — rows like the paper's Table 3; the HPTQ row is Table 4's layout.", "",
          "| method | " + " | ".join(f"≈{b}.125 b (SSQR: {b}-bit inliers)" for b in levels) + " |",
          "|---|" + "---|" * len(levels)]
    if bf:
        L.append(f"| bf16 (16 bits) | " + " | ".join(fmt_ppl(bf["ppl"]) for _ in levels) + " |")
    for fam in FAMILIES:
        cells = []
        for b in levels:
            r = next((r for r in res if r["family"] == fam and r["level"] == b and not r["tag"]), None)
            cells.append(f"{fmt_ppl(r['ppl'])} ({r['bits']:.3f}{_served_cell(r)})" if r else "—")
        if any(c != "—" for c in cells):
            L.append(f"| {fam} | " + " | ".join(cells) + " |")
    L += ["", "<details><summary>every configuration</summary>", "",
          "| configuration | bits/w | served T | served C | outliers | ppl | Δ vs bf16 | windows × tokens | "
          "quantize s | eval s |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res:
        d = fmt_delta(r["ppl"] / bf["ppl"]) if bf and r is not bf else ""
        sv = [f"{b:.3f}" if (b := served_bits(r, f)) is not None else "—" for f in ("triton", "cpu")]
        L.append(f"| {r['label']} | {r['bits']:.3f} | {' | '.join(sv)} | {100 * (r.get('outlier_rate') or 0):.2f}% | "
                 f"{fmt_ppl(r['ppl'])} | {d} | {r['windows']} × {r['tokens']} | {r['quantize_seconds']} | "
                 f"{r['eval_seconds']} |")
    return L + ["", "</details>", ""] + _served_section(res)


def _served_cell(r: dict) -> str:
    """``; T 4.30, C 5.11``: a grid cell's served bits, where computed."""
    t, c = served_bits(r, "triton"), served_bits(r, "cpu")
    return "" if t is None or c is None else f"; T {t:.2f}, C {c:.2f}"


def _served_section(res: list[dict]) -> list[str]:
    """Every method's operating points by served bits (Triton), with where each layer is served."""
    rows = sorted(((served_bits(r, "triton"), r) for r in res if series_of(r) and served_bits(r, "triton")),
                  key=lambda x: x[0])
    if not rows:
        return []
    L = ["Served bits/weight: what one decode step streams for the quantized linears in each kernel family's "
         "prepared form (inliers, scales, outliers with their index and padding), from the kernels' cost models "
         "(`layout_bytes`) on the layers the run produced; HPTQ/HRTN layers at the width `transcode` gives them for "
         "that family. Source: `checkpoint` (computed when the run finished), `re-quantized` (a result from before "
         "served bits were recorded: its configuration quantized again with the same settings, perplexity "
         "carried; the stored bits of that checkpoint beside it, equal to the evaluated one's up to the few "
         "integers a different thread count flips), `layout` (no outliers: exact from the shapes, bits and group size). Sorted by Triton served "
         "bits; ★T / ★C = on the front of that kernel family: no configuration of any method serves at most as "
         "many bits there with a lower perplexity.", "",
         "| configuration | series | stored b | served T | served C | Triton layers | CPU layers | ppl | source |",
         "|---|---|---|---|---|---|---|---|---|"]
    front = {f: global_front(res, f) for f in ("triton", "cpu")}
    for t, r in rows:
        sv = r["served"]
        star = "".join(f" ★{f[0].upper()}" for f in ("triton", "cpu") if r["label"] in front[f])
        kern = [", ".join(f"{k}: {n}" for k, n in sorted(sv.get("kernels", {}).get(f, {}).items()))
                for f in ("triton", "cpu")]
        cpu = served_bits(r, "cpu")
        L.append(f"| {r['label']}{star} | {series_of(r)} | {r['bits']:.3f} | {t:.3f} | "
                 f"{'n/a' if cpu is None else f'{cpu:.3f}'} | {kern[0]} | {kern[1]} | {fmt_ppl(r['ppl'])} | "
                 f"{sv.get('source', '—')}"
                 + (f" (stores {sv['stored_bits']:.5f})" if "stored_bits" in sv else "") + " |")
    return L + [""]


def _variants_section(res: list[dict]) -> list[str]:
    """Variants (one option changed) next to their default configuration."""
    L = []
    for tag, title, col in TAGGED:
        pairs = [(r, base) for r in res if r["tag"] == tag and r["family"] != E8_FAMILY   # E8: its own section
                 for base in [next((x for x in res if x["family"] == r["family"] and x["level"] == r["level"]
                                    and x["tag"] == r.get("base", "")), None)] if base]
        if pairs:
            L += [title, "", f"| compared with | its ppl | {col} | Δ ppl | bits/w (its → {col}) |",
                  "|---|---|---|---|---|"]
            for v, base in pairs:
                L.append(f"| {base['label']} | {fmt_ppl(base['ppl'])} | {fmt_ppl(v['ppl'])} | "
                         f"{100 * (v['ppl'] / base['ppl'] - 1):+.2f}% | {base['bits']:.3f} → {v['bits']:.3f} |")
            L.append("")
    return L


def _certificate_section(res: list[dict]) -> list[str]:
    cs = cert_summary(res)
    if not cs:
        return []
    return ["Certificate over every layer quantized without clipping (SSQR, HPTQ; all configurations "
            "above): measured (q−w)ᵀH_d(q−w) / bound ¼ΣD s², H_d the damped Hessian the solver used.", "",
            "| layers | Σerr/Σbound min | median | mean | max | largest per-row ratio |",
            "|---|---|---|---|---|---|",
            f"| {cs['layers']} | {cs['ratio_min']:.3f} | {cs['ratio_median']:.3f} | {cs['ratio_mean']:.3f} | "
            f"{cs['ratio_max']:.3f} | {cs['row_max']:.3f} |", "",
            "The theorem says every per-row ratio is ≤ 1; the paper predicts ≈ ⅓ on average.", ""]


def _ordering_section(o: dict, st: Settings) -> list[str]:
    """tr(D) per layer type and order, then the layer-level peer GPTQs (reference loop, llm-compressor)."""
    L = [f"tr(D) of the damped Hessian's LDL per layer type (paper Table 2 layout), mean over blocks "
         f"{o['blocks']} of the bf16 model ({st.ordering_nsamples} × {st.seqlen} calibration tokens); "
         f"random = mean of {st.ordering_seeds} seeds; q/k/v (and gate/up) share one Hessian. "
         "Smallest per row in bold.", "",
         "| layer | " + " | ".join(ORDERS) + " |", "|---|" + "---|" * len(ORDERS)]
    for t in LAYER_TYPES:
        rows = [x for x in o["rows"] if x["type"] == t]
        if not rows:
            continue
        v = {od: statistics.fmean(x["trD"][od] for x in rows) for od in ORDERS}
        best = min(v.values())
        L.append(f"| {t} | " + " | ".join(f"**{v[od]:.4g}**" if v[od] == best else f"{v[od]:.4g}"
                                          for od in ORDERS) + " |")
    L.append("")
    L += ["Peer GPTQ: ours (lazy-batch, two-level blocked) vs the IST-DASLab reference column loop at "
          "equal settings (same damped Hessian, act-order, static group scales, clipped grid), same "
          "layers:", "", "| bits | layers | identical integers (min) | error ours / reference (min – max) |",
          "|---|---|---|---|"]
    for bits in st.peer_bits:
        ps = [x["peer"][str(bits)] for x in o["rows"]]
        L.append(f"| {bits} | {len(ps)} | {min(p['same_int'] for p in ps):.5f} | "
                 f"{min(p['err_ratio'] for p in ps):.5f} – {max(p['err_ratio'] for p in ps):.5f} |")
    L.append("")
    lcs = {b: [x["llmc"][str(b)] for x in o["rows"] if str(b) in x.get("llmc", {})] for b in st.peer_bits}
    if any(lcs.values()):
        L += ["llm-compressor's GPTQ on the same layers, to tell its solver from its scales: its solver "
              "(`quantize_weight`) given our scales, and its whole layer path as in its pipeline (its "
              "`mse` observer's scales of the bf16 weights); errors (q−w)ᵀH_d(q−w) relative to ours:", "",
              "| bits | group size | layers | identical integers, our scales (min) | error, our scales "
              "(min – max) | error, its scales (min – median – max) | its scale / ours (median) |",
              "|---|---|---|---|---|---|---|"]
        for bits, ps in lcs.items():
            if not ps:
                continue
            own = sorted(p["err_ratio_own"] for p in ps)
            L.append(f"| {bits} | {ps[0]['group_size']} | {len(ps)} | {min(p['same_int'] for p in ps):.5f} | "
                     f"{min(p['err_ratio'] for p in ps):.5f} – {max(p['err_ratio'] for p in ps):.5f} | "
                     f"{own[0]:.3f} – {statistics.median(own):.3f} – {own[-1]:.3f} | "
                     f"{statistics.median(p['scale_ratio'] for p in ps):.3f} |")
        fb = sum(p["rtn_fallback"] for ps in lcs.values() for p in ps)
        L += ["", *([f"llm-compressor fell back to RTN (Cholesky failure) on {fb} of these layers.", ""]
                    if fb else [])]
    return L
