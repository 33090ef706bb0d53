"""Cheaper outlier codings at equal served bits: SSQR (4-bit, g128) on the real
SmolLM2 layers of ``vllm_latq.testing.hessians.real_layer_hessians``, each outlier coding priced in the
CPU kernel's 16-row tiles (padding slots counted, ``cpu_layouts.tile_slots``) and solved at
the outlier rate that spends the same outlier bits as fp16 values at 1 %.

Codings (value + column per slot):
  fp16+i16     the checkpoint's fp16 value, int16 column (the CPU kernel's form: 32 bits)
  int8+i16     z on the group's scale, |z| ≤ 127 (24 bits); outliers past int8 keep fp16
               (counted at 32 bits: a second, fp16 tile)
  fp16+d8      fp16 value, column as a uint8 gap from the lane's previous column (24 bits);
               a gap ≥ 255 costs one more slot in that lane (an escape with the int16 column)
  int8+d8      both (16 bits)
The int8 codings are solved with the int8 rounding inside the sweep (its error propagated,
as for an inlier), not by re-rounding fp16 outliers afterwards ("int8 post" shows what that
would cost at 1 %). Error: the layer error Σ_i (q_i − w_i)ᵀ H (q_i − w_i) relative to
Σ_i w_iᵀ H w_i; bits: inliers + scales (the CPU kernel's bf16 scale + zero per 128, 0.25 b/w)
+ the outliers' tiles, per weight.

Certificate: an int8 outlier is round(ω/s) on the same lattice s·ℤ as the inliers, only with
a wider clip window, so its error is ≤ s/2 — the per-coordinate bound the certificate
¼ Σ D s² already assumes — and the bound holds as stated (an fp16 outlier's error ≈ 0 only
makes the actual error smaller than the bound).
Ends with ``HEADLINE``. ``nice -n 5 python -m bench.outlier_codings``.
"""
from __future__ import annotations

import argparse
import importlib
import time
from unittest import mock

import torch

from vllm_latq.testing.hessians import real_layer_hessians
from vllm_latq import native
from vllm_latq.format.csr import csr_rows
from vllm_latq.kernels.cpu.layouts import TILE, tile_slots
from vllm_latq.algorithms import lattice
from vllm_latq.algorithms.solvers import Rounder

ssqr_module = importlib.import_module("vllm_latq.algorithms.ssqr")   # the module (the package exports the function)

BITS, GROUP, BASE_RATE = 4, 128, 0.01
SCALE_BITS = 32 / 128        # the CPU kernel's bf16 scale + zero per op group of 128
INT8 = (-128, 127)
# bits per slot (value + column) of each coding; the rate that spends 1 % × 32 bits
CODINGS = {"fp16+i16": (16, 16), "int8+i16": (8, 16), "fp16+d8": (16, 8), "int8+d8": (8, 8)}


class Int8OutlierRounder(Rounder):
    """SSQR's rounding with outliers kept as int8 integers on the group scale (error ≤ s/2,
    propagated like an inlier's); past int8 an outlier keeps its fp16 value, as in SSQR."""

    @classmethod
    def of(cls, bits, clip, outliers=False):
        base = Rounder.of(bits, clip, outliers)
        return cls(base.qmin, base.qmax, base.outliers)

    def __call__(self, omega, s, z, q):
        torch.div(omega, s, out=z).round_()
        out = (z < self.qmin) | (z > self.qmax)
        wide = (z < INT8[0]) | (z > INT8[1])
        torch.mul(z, s, out=q)                                     # int8 outliers: z·s
        q[wide] = omega[wide].half().to(omega.dtype)
        z.masked_fill_(out, 0.0)
        return out


def solve(W, H, rate: float, int8: bool):
    """SSQR at ``rate``; ``int8``: with :class:`Int8OutlierRounder` (the torch sweep, which
    calls the rounder per column)."""
    if not int8:
        return ssqr_module.ssqr(W, H, bits=BITS, group_size=GROUP, outlier_rate=rate)
    with native.disabled(), mock.patch.object(ssqr_module, "Rounder", Int8OutlierRounder):
        return ssqr_module.ssqr(W, H, bits=BITS, group_size=GROUP, outlier_rate=rate)


def rel_error(W, q, H) -> float:
    return float(lattice.layer_error(W, q, H).sum() / lattice.layer_error(W, torch.zeros_like(W), H).sum())


