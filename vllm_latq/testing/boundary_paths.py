"""The CUDA-boundary paths that need no vLLM, on any device: what latq hands vLLM's kernels, made on
that device and multiplied out as the kernels compute, against latq's reference; one line per
path. ``scripts/gpu_check.sh`` runs it on a bare CUDA machine:

    python -m vllm_latq.testing.boundary_paths [--device cuda]"""
from __future__ import annotations

import argparse
import math
import sys

import torch

from ..kernels import vllm_moe, vllm_mp
from ..kernels.reference import latq_linear_ref
from ..kernels.weight import LatqWeight
from ..plugin.slicing import slice_dense
from .cuda_ops import unpack_rows
from .weights import random_weight

U = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}


def handed_product(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """``x @ Wᵀ`` from compressed-tensors' N-first words ``[N, K·b/32]`` and scales ``[N, G]``:
    offset-binary integers unpacked along K, dequantized in ``x``'s type, summed in fp32."""
    z = unpack_rows(words.t().contiguous(), bits).t() - 2 ** (bits - 1)
    w = z.to(x.dtype) * scales.to(x.dtype).repeat_interleave(z.shape[1] // scales.shape[1], 1)
    return (x.float() @ w.float().t()).to(x.dtype)


def _worst(w: LatqWeight, x: torch.Tensor, y: torch.Tensor) -> float:
    """max |y − reference| over its bound: the weights and the output each rounded once to x's
    type, K fp32 products (as ``boundary_layers``)."""
    from ..kernels.weight import dequantize
    want = latq_linear_ref(x.float(), w).float()
    scale = x.float().abs() @ dequantize(w).abs().t()
    bound = 3 * (U[x.dtype] + w.in_features * 2.0 ** -24) * scale + 1e-6
    return float(((y.float() - want).abs() / bound).max())


def linear_path(w: LatqWeight, dtype: torch.dtype) -> float:
    x = torch.randn(5, w.in_features, generator=torch.Generator().manual_seed(1)).to(dtype).to(w.qweight.device)
    g = vllm_mp.vllm_group(w)
    return _worst(w, x, handed_product(x, vllm_mp.packed_words(w), vllm_mp.group_scales(w, g), w.bits))


def row_cut(w: LatqWeight, rank: int, ranks: int) -> LatqWeight:
    """``w``'s columns of one row-parallel rank, as latq's loader cuts them."""
    t = {"qweight": w.qweight, "scales": w.scales, "outlier_crow": w.crow, "outlier_col": w.col,
         "outlier_val": w.val}
    k = w.in_features // ranks
    return slice_dense(t, w.bits, w.group_size, w.in_features, [(0, w.out_features)], rank * k, k)


def experts_path(device, dtype: torch.dtype, experts: int = 4, hidden: int = 256, inter: int = 128) -> float:
    weights = {(e, s): random_weight(*shape, 4, 0.0, group=64, seed=e + 10 * i).to(device)
               for e in range(experts) for i, (s, shape) in enumerate((("w13", (2 * inter, hidden)),
                                                                      ("w2", (hidden, inter))))}
    g = vllm_moe.moe_groups(weights)[0]
    t = vllm_moe.expert_tensors(weights, experts, g, dtype)
    worst = 0.0
    for (e, stem), w in weights.items():
        x = torch.randn(3, w.in_features, generator=torch.Generator().manual_seed(e)).to(dtype).to(device)
        y = handed_product(x, t[f"{stem}_weight_packed"][e], t[f"{stem}_weight_scale"][e], 4)
        worst = max(worst, _worst(w, x, y))
    return worst


def paths(device: torch.device) -> list[tuple[str, float]]:
    """(path, worst error over its bound) for each path, on ``device``."""
    out = []
    for dtype in (torch.float16, torch.bfloat16):
        name = str(dtype).split(".")[-1]
        for bits, group, coded in ((4, 64, None), (8, 128, None), (4, 64, 4)):
            w = random_weight(256, 576, bits, 0.0, group=group, seed=bits, scale_bits=coded).to(device)
            out.append((f"linear {bits}-bit g{group}{' coded scales' if coded else ''} {name}", linear_path(w, dtype)))
        w = random_weight(256, 576, 4, 0.0, group=128, seed=5).to(device)
        cuts = [row_cut(w, r, 2) for r in range(2)]
        told = {vllm_mp.vllm_group(c) for c in cuts}
        out.append((f"row-parallel rank of K 576 at g128 (told g{math.gcd(*told)}) {name}",
                    max(linear_path(c, dtype) for c in cuts)))
        out.append((f"experts 4-bit g64 {name}", experts_path(device, dtype)))
    return out


def main(argv=None) -> int:
    a = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = a.parse_args(argv)
    device = torch.device(args.device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    failed = 0
    for name, worst in paths(device):
        ok = worst <= 1.0
        failed += not ok
        print(f"boundary {name}: {'ok' if ok else 'FAIL'} (worst error / bound {worst:.3f}, {device.type}: {where})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
