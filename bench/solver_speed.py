"""Solver cost on a 4096x4096 layer with a real-shaped Hessian, and E8's on SmolLM2's shapes.

(a) GPTQ and Babai time / time of an fp32 GEMM doing the same number of FLOPs
    (target ≤ 2): the sequential sweep should run near GEMM speed.
(b) SSQR and HPTQ end-to-end time (scales + factorization + the whole scale search)
    / one GPTQ run (target ≤ 3).
(c) method e8 at 2/3/4 bits (coded scales per 16 columns, the study's E8 point) against GPTQ-4b
    g128 on the same layers — SmolLM2-135M's seven linears of a block by default, each rotated
    (Hadamard) as ``--rotate hadamard`` solves it: seconds a block and E8 / GPTQ (target ≤ 2 at
    3 bits), with each one's relative layer error ‖X(Q−W)ᵀ‖²/‖XWᵀ‖² summed over the block;
    ``--device cuda`` solves them on a GPU (the GPU check: 8B shapes, 3 bits).
All timings in this one run, in interleaved rounds, best of --repeats. Ends with a HEADLINE line.

FLOP counts (useful work, multiply-add = 2): the lazy-batch sweep r·c² (each column's
error updates the c-j later columns, Σ_j 2·r·(c-j)); GPTQ's factor: Cholesky c³/3 +
triangular inverse c³/3; Babai: Cholesky c³/3 + Y = A·Wᵀ on the upper triangle r·c².
"""
from __future__ import annotations

import argparse
import time

import torch

from vllm_latq.algorithms import babai, gptq, hptq, ssqr
from vllm_latq.algorithms.e8 import e8
from vllm_latq.algorithms.lattice import relative_error
from vllm_latq.algorithms.rotation import rotate_hessian, rotate_weight
from vllm_latq.format.rotation import Rotation

# SmolLM2-135M's linears of a block (out × in): q, k, v, o, gate, up, down
SMOL_BLOCK = "576x576,192x576,192x576,576x576,1536x576,1536x576,576x1536"
E8_BITS = (2, 3, 4)


