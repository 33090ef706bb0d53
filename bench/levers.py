"""Screen of accuracy levers on real SmolLM2-135M layers: which are worth a whole-model run.

Per lever, at 2/3/4 bits, against the same method without it: the H-weighted layer error
``‖X(q−w)‖²/‖Xw‖²`` (summed over the four cached real layers of ``vllm_latq.testing.hessians.REAL_LAYERS``),
stored bits/weight and served bits/weight (the CPU family's cost model,
``kernels/served.layer_served``; for a lever that changes the runtime form, the form it would
need). Levers:

(a) half   symmetric half-integer grid ``s·(z+½)`` (GPTQ and SSQR-1 %)
(b) target target correction: solve against ``W′ᵀ = Wᵀ + (X̃ᵀX̃+λI)⁻¹(X̃ᵀX − X̃ᵀX̃)Wᵀ`` on one real block whose
           prefix was quantized (GPTQ at the same bits); error against the full-precision XWᵀ
(c) cols   per-input-column scales ``c ∝ D^p`` folded into the norm (q_proj, up_proj) or an
           activation multiply (o_proj, down_proj: +16/n bits served)
(d) s4     second-level scales (``--scale-bits 4``, format/scale_codes.py: 4-bit codes on a grid
           per 16 rows of a group, fp16 min and step each); served bits in the CPU family (the
           codes where its C++ GEMV runs, else their fp16 decode; the Triton kernels read the codes)
(e) group  SSQR and GPTQ at group sizes 64 and 32
(f) code   HPTQ's integers under a compact codebook (lengths over the symbol range) and an
           ideal entropy coder (ANS's bound)
(g) rotate ``--rotate hadamard``: each layer solved on (W·R, RᵀHR), R a seeded random-sign block
           Hadamard (format/rotation.py), its error measured on the served Q·Rᵀ against (W, H)
           (GPTQ g64 and g128, SSQR-1 %, HPTQ at the same bits); per layer and over the four
(h) decode ``--decoder kbest|klein --beam K`` against Babai (≡ GPTQ g128): the error ratio, its
           spread over the layers and (Klein) over seeds, and the solve time per K (median of
           ``--repeats``, with the min–max of the repeats: the timing noise)
(i) e8     E8 codebooks by block Babai against rotated scalar GPTQ at its settings near the same
           stored bits, both rotated alike, over ``--seeds`` rotation seeds (bench/e8_screen.py)

    nice -n 5 python -m bench.levers [--bits 2 3 4] [--block 3] [--skip-target] [--levers acdefghi]
"""
from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from vllm_latq.testing.hessians import real_layer_hessians
from vllm_latq import format as fmt
from vllm_latq.format import huffman
from vllm_latq.kernels.served_report import families, layer_served
from vllm_latq.quantize import column_scales as cs
from vllm_latq.quantize.hessian import qronos_target
from vllm_latq.algorithms.hptq import SCALE_BITS, hptq
from vllm_latq.algorithms.lattice import layer_error
from vllm_latq.algorithms.solvers import gptq
from vllm_latq.algorithms.ssqr import ssqr

NORM_FED = ("q_proj", "up_proj")   # of REAL_LAYERS: the ones a norm feeds (their scales fold for free)


def served_bits(res, W) -> float:
    """Bits/weight the first (CPU) kernel family streams for ``res``'s runtime form."""
    kind = "huffman" if res.group_size is None and res.bits is None else "dense"
    t = fmt.encode_layer(res, kind)
    fam = families()[0]
    return layer_served(t, kind, tuple(W.shape), res.bits, res.group_size, [fam])[fam.name]["bits_per_weight"]


class Tally:
    """Summed layer error over layers, and numel-weighted bits."""

    def __init__(self):
        self.err = self.norm = self.numel = self.stored = self.served = 0.0

    def add(self, W, H, Q, stored: float, served: float):
        self.err += layer_error(W, Q, H).sum().item()
        self.norm += layer_error(W, torch.zeros_like(W), H).sum().item()
        n = W.numel()
        self.numel += n
        self.stored += stored * n
        self.served += served * n

    def row(self):
        return self.err / self.norm, self.stored / self.numel, self.served / self.numel


