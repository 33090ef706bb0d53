"""Lever (i) of ``bench.levers``: E8 codebooks solved by block Babai against rotated scalar GPTQ on the
real SmolLM2 layers, both in the Hadamard-rotated frame of ``--rotate hadamard`` (the same signs).

Per bit width b and rotation seed: scalar GPTQ (Babai's sweep) at its settings near b bits — scales
per row (b + 16/in stored bits, the E8 code's own budget), coded per 64 (``--scale-bits 4``) and fp16
per 128 — each in act and min-pivot order; the E8 code of ``algorithms/e8.py`` (b = 2: E8P, 3: E8P
+ a 256-point ball of E8, 4: E8P + E8P) with fp16 scales per row, in four block sweeps: QuIP#'s
(natural block order, Euclidean nearest point), act blocks with each block's point searched in its
metric D_k, block min-pivot Euclidean and block min-pivot in D_k (the screened configuration); and
with coded scales per 64 columns (the scalar's s4-g64 budget), act blocks in D_k.
Error: Σ tr((Q−W)H(Q−W)ᵀ) / Σ tr(WHWᵀ) over the layers, served bits per kernel family for the
scalar grid (its scales streamed); an E8 layer streams its indices and row scales as stored.
Noise: the spread of the ratio over the layers and between the two rotation seeds.

    nice -n 5 python -m bench.levers --levers i --skip-target [--bits 2 3 4] [--seeds 0 1]
"""
from __future__ import annotations

import math
import time

import torch

from vllm_latq import format as fmt
from vllm_latq.algorithms import e8
from vllm_latq.algorithms.lattice import layer_error, resolve_order
from vllm_latq.algorithms.rotation import rotate_hessian, rotate_weight, served_weight
from vllm_latq.algorithms.solvers import gptq
from vllm_latq.format import scale_codes
from vllm_latq.format.rotation import Rotation
from vllm_latq.kernels.served_report import families, layer_served

# (label, gptq keywords; group None: one scale per row)
SCALAR = (("row", dict(group_size=None)), ("s4-g64", dict(group_size=64, scale_bits=4)),
          ("g128", dict(group_size=128)))
# (label, block order, search each block's point in its metric D_k)
SWEEPS = (("natural eucl (QuIP#)", "natural", False), ("act D_k", "act", True),
          ("min-pivot eucl", "min-pivot", False), ("min-pivot D_k", "min-pivot", True))
MAIN = "min-pivot D_k"
GROUPED = "s4-g64 act D_k"   # coded scales per 64 columns (--scale-bits 4), blocks of neighbouring columns
# the verdicts: an E8 configuration against the scalar's best at ≤ its stored bits, or (generous) at
# ≤ b + 0.125 (the scalar with fp16 scales per 128 columns)
VERDICTS = ((MAIN, False), (MAIN, True), (GROUPED, False))


class Point:
    """One configuration over the layers: errors per layer, numel-weighted bits."""

    def __init__(self, label: str):
        self.label, self.err, self.norm, self.numel = label, {}, {}, 0
        self.stored, self.served = 0.0, {}

    def add(self, name, W, H, Q, stored: float, served: dict[str, float]):
        self.err[name] = layer_error(W, Q, H).sum().item()
        self.norm[name] = layer_error(W, torch.zeros_like(W), H).sum().item()
        n = W.numel()
        self.numel += n
        self.stored += stored * n
        for k, v in served.items():
            self.served[k] = self.served.get(k, 0.0) + v * n

    @property
    def rel(self) -> float:
        return sum(self.err.values()) / sum(self.norm.values())

    @property
    def bits(self) -> float:
        return self.stored / self.numel

    def served_bits(self) -> dict[str, float]:
        return {k: v / self.numel for k, v in self.served.items()}


def served_by_family(res, W) -> dict[str, float]:
    """Bits/weight each kernel family streams for a dense result's runtime form."""
    t = fmt.encode_layer(res, "dense")
    out = layer_served(t, "dense", tuple(W.shape), res.bits, res.group_size, families())
    return {k: v["bits_per_weight"] for k, v in out.items()}