def real_shaped(r: int, c: int, n: int, seed: int = 0, device: str = "cpu"):
    """Heavy-tailed weights; activations with log-normal channel scales (a few channels
    100x the rest, as in LLMs), correlated through a low-rank component, plus dead channels;
    drawn on the CPU (the same on every device), H's product and both tensors on ``device``."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(c, generator=g) * 1.0)
    scale[torch.randperm(c, generator=g)[: c // 256]] *= 30
    X = torch.randn(n, c, generator=g) * scale
    X += torch.randn(n, 32, generator=g) @ torch.randn(32, c, generator=g) * scale * 0.3
    X[:, torch.randperm(c, generator=g)[:4]] = 0
    X = X.to(device).double()
    H = (X.T @ X) / n
    # Student-t with 4 degrees of freedom, z / sqrt(χ²₄/4), from the seeded generator
    chi2 = (torch.randn(4, r, c, generator=g) ** 2).sum(0)
    W = torch.randn(r, c, generator=g) / (chi2 / 4).sqrt() * 0.02
    return W.to(device), H


def best_time(fn, repeats):
    best, out = float("inf"), None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        if torch.cuda.is_available():   # a GPU's work done before the clock stops
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best, out


def e8_section(shapes: str, tokens: int, repeats: int, bits=E8_BITS, device: str = "cpu") -> dict:
    """(c): every layer of ``shapes`` (``"OUTxIN,…"``) rotated, solved on ``device`` by GPTQ-4b g128 and by
    e8 at ``bits`` (``--group-size 16 --scale-bits 4``), in interleaved rounds → {name: (s, error)}, each
    summed over the layers (the best round's time a layer); each time printed as it is taken."""
    layers = []
    for i, shape in enumerate(shapes.split(",")):
        r, c = map(int, shape.split("x"))
        W, H = real_shaped(r, c, tokens, seed=i, device=device)
        signs = Rotation(0).signs(c).to(device)
        layers.append((rotate_weight(W, signs), rotate_hessian(H, signs)))
    jobs = {"gptq_4b": lambda W, H: gptq(W, H, bits=4, group_size=128, order="act"),
            **{f"e8_{b}b": (lambda W, H, b=b: e8(W, H, bits=b, group_size=16, scale_bits=4)) for b in bits}}
    small = min(layers, key=lambda wh: wh[0].numel())
    for f in jobs.values():   # warm-up: the C++ ops build/load
        f(*small)
    t = {k: [float("inf")] * len(layers) for k in jobs}
    err = {k: 0.0 for k in jobs}
    for rnd in range(repeats):
        for k, f in jobs.items():
            for i, (W, H) in enumerate(layers):
                dt, res = best_time(lambda: f(W, H), 1)
                print(f"    {k} {W.shape[0]}x{W.shape[1]} on {device}: {dt:.2f}s", flush=True)
                t[k][i] = min(t[k][i], dt)
                if rnd == 0:
                    err[k] += relative_error(W, res.q, H)
    return {k: (sum(t[k]), err[k]) for k in jobs}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--e8-shapes", default=SMOL_BLOCK, help="(c): the layers, OUTxIN comma-separated")
    ap.add_argument("--e8-tokens", type=int, default=2048, help="(c): tokens of each layer's Hessian")
    ap.add_argument("--sections", default="abc", help="which of (a)/(b) (one run: both) and (c) to run")
    ap.add_argument("--e8-bits", default=",".join(map(str, E8_BITS)), help="(c): E8's bits a weight, comma-separated")
    ap.add_argument("--device", default="cpu", help="(c): where the layers are solved (cpu, cuda)")
    a = ap.parse_args(argv)
    heads = []
    if "a" in a.sections or "b" in a.sections:
        heads.append(solver_section(a))
    if "c" in a.sections:
        heads.append(e8_report(a))
    print("HEADLINE " + " ".join(heads))


def e8_report(a) -> str:
    """Run and print (c) → its HEADLINE keys."""
    bits = tuple(int(b) for b in a.e8_bits.split(","))
    res = e8_section(a.e8_shapes, a.e8_tokens, a.repeats, bits, a.device)
    n = len(a.e8_shapes.split(","))
    t_g, e_g = res["gptq_4b"]
    print(f"(c) {n} layers ({a.e8_shapes}), rotated, solved on {a.device}; seconds summed over them, relative "
          "layer error summed")
    print(f"    GPTQ-4b g128  {t_g:7.2f}s  error {e_g:.5f}")
    for b in bits:
        t_e, e_e = res[f"e8_{b}b"]
        print(f"    E8-{b}b s4-g16 {t_e:7.2f}s  error {e_e:.5f}  = {t_e / t_g:5.2f}x GPTQ-4b's time"
              + ("  (target ≤ 2)" if b == 3 else ""))
    return " ".join(f"e8_{b}b_vs_gptq={res[f'e8_{b}b'][0] / t_g:.2f}" for b in bits) + \
        (f" e8_3b_s={res['e8_3b'][0]:.4g}" if 3 in bits else "") + f" gptq_4b_s={t_g:.4g}"


def solver_section(a) -> str:
    """Run and print (a) and (b) → their HEADLINE keys."""
    r, c = a.rows, a.cols
    W, H = real_shaped(r, c, a.tokens)
    print(f"layer {r}x{c}, Hessian from {a.tokens} tokens, torch threads={torch.get_num_threads()}")

    f_gptq = r * c * c + 2 * c**3 / 3
    f_babai = 2 * r * c * c + c**3 / 3
    n_gptq, n_babai = (round((f / 2) ** (1 / 3)) for f in (f_gptq, f_babai))
    mats = {n: (torch.randn(n, n), torch.randn(n, n)) for n in (n_gptq, n_babai)}
    jobs = {"gptq": lambda: gptq(W, H, bits=4, group_size=128, order="act"),
            "gemm_gptq": lambda: torch.mm(*mats[n_gptq]),
            "babai": lambda: babai(W, H, bits=4, group_size=128, order="act"),
            "gemm_babai": lambda: torch.mm(*mats[n_babai]),
            "ssqr": lambda: ssqr(W, H, bits=4, outlier_rate=0.01),
            "hptq": lambda: hptq(W, H, target_bits=3.125)}
    for f in jobs.values():   # warm-up: the C++ ops build/load, MKL picks its kernels
        f()
    # interleaved rounds, best of each: this VM's speed drifts between minutes, and MKL's
    # between calls (the cheap GEMM reference gets three tries per round)
    t, out = {k: float("inf") for k in jobs}, {}
    for _ in range(a.repeats):
        for k, f in jobs.items():
            for _ in range(3 if k.startswith("gemm") else 1):
                dt, out[k] = best_time(f, 1)
                t[k] = min(t[k], dt)
    t_gptq, t_babai, t_ssqr, t_hptq = t["gptq"], t["babai"], t["ssqr"], t["hptq"]
    g_gptq = t["gemm_gptq"] * f_gptq / (2 * n_gptq**3)
    g_babai = t["gemm_babai"] * f_babai / (2 * n_babai**3)
    s, h = out["ssqr"], out["hptq"]
    full = {k: sum(e[0] == "full" for e in x.info["search"]) for k, x in (("ssqr", s), ("hptq", h))}

    print(f"(a) GPTQ  {t_gptq:7.2f}s  GEMM-equivalent {g_gptq:6.2f}s  ratio {t_gptq / g_gptq:5.2f}  (target ≤ 2)")
    print(f"    Babai {t_babai:7.2f}s  GEMM-equivalent {g_babai:6.2f}s  ratio {t_babai / g_babai:5.2f}  (target ≤ 2)")
    print(f"(b) SSQR-1% {t_ssqr:6.2f}s = {t_ssqr / t_gptq:4.2f}x GPTQ  (rate {s.outlier_rate:.4%}, "
          f"{s.bits_per_weight:.3f} bits, {len(s.info['search'])} search evaluations, "
          f"{full['ssqr']} on the full matrix)  (target ≤ 3)")
    print(f"    HPTQ-3.125 {t_hptq:5.2f}s = {t_hptq / t_gptq:4.2f}x GPTQ  ({h.bits_per_weight:.4f} bits, "
          f"{full['hptq']} full-matrix evaluations)  (target ≤ 3)")
    return (f"gptq_vs_gemm={t_gptq / g_gptq:.2f} babai_vs_gemm={t_babai / g_babai:.2f} "
            f"ssqr_vs_gptq={t_ssqr / t_gptq:.2f} hptq_vs_gptq={t_hptq / t_gptq:.2f}")


if __name__ == "__main__":
    main()