def run_layers(layers, solve) -> tuple[float, float, float]:
    """``solve(name, W, H) -> (Q, stored, served)`` over every layer → (rel. error, stored, served)."""
    t = Tally()
    for name, (W, H) in layers.items():
        Q, stored, served = solve(name, W, H)
        t.add(W, H, Q, stored, served)
    return t.row()


def plain(method, **kw):
    def solve(name, W, H):
        r = method(W, H, **kw)
        return r.q, r.bits_per_weight, served_bits(r, W)
    solve.key = (method.__name__, tuple(sorted(kw.items())))   # baselines are run once per key
    return solve


def column_scaled(method, power, **kw):
    """The method on ``W·diag(c)`` against ``diag(1/c)H diag(1/c)``; o_proj/down_proj pay a
    served fp16 activation-scale vector (16/n bits/weight)."""
    def solve(name, W, H):
        c = cs.column_scales(H, power=power)
        r = method(cs.fold_weight(W, c), cs.fold_hessian(H, c), **kw)
        extra = 0.0 if name.endswith(NORM_FED) else 16 / W.shape[0]
        return cs.unfold(r.q, c), r.bits_per_weight + extra, served_bits(r, W) + extra
    return solve


def codings(layers, bits) -> dict[str, float]:
    """HPTQ at ``bits``: stored bits/weight today, with a compact codebook (5-bit code lengths
    over [zmin, zmax] + two int32 bounds instead of 40 bits/symbol), and at the empirical
    entropy (+ the same codebook and chunk table: what ANS approaches)."""
    tot = {"huffman": 0.0, "compact": 0.0, "entropy": 0.0}
    numel = 0
    for W, H in layers.values():
        z = hptq(W, H, target_bits=bits).z.numpy().ravel()
        n = z.size
        _, counts = np.unique(z, return_counts=True)
        lengths = huffman.code_lengths(counts)
        payload = int((counts * lengths).sum())
        chunks = 16 * (-(-n // huffman.CHUNK))
        compact_book = 64 + 5 * int(z.max() - z.min() + 1)
        p = counts / n
        tot["huffman"] += huffman.stored_bits(payload, len(counts), n) + SCALE_BITS
        tot["compact"] += 8 * (-(-payload // 8)) + compact_book + chunks + SCALE_BITS
        tot["entropy"] += float(-(counts * np.log2(p)).sum()) + compact_book + chunks + SCALE_BITS
        numel += n
    return {k: v / numel for k, v in tot.items()}


# ----------------------------------------------------------------------------- (g) rotation, (h) decoders

def rotated(method, seed=0, **kw):
    """The method on the rotated problem; its Q rotated back (the weight the layer serves)."""
    from vllm_latq.algorithms.rotation import rotate_hessian, rotate_weight, served_weight
    from vllm_latq.format.rotation import Rotation

    def solve(name, W, H):
        s = Rotation(seed).signs(W.shape[1])
        r = method(rotate_weight(W, s), rotate_hessian(H, s).float(), **kw)
        return served_weight(r.q, s), r.bits_per_weight, served_bits(r, W)
    return solve


def rotation_rows(layers, b, add) -> None:
    """(g): each method plain and rotated, every layer solved once per side: the summed row and
    each layer's error ratio."""
    for label, method, kw in (("gptq g64", gptq, dict(bits=b, group_size=64)), ("gptq g128", gptq, dict(bits=b)),
                              ("ssqr-1% g128", ssqr, dict(bits=b)), ("hptq", hptq, dict(target_bits=b + 0.125))):
        tallies, ratios = [Tally(), Tally()], []
        for name, (W, H) in layers.items():
            errs = []
            for t, solve in zip(tallies, (plain(method, **kw), rotated(method, **kw))):
                Q, stored, served = solve(name, W, H)
                t.add(W, H, Q, stored, served)
                errs.append(layer_error(W, Q, H).sum().item())
            ratios.append(errs[1] / errs[0])
        print(f"    rotate {label} {b}-bit per layer: " + ", ".join(f"{x:.3f}" for x in ratios), flush=True)
        (e0, s0, v0), (e1, s1, v1) = (t.row() for t in tallies)
        add(("g rotate", label, b, e0, e1, s0, s1, v0, v1))


def decoder_rows(layers, b, beams, klein_draws, repeats, add) -> None:
    """(h): GPTQ g128 decoded by K-best / Klein against Babai: error ratio (summed over the layers,
    and each layer's), Klein's spread over three seeds, seconds per solve of the four layers."""
    norm = sum(layer_error(W, torch.zeros_like(W), H).sum().item() for W, H in layers.values())

    def timed(**kw):
        ts, Qs = [], None
        for _ in range(repeats):
            t = time.perf_counter()
            Qs = {n: gptq(W, H, bits=b, **kw).q for n, (W, H) in layers.items()}
            ts.append(time.perf_counter() - t)
        per = [layer_error(W, Qs[n], H).sum().item() for n, (W, H) in layers.items()]
        return sum(per) / norm, per, sorted(ts)

    e0, p0, t0 = timed()
    for dec, ks in (("kbest", beams), ("klein", klein_draws)):
        for k in ks:
            e1, p1, t1 = timed(decoder=dec, beam=k)
            spread = [a / c for a, c in zip(p1, p0)]
            extra = ""
            if dec == "klein":
                seeds = [timed_klein(layers, b, k, seed) / norm / e0 for seed in (1, 2)]
                extra = f", seeds 1–2: {', '.join(f'{x:.4f}' for x in seeds)}"
            print(f"    decode {dec} K={k} {b}-bit: layers {', '.join(f'{x:.4f}' for x in spread)}{extra}; "
                  f"{t1[len(t1) // 2]:.1f} s (min {t1[0]:.1f}, max {t1[-1]:.1f}) vs Babai {t0[len(t0) // 2]:.1f} s "
                  f"(min {t0[0]:.1f}, max {t0[-1]:.1f})", flush=True)
            add((f"h decode {dec}", f"gptq g128 K={k}", b, e0, e1, None, None, None, None))


def timed_klein(layers, b, k, seed) -> float:
    """Klein's summed error (GPTQ g128's problem) with another seed: the draws' spread."""
    from vllm_latq.algorithms.scales import mse_scales
    from vllm_latq.algorithms.solvers import Rounder, decoded_sweep, decoder_lattice
    tot = 0.0
    for W, H in layers.values():
        lat = decoder_lattice(H, "act", 0.01, decoder="klein", beam=k)
        q = decoded_sweep(lat.A, lat.T, W, mse_scales(W, b, 128), 128, Rounder.of(b, True), "klein", k, seed=seed).q
        tot += layer_error(W, q, H).sum().item()
    return tot


# ----------------------------------------------------------------------------- (b) target correction

@torch.no_grad()
def block_streams(block: int, bits: int, nseq: int, seqlen: int):
    """SmolLM2's block ``block`` run on the inputs of the full-precision prefix (X) and of the
    prefix quantized by GPTQ-``bits`` g128 (X̃, the pipeline's way: Hessians from the unquantized
    block on the quantized prefix's outputs) → {linear: (W, X̃ rows, X rows)}."""
    import copy

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_latq import data, hf_model
    from vllm_latq.quantize import capture
    from vllm_latq.quantize.activations import Activations
    from vllm_latq.quantize.calibrate import block_hessians

    mdir = data.model_dir("smollm2-135m")
    model = AutoModelForCausalLM.from_pretrained(mdir, dtype=torch.float32).eval()
    ids = data.calibration_batches(AutoTokenizer.from_pretrained(mdir), nsamples=nseq, seqlen=seqlen)
    prefix, layers = hf_model.decoder_layers(model)
    shape = (len(ids), ids.shape[1], model.config.hidden_size)
    with tempfile.TemporaryDirectory() as d_fp, tempfile.TemporaryDirectory() as d_q:
        # the pipeline's activation buffers, one per stream (each in its own directory if spilled)
        x_fp = Activations.create(Path(d_fp), shape, torch.float32, "cpu", None)
        x_q = Activations.create(Path(d_q), shape, torch.float32, "cpu", None)
        kw = capture.capture_inputs(model, layers, ids, x_fp, False)[0]
        capture.capture_inputs(model, layers, ids, x_q, False)
        for i in range(block):
            capture.block_outputs(layers[i], x_fp, kw, "", False)
            qlayer = copy.deepcopy(layers[i])
            lin = hf_model.block_linears(qlayer, f"{prefix}.{i}")
            hs = block_hessians(qlayer, lin, x_q, kw, "", False)
            for n, m in lin.items():
                hf_model.set_tensor(m, "weight", gptq(m.weight.detach(), hs.of[n].H, bits=bits).q)
            capture.block_outputs(qlayer, x_q, kw, "", False)
        lin = hf_model.block_linears(layers[block], f"{prefix}.{block}")
        rows = {n: [] for n in lin}
        hooks = [m.register_forward_pre_hook(lambda mod, a, n=n: rows[n].append(a[0].reshape(-1, a[0].shape[-1])))
                 for n, m in lin.items()]
        for xs in (x_q, x_fp):
            for j in range(len(xs)):
                capture.run_block(layers[block], xs[j:j + 1], kw)
        for h in hooks:
            h.remove()
    out = {}
    for n, m in lin.items():
        r = torch.cat(rows[n])
        out[n] = (m.weight.detach().float(), r[: len(r) // 2].double(), r[len(r) // 2:].double())
    return out


def corrected_target(W, Xq, X, damp=0.01) -> torch.Tensor:
    """The pipeline's ``--target-correction`` weight (:func:`~vllm_latq.quantize.hessian.qronos_target`)
    from the rows of both streams."""
    n = len(X)
    return qronos_target(W, Xq.T @ Xq / n, Xq.T @ X / n, damp)


def target_rows(streams, bits) -> list[tuple]:
    rows = []
    for label, method, kw in (("gptq g128", gptq, dict(bits=bits)), ("ssqr-1% g128", ssqr, dict(bits=bits))):
        err = {False: 0.0, True: 0.0}
        norm = 0.0
        for W, Xq, X in streams.values():
            Y = X @ W.double().T
            H = Xq.T @ Xq
            norm += Y.square().sum().item()
            for corr in (False, True):
                Wt = corrected_target(W, Xq, X) if corr else W
                Q = method(Wt, H, **kw).q.double()
                err[corr] += (Xq @ Q.T - Y).square().sum().item()
        rows.append(("b target", label, bits, err[False] / norm, err[True] / norm, None, None, None, None))
    return rows


# ----------------------------------------------------------------------------- the screen

def screen(bits_list, block, skip_target, nseq, seqlen, powers, only, levers="acdef", beams=(2, 4, 8),
           klein_draws=(8,), repeats=3, seeds=(0, 1)):
    layers = {k: (W, H.float()) for k, (W, H) in real_layer_hessians().items()}
    rows = []   # (lever, method, bits, err base, err lever, stored base, stored lever, served base, served lever)

    done = {}

    def pair(lever, label, b, base, new):
        if base.key not in done:
            done[base.key] = run_layers(layers, base)
        e0, s0, v0 = done[base.key]
        e1, s1, v1 = run_layers(layers, new)
        add((lever, label, b, e0, e1, s0, s1, v0, v1))

    def add(row):
        rows.append(row)
        print_row(row)

    for b in [] if only else bits_list:
        if "a" in levers:
            pair("a half", "gptq g128", b, plain(gptq, bits=b), plain(gptq, bits=b, offset=0.5))
            pair("a half", "ssqr-1% g128", b, plain(ssqr, bits=b), plain(ssqr, bits=b, offset=0.5))
        for p in powers if "c" in levers else ():
            pair(f"c cols p={p}", "hptq", b, plain(hptq, target_bits=b), column_scaled(hptq, p, target_bits=b))
            pair(f"c cols p={p}", "gptq g128", b, plain(gptq, bits=b), column_scaled(gptq, p, bits=b))
            pair(f"c cols p={p}", "ssqr-1% g128", b, plain(ssqr, bits=b), column_scaled(ssqr, p, bits=b))
        for g in (64, 32) if "d" in levers else ():   # coded scales (--scale-bits 4) at g: fp16 at 2g and at g
            pair("d s4", f"gptq g{2 * g} → g{g}+s4", b, plain(gptq, bits=b, group_size=2 * g),
                 plain(gptq, bits=b, group_size=g, scale_bits=4))
            pair("d s4", f"gptq g{g} → g{g}+s4", b, plain(gptq, bits=b, group_size=g),
                 plain(gptq, bits=b, group_size=g, scale_bits=4))
        for g in (64, 32) if "e" in levers else ():
            pair("e group", f"ssqr-1% g128 → g{g}", b, plain(ssqr, bits=b), plain(ssqr, bits=b, group_size=g))
            pair("e group", f"gptq g128 → g{g}", b, plain(gptq, bits=b), plain(gptq, bits=b, group_size=g))
        if "g" in levers:
            rotation_rows(layers, b, add)
        if "h" in levers:
            decoder_rows(layers, b, beams, klein_draws, repeats, add)
        if "f" in levers:
            c = codings(layers, b)
            add(("f code", "hptq compact book", b, None, None, c["huffman"], c["compact"], None, None))
            add(("f code", "hptq entropy (ANS)", b, None, None, c["huffman"], c["entropy"], None, None))
    if "i" in levers and not only:
        from bench.e8_screen import e8_rows
        e8_rows(layers, bits_list, seeds, add)
    if not skip_target:
        for b in bits_list:
            for row in target_rows(block_streams(block, b, nseq, seqlen), b):
                add(row)
    return rows


def _f(x, fmt_="{:.4f}"):
    return "—" if x is None else fmt_.format(x)


def print_row(row):
    lever, label, b, e0, e1, s0, s1, v0, v1 = row
    ratio = e1 / e0 if e0 else None
    print(f"| {lever} | {label} | {b} | {_f(e0, '{:.4g}')} → {_f(e1, '{:.4g}')} | {_f(ratio, '{:.3f}')} | "
          f"{_f(s0)} → {_f(s1)} | {_f(v0)} → {_f(v1)} |", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bits", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--block", type=int, default=3, help="(b): the SmolLM2 block whose prefix is quantized")
    ap.add_argument("--nseq", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--skip-target", action="store_true", help="skip (b) (loads the model)")
    ap.add_argument("--only-target", dest="only", action="store_true", help="only (b)")
    ap.add_argument("--powers", type=float, nargs="+", default=[0.5], help="(c): exponents p of c ∝ D^p")
    ap.add_argument("--levers", default="acdefghi", help="the per-layer levers to screen (letters; default all)")
    ap.add_argument("--beams", type=int, nargs="+", default=[2, 4, 8], help="(h): K-best beam widths")
    ap.add_argument("--klein-draws", type=int, nargs="+", default=[8], help="(h): Klein's draws")
    ap.add_argument("--repeats", type=int, default=3, help="(h): timed solves per decoder (median, min-max)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="(i): rotation seeds")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    t0 = time.time()
    print("| lever | method | bits | rel. error base → lever | ratio | stored b/w base → lever | "
          "served b/w (CPU) base → lever |")
    print("|---|---|---|---|---|---|---|", flush=True)
    rows = screen(a.bits, a.block, a.skip_target, a.nseq, a.seqlen, a.powers, a.only, a.levers, a.beams,
                  a.klein_draws, a.repeats, a.seeds)
    best = {}
    for lever, label, b, e0, e1, *_ in rows:
        if e0:
            key = lever.split()[0]
            best[key] = min(best.get(key, math.inf), e1 / e0)
    head = " ".join(f"best_err_ratio_{k}={v:.3f}" for k, v in sorted(best.items()))
    print(f"HEADLINE {head} seconds={time.time() - t0:.0f}")


if __name__ == "__main__":
    main()