def outlier_bits(res, value_bits: int, col_bits: int, W) -> float:
    """Bits/weight of the outliers in 16-row tiles (off int32 per tile, rows int32 per lane,
    slots of value + column for 16 lanes); escapes: int8 values past int8 (a second fp16 tile
    set) and uint8 column gaps ≥ 255 (one more slot in the lane)."""
    n, k = W.shape
    T = -(-n // TILE)
    index_bits = 8 * (4 * (T + 1) + 4 * T * TILE)   # off + rows of one tile set
    o = res.outliers
    rows = csr_rows(o.crow, o.nnz)
    cnt = torch.bincount(rows, minlength=n)
    extra_bits = 0.0
    if value_bits == 8:   # past int8: an fp16 + int16 tile set of its own
        z = torch.round(o.val.float() / _group_scale(res, rows, o.col.long()))
        wide = (z < INT8[0]) | (z > INT8[1])
        if wide.any():
            wcnt = torch.bincount(rows[wide], minlength=n)
            extra_bits = index_bits + 32 * tile_slots(wcnt) * TILE
            cnt = cnt - wcnt
    if col_bits == 8:     # gaps from the previous column of the same row (first: from column 0)
        first = torch.ones_like(rows, dtype=torch.bool)
        first[1:] = rows[1:] != rows[:-1]
        prev = torch.where(first, torch.zeros_like(o.col), torch.roll(o.col, 1))
        esc = (o.col - prev) >= 255
        cnt = cnt + torch.bincount(rows[esc], minlength=n)
    tiles = index_bits + (value_bits + col_bits) * tile_slots(cnt) * TILE
    return (tiles + extra_bits) / (n * k)


def _group_scale(res, rows, cols):
    return res.scales.float()[rows, cols // GROUP]


def post_int8(res, W) -> torch.Tensor:
    """fp16 outliers re-rounded to int8 on their group scale after the solve (no propagation)."""
    o = res.outliers
    rows, cols = csr_rows(o.crow, o.nnz), o.col.long()
    s = _group_scale(res, rows, cols)
    z = torch.round(o.val.float() / s)
    keep = (z >= INT8[0]) & (z <= INT8[1])
    q = res.q.clone()
    q[rows[keep], cols[keep]] = z[keep] * s[keep]
    return q


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", nargs="*", help="names among vllm_latq.testing.hessians.REAL_LAYERS (default: all)")
    a = ap.parse_args(argv)
    torch.set_num_threads(2)
    layers = real_layer_hessians()
    names = a.layers or list(layers)
    rows_out = {c: [] for c in CODINGS}
    post = []
    print(f"SSQR {BITS}-bit g{GROUP} on SmolLM2 layers; rates give every coding the outlier bits of fp16+i16 "
          f"at {BASE_RATE:.0%}; bits = served CPU bits/weight (scales {SCALE_BITS:.2f} + inliers {BITS} + tiles)")
    print(f"{'layer':34s} {'coding':9s} {'rate%':>6s} {'outl b/w':>8s} {'served':>7s} {'rel.err':>9s} "
          f"{'vs fp16@1%':>10s} {'s':>5s}")
    for name in names:
        W, H = layers[name]
        W = W.float()
        base_err = None
        for coding, (vb, cb) in CODINGS.items():
            rate = BASE_RATE * 32 / (vb + cb)
            t0 = time.perf_counter()
            res = solve(W, H, rate, int8=vb == 8)
            err = rel_error(W, res.q, H)
            ob = outlier_bits(res, vb, cb, W)
            base_err = err if base_err is None else base_err
            rows_out[coding].append((ob, err / base_err))
            print(f"{name:34s} {coding:9s} {100 * res.outliers.nnz / W.numel():6.3f} {ob:8.4f} "
                  f"{BITS + SCALE_BITS + ob:7.4f} {err:9.3e} {err / base_err:10.4f} {time.perf_counter() - t0:5.1f}")
            if coding == "fp16+i16":
                post_err = rel_error(W, post_int8(res, W), H)
                post.append(post_err / err)
                print(f"{name:34s} {'int8 post':9s} {100 * res.outliers.nnz / W.numel():6.3f} "
                      f"{outlier_bits(res, 8, 16, W):8.4f} {'':7s} {post_err:9.3e} {post_err / err:10.4f}")
    head = {}
    for coding, vals in rows_out.items():
        key = coding.replace("+", "_")
        head[f"{key}_outl_bits"] = sum(v[0] for v in vals) / len(vals)
        head[f"{key}_err_vs_fp16"] = sum(v[1] for v in vals) / len(vals)
    head["int8_post_err_vs_fp16"] = sum(post) / len(post)
    print("HEADLINE " + " ".join(f"{k}={v:.4f}" for k, v in head.items()))


if __name__ == "__main__":
    main()