def rotated_layers(layers, seed):
    """name → (W, H, signs, W·R, RᵀHR fp64, {order: GPTQ's permutation}, block min-pivot T)."""
    out = {}
    for name, (W, H) in layers.items():
        s = Rotation(seed).signs(W.shape[1])
        Wr, Hr = rotate_weight(W, s), rotate_hessian(H, s)
        perms = {o: resolve_order(o, Hr, 0.01, babai=False) for o in ("act", "min-pivot")}
        out[name] = (W, H, s, Wr, Hr, perms, e8.block_order(Hr, "min-pivot"))
    return out


def scalar_points(rot, b) -> list[Point]:
    pts = []
    for label, kw in SCALAR:
        for order in ("act", "min-pivot"):
            p = Point(f"gptq {label} {order}")
            for name, (W, H, s, Wr, Hr, perms, _) in rot.items():
                g = kw["group_size"] or W.shape[1]
                r = gptq(Wr, Hr.float(), bits=b, order=perms[order], **{**kw, "group_size": g})
                p.add(name, W, H, served_weight(r.q, s), r.bits_per_weight, served_by_family(r, W))
            pts.append(p)
    return pts


def e8_points(rot, b) -> tuple[list[Point], dict[str, float]]:
    """The four sweeps of the E8 code (row scales shared), and the code's round-to-nearest squared
    error on the rotated weights relative to the scalar grid's (per-row MSE scales): its gain
    before any error feedback."""
    from vllm_latq.algorithms.solvers import rtn
    code = e8.CODES[b]
    pts = {label: Point(f"e8 {label}") for label in [s[0] for s in SWEEPS] + [GROUPED]}
    rtn_err = {"e8": 0.0, "scalar": 0.0}
    for name, (W, H, s, Wr, Hr, _, T) in rot.items():
        sc = e8.code_scales(Wr, code)
        Wb = Wr.double().reshape(W.shape[0], -1, e8.DIM)
        q_rtn = sc.double()[:, :, None] * code.nearest((Wb / sc.double()[:, :, None]).reshape(-1, e8.DIM)
                                                       ).reshape(Wb.shape)
        rtn_err["e8"] += (q_rtn - Wb).square().sum().item()
        rtn_err["scalar"] += (rtn(Wr, bits=b, group_size=W.shape[1]).q - Wr).square().sum().item()
        for label, order, metric in SWEEPS:
            r = e8.block_babai(Wr, Hr, code, scales=sc, order=T if order == "min-pivot" else order, metric=metric)
            pts[label].add(name, W, H, served_weight(r.q, s), r.bits_per_weight, {})
        coded = scale_codes.code_scales(e8.code_scales(Wr, code, group_size=64), 4)
        r = e8.block_babai(Wr, Hr, code, group_size=64, scales=coded.decode(), order="act")
        bits = code.bits_per_weight + scale_codes.stored_bits(*coded.codes.shape) / W.numel()
        pts[GROUPED].add(name, W, H, served_weight(r.q, s), bits, {})
    return list(pts.values()), {"rtn_mse_ratio": rtn_err["e8"] / rtn_err["scalar"]}


