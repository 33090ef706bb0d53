"""Every registered C++ op (``vllm_latq/native.py``'s library) refuses arguments it cannot compute
with one Python exception (a ``TORCH_CHECK``: RuntimeError), never a signal: each op is called with
arguments on both sides of each of its checks (sizes, divisibility, dtypes, shapes, contiguity,
index ranges). The cases run in one child process; where one kills it, the parent notes that case
and starts a child on the rest, so one test names every case that crashes."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_latq import native

pytestmark = pytest.mark.usefixtures("native_ops")

ROOT = Path(__file__).resolve().parents[2]
OK, RAISES, EITHER = "ok", "raises", "either"   # EITHER: a valid call some builds decline (no GEMV here)
N, K, G = 32, 64, 32


def _t(*shape, dtype=torch.bfloat16, fill=None):
    if fill is not None:
        return torch.full(shape, fill, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(*shape).to(dtype)
    return torch.randint(0, 8, shape, dtype=dtype)


def _small(**kw):
    """latq_cpu::small_linear on a valid [32 x 64] 4-bit layer, group 32, with ``kw`` replaced."""
    a = dict(x=_t(2, K), packed=_t(N, K // 2, dtype=torch.uint8), scales=_t(K // G, N, fill=0.01), crow=None,
             col=None, val=None, tile_off=None, tile_rows=None, tile_col=None, tile_val=None, row_scale=None,
             bias=None, group_size=G, planes=1)
    a.update(kw)
    return lambda: torch.ops.latq_cpu.small_linear(*a.values())


def _csr(nnz=2, **kw):
    crow = torch.zeros(N + 1, dtype=torch.int32)
    crow[1:] = nnz
    a = dict(crow=crow, col=torch.arange(nnz, dtype=torch.int32), val=torch.ones(nnz))
    a.update(kw)
    return a


def _tiles(**kw):
    rows = torch.arange(N, dtype=torch.int32).view(2, 16)
    col = torch.full((2, 16), -1, dtype=torch.int16)
    col[:, 0] = 3
    a = dict(tile_off=torch.tensor([0, 1, 2], dtype=torch.int32), tile_rows=rows, tile_col=col,
             tile_val=torch.ones(2, 16, dtype=torch.float16))
    a.update(kw)
    return a


def _state(x=None, ints=(N, K, G, 1, 0, 0), out=N, signs=None, **kw):
    """latq_cpu::linear on the same layer's flattened state."""
    t = dict(packed=_t(N, K // 2, dtype=torch.uint8), scales=_t(K // G, N, fill=0.01))
    t.update(kw)
    tensors = [t["packed"], t["scales"]] + [None] * 8 + ([signs] if signs is not None else [])
    x = _t(3, K) if x is None else x
    return lambda: torch.ops.latq_cpu.linear(x, tensors, list(ints), None, out)


def _plain(x=None, ints=(N, K, G, 1, 0, 0), out=N, signs=None):
    x = _t(1, K) if x is None else x
    p, s = _t(N, K // 2, dtype=torch.uint8), _t(K // G, N, fill=0.01)
    if signs is None:
        return lambda: torch.ops.latq_cpu.plain_linear(x, p, s, list(ints), out)
    return lambda: torch.ops.latq_cpu.rotated_plain_linear(x, p, s, list(ints), out, signs)


def _gemv(x=None, group=G, packed=None, scales=None):
    x = _t(1, K) if x is None else x
    p = _t(N, K // 2, dtype=torch.uint8) if packed is None else packed
    s = _t(K // G, N, fill=0.01) if scales is None else scales
    return lambda: torch.ops.latq_cpu.gemv(x, p, s, group)


def _sweep(c=32, r=8, nb=16, **kw):
    """latq_cpu::back_substitution_subblock on a valid c = 32, r = 8 problem, rows 16..31."""
    a = dict(X=torch.randn(c, r), B=torch.zeros(nb, r), M=torch.randn(c, c), S=torch.ones(2, r),
             gidx=torch.arange(c) // 16, rows=torch.arange(c), Zt=torch.zeros(c, r, dtype=torch.int32),
             Qt=torch.zeros(c, r), Ot=None, Rt=None, j0=16, k1=0, k2=16, mode=0, qmin=-8.0, qmax=7.0)
    a.update(kw)
    return lambda: torch.ops.latq_cpu.back_substitution_subblock(*a.values())


def _gram(op="exact_add", p=4, q=3, n=5, **kw):
    a = dict(a=torch.randn(n, p).bfloat16(), b=torch.randn(n, q).bfloat16(), P=torch.randn(p, q),
             hi=torch.zeros(p, q, dtype=torch.float64), lo=torch.zeros(p, q, dtype=torch.float64),
             inexact=torch.zeros((), dtype=torch.bool))
    a.update(kw)
    if op == "exact_add":
        return lambda: torch.ops.latq_cpu.exact_add(a["P"], a["hi"], a["lo"], a["inexact"])
    return lambda: torch.ops.latq_cpu.bf16_tn_add(a["a"], a["b"], a["hi"], a["lo"], a["inexact"])


def cases() -> list[tuple[str, str, object]]:
    """(name, expected outcome, call) for every op but codebook_linear (:func:`codebook_cases`)."""
    torch.manual_seed(0)
    T = torch.ones
    c = [
        ("small_linear valid", OK, _small()),
        ("small_linear valid fp32 x", OK, _small(x=_t(2, K, dtype=torch.float32))),
        ("small_linear valid M=0", OK, _small(x=_t(0, K))),
        ("small_linear valid bias", OK, _small(bias=_t(N))),
        ("small_linear valid CSR", OK, _small(**_csr())),
        ("small_linear valid tiles", EITHER, _small(**_tiles())),
        ("small_linear valid coded", EITHER, _small(scales=torch.zeros(K // G, N // 16, 3, dtype=torch.int32))),
        ("small_linear valid pairs", EITHER, _small(scales=_t(K // G, N, 2, fill=0.01))),
        ("small_linear valid two planes", EITHER, _small(packed=_t(N, K, dtype=torch.uint8),
                                                         scales=_t(2 * K // G, N, fill=0.01), planes=2)),
        ("small_linear x 1-D", RAISES, _small(x=_t(K))),
        ("small_linear x 3-D", RAISES, _small(x=_t(1, 2, K))),
        ("small_linear x int", RAISES, _small(x=_t(2, K, dtype=torch.int32))),
        ("small_linear x other K", RAISES, _small(x=_t(2, 48))),
        ("small_linear K=0", RAISES, _small(x=_t(2, 0), packed=_t(N, 0, dtype=torch.uint8),
                                            scales=_t(0, N))),
        ("small_linear packed int32", RAISES, _small(packed=_t(N, K // 2, dtype=torch.int32))),
        ("small_linear packed 1-D", RAISES, _small(packed=_t(N * K // 2, dtype=torch.uint8))),
        ("small_linear packed 0-D", RAISES, _small(packed=torch.tensor(1, dtype=torch.uint8))),
        ("small_linear packed not contiguous", RAISES, _small(packed=_t(K // 2, N, dtype=torch.uint8).t())),
        ("small_linear packed narrower", RAISES, _small(packed=_t(N, K // 4, dtype=torch.uint8))),
        ("small_linear N=0", RAISES, _small(packed=_t(0, K // 2, dtype=torch.uint8), scales=_t(K // G, 0))),
        ("small_linear N=24", RAISES, _small(packed=_t(24, K // 2, dtype=torch.uint8), scales=_t(K // G, 24))),
        ("small_linear planes 0", RAISES, _small(planes=0)),
        ("small_linear planes 3", RAISES, _small(planes=3)),
        ("small_linear planes 2 one plane packed", RAISES, _small(planes=2)),
        ("small_linear group 0", RAISES, _small(group_size=0)),
        ("small_linear group -32", RAISES, _small(group_size=-32)),
        ("small_linear group 48", RAISES, _small(group_size=48)),
        ("small_linear group 2^62", RAISES, _small(group_size=2**62)),
        ("small_linear scales fp16", RAISES, _small(scales=_t(K // G, N, dtype=torch.float16))),
        ("small_linear scales more groups", RAISES, _small(scales=_t(K // G + 1, N))),
        ("small_linear scales fewer rows", RAISES, _small(scales=_t(K // G, N - 16))),
        ("small_linear scales [G, N, 3]", RAISES, _small(scales=_t(K // G, N, 3))),
        ("small_linear scales not contiguous", RAISES, _small(scales=_t(N, K // G).t())),
        ("small_linear scales 1-D", RAISES, _small(scales=_t(K // G * N))),
        ("small_linear coded wrong shape", RAISES, _small(scales=torch.zeros(K // G, N // 16, 2, dtype=torch.int32))),
        ("small_linear coded two planes", RAISES, _small(packed=_t(N, K, dtype=torch.uint8), planes=2,
                                                         scales=torch.zeros(2 * K // G, N // 16, 3, dtype=torch.int32))),
        ("small_linear crow alone", RAISES, _small(crow=_csr()["crow"])),
        ("small_linear crow short", RAISES, _small(**_csr(crow=torch.zeros(N, dtype=torch.int32)))),
        ("small_linear crow int64", RAISES, _small(**_csr(crow=_csr()["crow"].long()))),
        ("small_linear crow end != nnz", RAISES, _small(**_csr(crow=_csr(nnz=5)["crow"]))),
        ("small_linear crow start != 0", RAISES, _small(**_csr(crow=torch.full((N + 1,), 2, dtype=torch.int32)))),
        ("small_linear col shorter than val", RAISES, _small(**_csr(col=torch.arange(1, dtype=torch.int32)))),
        ("small_linear val fp16", RAISES, _small(**_csr(val=torch.ones(2, dtype=torch.float16)))),
        ("small_linear col int16", RAISES, _small(**_csr(col=torch.arange(2, dtype=torch.int16)))),
        ("small_linear tile_off alone", RAISES, _small(tile_off=_tiles()["tile_off"])),
        ("small_linear tile_off short", RAISES, _small(**_tiles(tile_off=torch.tensor([0, 2], dtype=torch.int32)))),
        ("small_linear tile_off end != S", RAISES, _small(**_tiles(tile_off=torch.tensor([0, 1, 3], dtype=torch.int32)))),
        ("small_linear tile_off not monotone", RAISES,
         _small(**_tiles(tile_off=torch.tensor([0, 5, 2], dtype=torch.int32)))),
        ("small_linear tile_rows 1-D", RAISES, _small(**_tiles(tile_rows=torch.arange(N, dtype=torch.int32)))),
        ("small_linear tile_rows row 100", RAISES,
         _small(**_tiles(tile_rows=torch.full((2, 16), 100, dtype=torch.int32)))),
        ("small_linear tile_rows row -1", RAISES,
         _small(**_tiles(tile_rows=torch.full((2, 16), -1, dtype=torch.int32)))),
        ("small_linear tile_col int32", RAISES, _small(**_tiles(tile_col=torch.zeros(2, 16, dtype=torch.int32)))),
        ("small_linear tile_col [2, 8]", RAISES, _small(**_tiles(tile_col=torch.zeros(2, 8, dtype=torch.int16)))),
        ("small_linear tile_val rows", RAISES, _small(**_tiles(tile_val=torch.ones(3, 16, dtype=torch.float16)))),
        ("small_linear tile_val int16 alone", RAISES, _small(**_tiles(tile_val=torch.ones(2, 16, dtype=torch.int16)))),
        ("small_linear tile_val int8", RAISES, _small(**_tiles(tile_val=torch.ones(2, 16, dtype=torch.int8)))),
        ("small_linear row_scale without tiles", RAISES, _small(row_scale=torch.ones(N))),
        ("small_linear row_scale short", RAISES, _small(**_tiles(tile_val=torch.ones(2, 16, dtype=torch.int16)),
                                                        row_scale=torch.ones(N - 1))),
        ("small_linear bias short", RAISES, _small(bias=_t(N - 1))),
        ("small_linear bias 2-D", RAISES, _small(bias=_t(1, N))),
        ("small_linear bias int", RAISES, _small(bias=_t(N, dtype=torch.int32))),
        ("linear valid", OK, _state()),
        ("linear valid 3-D x", OK, _state(x=_t(2, 3, K))),
        ("linear valid rotated", OK, _state(signs=T(16))),
        ("linear K=0", RAISES, _state(ints=(N, 0, G, 1, 0, 0))),
        ("linear K=-64", RAISES, _state(ints=(N, -K, G, 1, 0, 0))),
        ("linear N=0", RAISES, _state(ints=(0, K, G, 1, 0, 0), out=0)),
        ("linear out_features other", RAISES, _state(out=N + 16)),
        ("linear ints 5", RAISES, _state(ints=(N, K, G, 1, 0))),
        ("linear x other K", RAISES, _state(x=_t(3, 48))),
        ("linear x 0-D", RAISES, _state(x=torch.tensor(1.0).bfloat16())),
        ("linear x ragged", RAISES, _state(x=_t(3, K + 1))),
        ("linear no packed", RAISES, lambda: torch.ops.latq_cpu.linear(_t(1, K), [None] * 10, [N, K, G, 1, 0, 0],
                                                                       None, N)),
        ("linear 9 tensors", RAISES, lambda: torch.ops.latq_cpu.linear(_t(1, K), [None] * 9, [N, K, G, 1, 0, 0],
                                                                       None, N)),
        ("linear packed other rows", RAISES, _state(packed=_t(N + 16, K // 2, dtype=torch.uint8))),
        ("linear layout_block -1", RAISES, _state(ints=(N, K, G, 1, -1, 0))),
        ("linear signs 3", RAISES, _state(signs=T(3))),
        ("linear signs 128", RAISES, _state(signs=T(128))),
        ("linear signs 0", RAISES, _state(signs=T(0))),
        ("linear signs fp64", RAISES, _state(signs=T(16, dtype=torch.float64))),
        ("linear signs 2-D", RAISES, _state(signs=T(4, 4))),
        ("plain_linear valid", OK, _plain()),
        ("plain_linear K=0", RAISES, _plain(ints=(N, 0, G, 1, 0, 0))),
        ("plain_linear x other K", RAISES, _plain(x=_t(1, 32))),
        ("plain_linear ints 7", RAISES, _plain(ints=(N, K, G, 1, 0, 0, 0))),
        ("rotated_plain_linear valid", OK, _plain(signs=T(64))),
        ("rotated_plain_linear K=0", RAISES, _plain(ints=(N, 0, G, 1, 0, 0), signs=T(64))),
        ("rotated_plain_linear signs 6", RAISES, _plain(signs=T(6))),
        ("gemv valid", EITHER, _gemv()),
        ("gemv group 0", RAISES, _gemv(group=0)),
        ("gemv group -32", RAISES, _gemv(group=-32)),
        ("gemv group 6", RAISES, _gemv(group=6)),
        ("gemv x fp32", RAISES, _gemv(x=_t(1, K, dtype=torch.float32))),
        ("gemv x M=0", RAISES, _gemv(x=_t(0, K))),
        ("gemv x 1-D", RAISES, _gemv(x=_t(K))),
        ("gemv packed 1-D", RAISES, _gemv(packed=_t(N * K // 2, dtype=torch.uint8))),
        ("gemv packed 0-D", RAISES, _gemv(packed=torch.tensor(1, dtype=torch.uint8))),
        ("gemv scales short", RAISES, _gemv(scales=_t(1, N))),
        ("hadamard valid", OK, lambda: torch.ops.latq_cpu.hadamard(_t(3, K), T(16))),
        ("hadamard valid empty", OK, lambda: torch.ops.latq_cpu.hadamard(_t(0, K), T(16))),
        ("hadamard signs 3", RAISES, lambda: torch.ops.latq_cpu.hadamard(_t(3, K), T(3))),
        ("hadamard signs 0", RAISES, lambda: torch.ops.latq_cpu.hadamard(_t(3, K), T(0))),
        ("hadamard signs 128", RAISES, lambda: torch.ops.latq_cpu.hadamard(_t(3, K), T(128))),
        ("hadamard signs int", RAISES, lambda: torch.ops.latq_cpu.hadamard(_t(3, K), T(16, dtype=torch.int32))),
        ("hadamard signs not contiguous", RAISES, lambda: torch.ops.latq_cpu.hadamard(_t(3, K), T(32)[::2])),
        ("hadamard x 0-D", RAISES, lambda: torch.ops.latq_cpu.hadamard(torch.tensor(1.0), T(1))),
        ("hadamard x int", RAISES, lambda: torch.ops.latq_cpu.hadamard(_t(3, K, dtype=torch.int32), T(16))),
        ("mse_scales valid", OK, lambda: torch.ops.latq_cpu.mse_scales(torch.randn(4, 64), 4, 32, 10, 8, 0.2)),
        ("mse_scales ragged group", OK, lambda: torch.ops.latq_cpu.mse_scales(torch.randn(4, 64), 4, 48, 10, 8, 0.2)),
        ("mse_scales bits 1", RAISES, lambda: torch.ops.latq_cpu.mse_scales(torch.randn(4, 64), 1, 32, 10, 8, 0.2)),
        ("mse_scales bits 9", RAISES, lambda: torch.ops.latq_cpu.mse_scales(torch.randn(4, 64), 9, 32, 10, 8, 0.2)),
        ("mse_scales group 0", RAISES, lambda: torch.ops.latq_cpu.mse_scales(torch.randn(4, 64), 4, 0, 10, 8, 0.2)),
        ("mse_scales coarse 1", RAISES, lambda: torch.ops.latq_cpu.mse_scales(torch.randn(4, 64), 4, 32, 1, 8, 0.2)),
        ("mse_scales coarse 2^40", RAISES,
         lambda: torch.ops.latq_cpu.mse_scales(torch.randn(4, 64), 4, 32, 2**40, 8, 0.2)),
        ("mse_scales fine -1", RAISES, lambda: torch.ops.latq_cpu.mse_scales(torch.randn(4, 64), 4, 32, 10, -1, 0.2)),
        ("mse_scales fine 2^40", RAISES,
         lambda: torch.ops.latq_cpu.mse_scales(torch.randn(4, 64), 4, 32, 10, 2**40, 0.2)),
        ("mse_scales min_shrink nan", RAISES,
         lambda: torch.ops.latq_cpu.mse_scales(torch.randn(4, 64), 4, 32, 10, 8, float("nan"))),
        ("mse_scales W fp64", RAISES,
         lambda: torch.ops.latq_cpu.mse_scales(torch.randn(4, 64, dtype=torch.float64), 4, 32, 10, 8, 0.2)),
        ("mse_scales W 1-D", RAISES, lambda: torch.ops.latq_cpu.mse_scales(torch.randn(64), 4, 32, 10, 8, 0.2)),
        ("mse_scales W not contiguous", RAISES,
         lambda: torch.ops.latq_cpu.mse_scales(torch.randn(64, 4).t(), 4, 32, 10, 8, 0.2)),
        ("sweep valid", OK, _sweep()),
        ("sweep valid ssqr", OK, _sweep(Ot=torch.zeros(32, 8, dtype=torch.bool), mode=2)),
        ("sweep valid one scale", OK, _sweep(S=torch.ones(1, 1), gidx=torch.zeros(32, dtype=torch.long))),
        ("sweep valid babai", OK, _sweep(Qt=None)),
        ("sweep gidx out of S", RAISES, _sweep(gidx=torch.full((32,), 2, dtype=torch.long))),
        ("sweep gidx -1", RAISES, _sweep(gidx=torch.full((32,), -1, dtype=torch.long))),
        ("sweep gidx int32", RAISES, _sweep(gidx=torch.zeros(32, dtype=torch.int32))),
        ("sweep gidx short", RAISES, _sweep(gidx=torch.zeros(16, dtype=torch.long))),
        ("sweep rows out of tables", RAISES, _sweep(rows=torch.arange(32) + 10)),
        ("sweep rows -1", RAISES, _sweep(rows=torch.full((32,), -1, dtype=torch.long))),
        ("sweep k2 past B", RAISES, _sweep(k2=17)),
        ("sweep j0 + k2 past X", RAISES, _sweep(j0=17)),
        ("sweep j0 -1", RAISES, _sweep(j0=-1)),
        ("sweep k1 > k2", RAISES, _sweep(k1=5, k2=4)),
        ("sweep k1 -1", RAISES, _sweep(k1=-1)),
        ("sweep mode 3", RAISES, _sweep(mode=3)),
        ("sweep ssqr without Ot", RAISES, _sweep(mode=2)),
        ("sweep M smaller", RAISES, _sweep(M=torch.randn(16, 16))),
        ("sweep M fp64", RAISES, _sweep(M=torch.randn(32, 32, dtype=torch.float64))),
        ("sweep S other width", RAISES, _sweep(S=torch.ones(2, 5))),
        ("sweep S fp64", RAISES, _sweep(S=torch.ones(2, 8, dtype=torch.float64))),
        ("sweep X fp64", RAISES, _sweep(X=torch.randn(32, 8, dtype=torch.float64))),
        ("sweep X not contiguous", RAISES, _sweep(X=torch.randn(8, 32).t())),
        ("sweep B other width", RAISES, _sweep(B=torch.zeros(16, 4))),
        ("sweep Zt int64", RAISES, _sweep(Zt=torch.zeros(32, 8, dtype=torch.long))),
        ("sweep Zt other width", RAISES, _sweep(Zt=torch.zeros(32, 4, dtype=torch.int32))),
        ("sweep Qt other rows", RAISES, _sweep(Qt=torch.zeros(8, 8))),
        ("sweep Ot float", RAISES, _sweep(Ot=torch.zeros(32, 8), mode=2)),
        ("sweep Rt short", RAISES, _sweep(Rt=torch.zeros(32, 4))),
        ("permuted_damped valid", OK, lambda: torch.ops.latq_cpu.permuted_damped(torch.eye(4), torch.arange(4), 0.1,
                                                                                 torch.float32)),
        ("permuted_damped perm 4", RAISES,
         lambda: torch.ops.latq_cpu.permuted_damped(torch.eye(4), torch.tensor([0, 1, 2, 4]), 0.1, torch.float32)),
        ("permuted_damped perm -1", RAISES,
         lambda: torch.ops.latq_cpu.permuted_damped(torch.eye(4), torch.tensor([0, 1, 2, -1]), 0.1, torch.float32)),
        ("permuted_damped perm float", RAISES,
         lambda: torch.ops.latq_cpu.permuted_damped(torch.eye(4), torch.arange(4.0), 0.1, torch.float32)),
        ("permuted_damped perm short", RAISES,
         lambda: torch.ops.latq_cpu.permuted_damped(torch.eye(4), torch.arange(3), 0.1, torch.float32)),
        ("permuted_damped H not square", RAISES,
         lambda: torch.ops.latq_cpu.permuted_damped(torch.ones(4, 3), torch.arange(4), 0.1, torch.float32)),
        ("permuted_damped H int", RAISES,
         lambda: torch.ops.latq_cpu.permuted_damped(torch.ones(4, 4, dtype=torch.int32), torch.arange(4), 0.1,
                                                    torch.float32)),
        ("permuted_damped dtype int", RAISES,
         lambda: torch.ops.latq_cpu.permuted_damped(torch.eye(4), torch.arange(4), 0.1, torch.int32)),
        ("exact_add valid", OK, _gram()),
        ("exact_add valid column slice", OK, _gram(P=torch.randn(4, 6)[:, :3])),
        ("exact_add P fp64", RAISES, _gram(P=torch.randn(4, 3, dtype=torch.float64))),
        ("exact_add hi other shape", RAISES, _gram(hi=torch.zeros(4, 2, dtype=torch.float64))),
        ("exact_add lo fp32", RAISES, _gram(lo=torch.zeros(4, 3))),
        ("exact_add inexact 2", RAISES, _gram(inexact=torch.zeros(2, dtype=torch.bool))),
        ("exact_add inexact int", RAISES, _gram(inexact=torch.zeros((), dtype=torch.int32))),
        ("exact_add hi rows overlap", RAISES, _gram(hi=torch.zeros(1, 3, dtype=torch.float64).expand(4, 3))),
        ("exact_add P last dim strided", RAISES, _gram(P=torch.randn(3, 4).t())),
        ("bf16_tn_add valid", EITHER, _gram("bf16")),
        ("bf16_tn_add valid n=0", EITHER, _gram("bf16", n=0)),
        ("bf16_tn_add a fp32", RAISES, _gram("bf16", a=torch.randn(5, 4))),
        ("bf16_tn_add b other n", RAISES, _gram("bf16", b=torch.randn(6, 3).bfloat16())),
        ("bf16_tn_add hi other shape", RAISES, _gram("bf16", hi=torch.zeros(3, 4, dtype=torch.float64))),
        ("bf16_tn_add a rows overlap", RAISES, _gram("bf16", a=torch.randn(1, 4).bfloat16().expand(5, 4))),
        ("bf16_tn_add a 3-D", RAISES, _gram("bf16", a=torch.randn(5, 4, 1).bfloat16())),
        ("bf16_tn_add inexact 2", RAISES, _gram("bf16", inexact=torch.zeros(2, dtype=torch.bool))),
        ("set_gemv_isa bogus", RAISES, lambda: torch.ops.latq_cpu.set_gemv_isa("sse")),
        ("set_hadamard_isa bogus", RAISES, lambda: torch.ops.latq_cpu.set_hadamard_isa("sse")),
        ("set_gemv_max_m -1", RAISES, lambda: torch.ops.latq_cpu.set_gemv_max_m(-1)),
        ("set_loop_max -1", RAISES, lambda: torch.ops.latq_cpu.set_loop_max(-1)),
        ("set_large_m -1", RAISES, lambda: torch.ops.latq_cpu.set_large_m(-1)),
        ("set_prefetch_l2", OK, lambda: torch.ops.latq_cpu.set_prefetch_l2(True)),
    ]
    return c


def codebook_cases() -> list[tuple[str, str, object]]:
    """latq_cpu::codebook_linear (codebook.cpp) around its checks."""
    from vllm_latq.kernels.cpu.codebook import CPUCodebookKernel
    from vllm_latq.testing.weights import random_codebook_weight
    st = CPUCodebookKernel.prepare(random_codebook_weight(N, K, 3, group=32))
    tensors, ints = CPUCodebookKernel.flatten(st)
    tensors = list(tensors)

    def call(x=None, t=None, i=None, bias=None, out=N):
        x = _t(2, K) if x is None else x
        return lambda: torch.ops.latq_cpu.codebook_linear(x, tensors if t is None else t,
                                                          list(ints) if i is None else i, bias, out)
    bits, group, k = ints[0], ints[1], ints[2]
    codes, scales, table = tensors[:3]
    # a layer of one block (K = 8): group -8 then asks for ceil(8 / -8) = 0 scale columns
    narrow, _ = CPUCodebookKernel.flatten(CPUCodebookKernel.prepare(random_codebook_weight(N, 8, 3, group=8)))
    return [
        ("codebook_linear valid", OK, call()),
        ("codebook_linear valid rotated", OK, call(t=tensors[:3] + [torch.ones(16)])),
        ("codebook_linear group 0", RAISES, call(i=[bits, 0, k])),
        ("codebook_linear K=8, group -8, 0 scale columns", RAISES,
         call(x=_t(2, 8), t=[narrow[0], narrow[1][:, :0], narrow[2]], i=[bits, -8, 8])),
        ("codebook_linear group -8", RAISES, call(i=[bits, -8, k])),
        ("codebook_linear no tensors", RAISES, call(t=[None, None, None])),
        ("codebook_linear bits 5", RAISES, call(i=[5, group, k])),
        ("codebook_linear ints 2", RAISES, call(i=[bits, group])),
        ("codebook_linear K=0", RAISES, call(x=_t(2, 0), i=[bits, group, 0])),
        ("codebook_linear x 0-D", RAISES, call(x=torch.tensor(1.0).bfloat16())),
        ("codebook_linear x int", RAISES, call(x=_t(2, K, dtype=torch.int32))),
        ("codebook_linear out_features other", RAISES, call(out=N + 16)),
        ("codebook_linear bias short", RAISES, call(bias=_t(N - 1))),
        ("codebook_linear scales 1-D", RAISES, call(t=[codes, scales.flatten(), table])),
        ("codebook_linear table short", RAISES, call(t=[codes, scales, table[:8]])),
        ("codebook_linear signs 3", RAISES, call(t=tensors[:3] + [torch.ones(3)])),
        ("codebook_linear codes not contiguous", RAISES,
         call(t=[codes.transpose(0, 1).contiguous().transpose(0, 1), scales, table])),
        ("codebook_linear tile rows 32", RAISES, call(i=[bits, group, k, 32])),
        ("codebook_linear tile rows 64, 32 rows", RAISES, call(i=[bits, group, k, 64])),
        ("codebook_linear tile rows 64, row layout codes, 64 rows", RAISES,
         call(t=[torch.cat([codes, codes]), torch.cat([scales, scales]), table], i=[bits, group, k, 64], out=2 * N)),
        ("codebook_linear tiled codes, 64 rows", OK,
         call(t=[torch.cat([codes, codes]).reshape(1, 64, k // 8, bits).permute(0, 2, 3, 1).contiguous(),
                 torch.cat([scales, scales]), table], i=[bits, group, k, 64], out=2 * N)),
        ("codebook_linear set_codebook_large_m -1", RAISES, lambda: torch.ops.latq_cpu.set_codebook_large_m(-1)),
        ("codebook_linear set_codebook_isa bogus", RAISES, lambda: torch.ops.latq_cpu.set_codebook_isa("sse")),
    ]


def child(which: str, start: int) -> None:
    """Runs cases ``start``… printing ``BEGIN i`` before and ``END i outcome`` after each (for the parent)."""
    assert native.load() is None
    todo = cases() if which == "ops" else codebook_cases()
    for i in range(start, len(todo)):
        print(f"BEGIN {i}", flush=True)
        try:
            todo[i][2]()
            outcome = OK
        except RuntimeError as e:   # TORCH_CHECK; NotImplementedError (no kernel for a dtype) is one too
            outcome = f"{RAISES} {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        except Exception as e:   # noqa: BLE001 - reported: a check must raise RuntimeError
            outcome = f"other {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        print(f"END {i} {outcome}", flush=True)


def run_all(which: str, n: int) -> dict:
    """Each case's outcome: ``ok``, ``raises …``, ``other …`` or ``signal NAME`` (the child died in it);
    ``"exit"``: the signal a child died of after its last case (memory an earlier case corrupted)."""
    got: dict = {}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    start = 0
    while start < n:
        p = subprocess.run([sys.executable, "-c", f"from tests.kernels.test_native_op_checks import child; "
                            f"child({which!r}, {start})"], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=300)
        last = start
        for line in p.stdout.splitlines():
            parts = line.split(" ", 2)
            if parts[0] == "BEGIN":
                last = int(parts[1])
            elif parts[0] == "END":
                got[int(parts[1])] = parts[2]
        if p.returncode == 0:
            break
        assert p.returncode < 0, f"child failed outside a case:\n{p.stderr[-3000:]}"
        if last in got:   # died after its case ended (at exit, or in the next one's setup)
            got["exit"] = f"signal {signal.Signals(-p.returncode).name} after case {last}: {p.stderr.strip()[-200:]}"
        else:
            got[last] = f"signal {signal.Signals(-p.returncode).name}"
        start = last + 1
    return got


def _check(which: str, todo) -> None:
    got = run_all(which, len(todo))
    bad = []
    for i, (name, want, _) in enumerate(todo):
        out = got.get(i, "not run")
        fine = (out == OK if want == OK else out.startswith(RAISES) if want == RAISES
                else out == OK or out.startswith(RAISES))
        if not fine:
            bad.append(f"{name}: expected {want}, got {out}")
    if "exit" in got:
        bad.append(f"memory corrupted by some case: the child died by {got['exit']}")
    assert not bad, "\n".join(bad)


def test_every_op_refuses_what_it_cannot_compute_with_an_exception():
    _check("ops", cases())


def test_codebook_linear_refuses_what_it_cannot_compute_with_an_exception():
    _check("codebook", codebook_cases())