def gaussian_gain(b, n=20000) -> float:
    """The code's mean squared error on unit Gaussian blocks over the b-bit scalar grid's, each at its
    best scale: the codebook's gain with neither error feedback nor real weights."""
    from vllm_latq.algorithms.scales import grid
    x = torch.randn(n, e8.DIM, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    lo, hi = grid(b)
    best = {"e8": math.inf, "scalar": math.inf}
    for k in range(41):
        f = 0.2 + 0.03 * k
        best["scalar"] = min(best["scalar"], (f * torch.round(x / f).clamp(lo, hi) - x).square().mean().item())
        f = 0.7 + 0.015 * k
        best["e8"] = min(best["e8"], (f * e8.CODES[b].nearest(x / f) - x).square().mean().item())
    return best["e8"] / best["scalar"]


# ----------------------------------------------------------------------------- the screen and its report

def best_at(points: list[Point], max_bits: float) -> Point:
    """The scalar point of least error among those storing at most ``max_bits`` a weight."""
    return min((p for p in points if p.bits <= max_bits + 1e-9), key=lambda p: p.rel)


def compare(e: Point, s: Point) -> tuple[float, list[float]]:
    """E8's error over the scalar point's: summed over the layers, and per layer."""
    return e.rel / s.rel, [e.err[n] / s.err[n] for n in e.err]


def verdict(ratios: list[float], per_layer: list[float]) -> tuple[float, float, str]:
    """→ (mean ratio, noise, word): noise the larger of the seeds' spread and the standard error of
    the per-layer ratios' mean (all seeds); "beats" where 1 − ratio exceeds it."""
    mean = sum(ratios) / len(ratios)
    m = sum(per_layer) / len(per_layer)
    se = math.sqrt(sum((x - m) ** 2 for x in per_layer) / (len(per_layer) - 1) / len(per_layer))
    noise = max(max(ratios) - min(ratios), se)
    word = "beats" if 1 - mean > noise else ("loses" if mean - 1 > noise else "within noise")
    return mean, noise, word


def _served(p: Point) -> str:
    v = p.served_bits()
    return " / ".join(f"{v[k]:.3f}" for k in sorted(v)) if v else f"{p.bits:.3f} (as stored)"


def report(b, runs, extra, add) -> None:
    """Prints the width's table (every configuration, each seed) and the verdict rows."""
    seeds = sorted(runs)
    print(f"\n#### E8 at {b} bits: rel. error Σ over the layers, seeds {seeds}; Gaussian MSE ratio "
          f"E8/grid {extra['gauss']:.3f}, real-weight RTN MSE ratio (row scales) "
          + ", ".join(f"{extra[s]['rtn_mse_ratio']:.3f}" for s in seeds))
    print("| configuration | stored b/w | served b/w (cpu / triton) | rel. error per seed | per layer (seed "
          f"{seeds[0]}) |\n|---|---|---|---|---|")
    for i, p in enumerate(runs[seeds[0]]):
        errs = ", ".join(f"{runs[s][i].rel:.4g}" for s in seeds)
        layers = ", ".join(f"{x / p.norm[n]:.3g}" for n, x in p.err.items())
        print(f"| {p.label} | {p.bits:.3f} | {_served(p)} | {errs} | {layers} |")
    for label, generous in VERDICTS:
        ratios, per_layer = [], []
        for s in seeds:
            e = next(p for p in runs[s] if p.label == f"e8 {label}")
            base = best_at([p for p in runs[s] if p.label.startswith("gptq")],
                           b + 0.125 if generous else e.bits)
            r, pl = compare(e, base)
            ratios.append(r)
            per_layer += pl
            if s == seeds[0]:   # the row and the verdict name the first seed's scalar point
                first = base
                add(("i e8", f"{label} vs {base.label}", b, base.rel, e.rel, base.bits, e.bits,
                     base.served_bits().get("cpu"), e.bits))
        mean, noise, word = verdict(ratios, per_layer)
        print(f"verdict {b}-bit e8 {label} ({e.bits:.3f} b/w) vs scalar's best at ≤ "
              f"{'b + 0.125' if generous else 'its stored bits'} ({first.label}, {first.bits:.3f} b/w): "
              f"ratio {mean:.3f} (seeds " + ", ".join(f"{x:.3f}" for x in ratios)
              + f"; layers {min(per_layer):.3f}–{max(per_layer):.3f}), noise ±{noise:.3f}: {word}", flush=True)


def e8_rows(layers, bits_list, seeds, add) -> None:
    """(i): every width's configurations on the rotated layers of each seed, then the reports."""
    runs = {b: {} for b in bits_list}
    extra = {b: {"gauss": gaussian_gain(b)} for b in bits_list}
    for seed in seeds:
        t = time.time()
        rot = rotated_layers(layers, seed)
        for b in bits_list:
            pts, ex = e8_points(rot, b)
            runs[b][seed] = scalar_points(rot, b) + pts
            extra[b][seed] = ex
        print(f"    e8 seed {seed}: {time.time() - t:.0f} s", flush=True)
    for b in bits_list:
        report(b, runs[b], extra[b], add)
