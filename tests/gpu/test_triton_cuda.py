"""Triton kernels against the reference on a GPU: bits × M × outlier rate × dtype, ragged
shapes, K tails, the Qwen3-8B shapes, coded scales, every tensor-core tile and split-K config.

Run by ``scripts/gpu_check.sh`` on a CUDA machine (``TRITON_INTERPRET=0``); skipped elsewhere.
"""
from __future__ import annotations

import importlib

import pytest
import torch

from tests.gpu.cases import BITS, DEV, DTYPES, K_TAILS, MS, NAMES, QWEN3_8B, RAGGED, RATES, activations, assert_matches_reference, bias_for, fixed_config, kernel, needs_cuda, pytestmark, triton_module, triton_state, weight
from vllm_latq import format as fmt
from vllm_latq.kernels import ops, selector
from vllm_latq.kernels.triton.dequant import use_large_m
from vllm_latq.kernels.weight import LatqWeight


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rate", RATES)
@pytest.mark.parametrize("m", MS, ids=lambda m: f"m{m}")
@pytest.mark.parametrize("bits", BITS)
def test_triton_ragged(bits, m, rate, dtype):
    """Every M bucket of both kernels (SIMT GEMV row tiles 1/2/4/8, tensor-core 16/32/64-row
    tiles, several 64-row tiles with a ragged last one), on a shape that is a multiple of
    nothing; a bias at 1 % outliers."""
    n, k = RAGGED
    w = weight(n, k, bits, rate)
    st = triton_state(w)
    x = activations(m, k, dtype, seed=m)
    bias = bias_for(n, dtype) if rate == 0.01 else None
    kind, cfg = fixed_config(m, bits)
    y = kernel("triton").apply(st, x, bias, kernel=kind, config=cfg)
    assert_matches_reference(y, x, w, bias, what=f"{kind} {cfg}")


@pytest.mark.parametrize("rate", RATES[:2])
@pytest.mark.parametrize("m", [1, 4, 9, 17, 64, 256], ids=lambda m: f"m{m}")
@pytest.mark.parametrize("bits", BITS)
def test_triton_coded_scales(bits, m, rate):
    """Coded scales (format/scale_codes.py, group 64) on the ragged shape: the kernel of M with
    its first production tile, and from 17 rows the dequantize-once path too (z·s rounded to
    bf16 once)."""
    n, k = RAGGED
    w = weight(n, k, bits, rate, group=64, scale_bits=4)
    st = triton_state(w)
    assert st.coded_scales
    x = activations(m, k, torch.bfloat16, seed=m)
    kind, cfg = fixed_config(m, bits)
    assert_matches_reference(kernel("triton").apply(st, x, kernel=kind, config=cfg), x, w, what=f"coded {kind} {cfg}")
    if m >= 17:
        y = kernel("triton").apply(st, x, kernel="dequant")
        assert_matches_reference(y, x, w, exact=False, what="coded dequant")


@pytest.mark.parametrize("kind", ["gemv", "mma", "dequant"])
def test_triton_coded_scales_bit_exact(kind):
    """z = 1 everywhere and one-hot fp32 activations (exact sums; fp16 W for the dequantize
    path): each output is one decoded scale, which must equal ``scale_codes.decode_scales``
    bit for bit on the device (its FMA and fp16 rounding), scales from fp16 subnormals to ~100."""
    from vllm_latq.kernels.triton import dequant as triton_dequant
    n, k, groups = 48, 320, 5
    g = torch.Generator().manual_seed(3)
    S = (torch.randn(n, groups, generator=g) * 4).exp().mul(1e-3).clamp(2.0**-24, 100.0)
    coded = fmt.scale_codes.code_scales(S)
    want = fmt.scale_codes.decode_scales(coded.codes, coded.min, coded.step)
    w = LatqWeight(fmt.pack(torch.ones(n, k, dtype=torch.int32), 4), want.half(), torch.zeros(n + 1, dtype=torch.int32),
                   torch.zeros(0, dtype=torch.int32), torch.zeros(0), 4, 64, k, coded).to(DEV)
    st = kernel("triton").prepare(w)
    if kind == "dequant":
        out = torch.empty(n, k, dtype=torch.float16, device=DEV)
        got = triton_dequant.dequantize_into(st, out)[:, ::64].float().cpu()
    else:
        x = torch.zeros(groups, k, device=DEV)
        x[torch.arange(groups), 64 * torch.arange(groups)] = 1.0
        got = kernel("triton").apply(st, x, kernel=kind).T.cpu()
    assert torch.equal(got, want)


@needs_cuda
@pytest.mark.parametrize("m", [1, 64], ids=lambda m: f"m{m}")
@pytest.mark.parametrize("bits", [pytest.param(b, id=f"{b}bit") for b in (3, 4)])
def test_triton_8b_shapes_coded_scales(bits, m):
    """A Qwen3-8B projection with coded scales at group 64, autotuned (as served)."""
    n, k = QWEN3_8B[next(iter(QWEN3_8B))]
    w = weight(n, k, bits, 0.01, group=64, seed=0, scale_bits=4)
    x = activations(m, k, torch.bfloat16, seed=m)
    st = triton_state(w)
    y = kernel("triton").apply(st, x)
    assert_matches_reference(y, x, w, exact=not use_large_m(x), what=f"coded {n}x{k}")


@needs_cuda
@pytest.mark.parametrize("m", [1, 16, 64, 256], ids=lambda m: f"m{m}")
@pytest.mark.parametrize("shape", list(QWEN3_8B))
@pytest.mark.parametrize("bits", BITS)
def test_triton_8b_shapes(bits, shape, m):
    """The Qwen3-8B linears at 1 % outliers, bf16, the autotuned default path (as served; from
    the large-M crossover on, dequantize once + cuBLAS: weights rounded once to bf16)."""

    n, k = QWEN3_8B[shape]
    w = weight(n, k, bits, 0.01, seed=0)
    x = activations(m, k, torch.bfloat16, seed=m)
    st = triton_state(w)
    y = kernel("triton").apply(st, x)
    assert_matches_reference(y, x, w, exact=not use_large_m(x), what=f"{shape} {n}x{k}")


@pytest.mark.parametrize("m", [1, 3, 9, 33, 256], ids=lambda m: f"m{m}")
@pytest.mark.parametrize("shape", list(K_TAILS))
@pytest.mark.parametrize("bits", [pytest.param(b, id=f"{b}bit") for b in (3, 5)])
def test_triton_ragged_k_tails(bits, shape, m):
    """K no multiple of 512 at 1 % outliers, bf16, with a bias: 3 bits' main steps then its
    4-bit tail, 5 bits' last 1-bit chunk part padding; the production tile of M's row tile
    (SPLIT = 1), and the autotuned default path (split-K over main and tail steps, or from
    the crossover on, dequantize once + cuBLAS)."""

    n, k = K_TAILS[shape]
    w = weight(n, k, bits, 0.01)
    st = triton_state(w)
    x = activations(m, k, torch.bfloat16, seed=m)
    bias = bias_for(n, torch.bfloat16)
    kind, cfg = fixed_config(m, bits)
    assert_matches_reference(kernel("triton").apply(st, x, bias, kernel=kind, config=cfg), x, w, bias,
                             what=f"{shape} {kind} {cfg}")
    y = kernel("triton").apply(st, x, bias)
    assert_matches_reference(y, x, w, bias, exact=not use_large_m(x), what=f"{shape} autotuned")


@pytest.mark.parametrize("bits", BITS)
def test_triton_fp32_activations_and_group_sizes(bits):
    """Group sizes 32/64/one per row (several scale groups per dot / per slab run; the HPTQ
    transcode form), each with one forced outlier layout; fp32 activations (SIMT for every M,
    tiles of 8) and the tensor-core kernel."""
    tk_kernel = kernel("triton")
    n, k = RAGGED
    for group, mode in ((32, "ell"), (64, "csr"), (k, "ell")):
        w = weight(n, k, bits, 0.01, group=group)
        st = triton_state(w, mode)
        for m, dtype in ((1, torch.float32), (20, torch.float32), (9, torch.bfloat16)):
            x = activations(m, k, dtype, seed=m)
            kind, cfg = fixed_config(m, bits, dtype)
            y = tk_kernel.apply(st, x, kernel=kind, config=cfg)
            assert_matches_reference(y, x, w, what=f"group {group} {mode} M={m} {dtype}")


@pytest.mark.parametrize("m", [1, 64], ids=lambda m: f"m{m}")
@pytest.mark.parametrize("bits", BITS)
def test_triton_through_op(bits, m, monkeypatch):
    """Selected on CUDA, prepared from CUDA tensors, called through ``torch.ops.latq`` with the
    flattened state (autotuned), as the vLLM layer does."""
    n, k = RAGGED
    w = weight(n, k, bits, 0.01)
    triton_k = kernel("triton")
    monkeypatch.delenv(selector.ENV_FORCE, raising=False)
    assert selector.select(w, DEV, torch.bfloat16) is triton_k
    tensors, ints = triton_k.flatten(triton_k.prepare(w))
    assert all(t is None or t.device.type == DEV.type for t in tensors)
    x = activations(m, k, torch.bfloat16, seed=m)
    bias = bias_for(n, torch.bfloat16)
    assert_matches_reference(ops.op_for(triton_k)(x, tensors, ints, bias, n), x, w, bias, exact=not use_large_m(x))


def _triton_module():
    """The module of the selector's Triton kernel (its tile lists and config generators)."""
    return importlib.import_module(next(k for k in selector.kernels() if k.name == "triton").__module__)


def _large_tile_cases():
    if "triton" not in NAMES:
        return []
    tk = _triton_module()
    cases = []
    for b in (2, 3, 4, 5):
        for bm in (bm for bm in tk.MMA_TILES if bm > 16):
            for c in tk.mma_configs(bm, b):
                m = bm if c["SPLIT"] > 1 else 3 * bm - 5           # split-K: one tile; else three, the last ragged
                cases.append(pytest.param(b, bm, m, c, id=f"{b}bit-BM{bm}-m{m}-BN{c['BN']}-w{c['num_warps']}"
                                                          f"-S{c['SPLIT']}"))
    return cases


@pytest.mark.parametrize("bits,bm,m,cfg", _large_tile_cases())
def test_mma_large_tiles_every_config(bits, bm, m, cfg):
    """Every tensor-core config of the 32- and 64-row tiles, split-K included, ragged shape,
    1 % outliers, fp16 and bf16."""
    n, k = RAGGED
    w = weight(n, k, bits, 0.01)
    st = triton_state(w)
    for dtype in (torch.float16, torch.bfloat16):
        x = activations(m, k, dtype, seed=m)
        bias = bias_for(n, dtype)
        y = kernel("triton").apply(st, x, bias, kernel="mma", config=dict(cfg, BM=bm))
        assert_matches_reference(y, x, w, bias, what=f"mma BM={bm} {cfg} {dtype}")


def _splitk_cases():
    if "triton" not in NAMES:
        return []
    tk = _triton_module()
    cases = []
    for b in (2, 3, 4, 5):
        found = [("gemv", bm, c) for bm in tk.GEMV_TILES for c in tk.gemv_configs(bm, b)]
        found += [("mma", bm, c) for bm in tk.MMA_TILES for c in tk.mma_configs(bm, b)]
        for i, (kind, bm, c) in enumerate(x for x in found if x[2]["SPLIT"] > 1):
            m = {1: 1, 2: 2, 4: 3, 8: 7}.get(bm, 9) if kind == "gemv" else 9     # one M tile of bm rows
            dtype = (torch.float16, torch.bfloat16)[i % 2]
            mode = ("ell", "csr")[(i // 2) % 2]
            cases.append(pytest.param(b, kind, m, c, mode, dtype, id=f"{b}bit-{kind}-m{m}-BN{c['BN']}-S{c['SPLIT']}"
                                      f"-w{c['num_warps']}{'-BR%d' % c['BR'] if 'BR' in c else ''}-{mode}"))
    return cases


@pytest.mark.parametrize("bits,kind,m,cfg,mode,dtype", _splitk_cases())
def test_splitk(bits, kind, m, cfg, mode, dtype):
    """Every config with SPLIT > 1 (K = 4200: unequal step counts per split, some none at
    3 bits, whose 4-bit tail step goes to the last split): three calls bit-identical (the
    fixed-order reduction), right, tickets back to 0."""
    n, k = 184, 4200
    w = weight(n, k, bits, 0.03, seed=3)
    st = triton_state(w, mode)
    x = activations(m, k, dtype, seed=m)
    bias = bias_for(n, dtype)
    ys = [kernel("triton").apply(st, x, bias, kernel=kind, config=cfg) for _ in range(3)]
    assert all(torch.equal(ys[0], y) for y in ys[1:]), "split-K results differ between identical calls"
    assert int(st.tickets.abs().sum()) == 0, "split-K tickets not reset"
    assert_matches_reference(ys[0], x, w, bias, what=f"{kind} {cfg}")


@pytest.mark.parametrize("bits", BITS)
def test_splitk_scratch_is_reserved_and_shared(bits):
    """The split-K partials live in one fp32 buffer per device, sized at load (reserve) to
    the largest layer: calls never allocate it again, two layers share it, and interleaving
    them changes no bit of either's output."""
    tk = triton_module()
    triton_k = kernel("triton")
    cfg = next(c for c in tk.gemv_configs(1, bits) if c["SPLIT"] == 8)
    states = [triton_state(weight(n, 4000, bits, 0.03, seed=3)) for n in (184, 1000)]
    for st in states:
        triton_k.reserve(st, torch.bfloat16)
    buf = triton_k.splitk_workspace.flat(1, torch.float32, DEV)
    need = max(tk.splitk_floats(st.n_pad) for st in states)
    assert triton_k.splitk_workspace.current(torch.float32, DEV).numel() >= need
    ptr = buf.data_ptr()
    x = activations(1, 4000, torch.bfloat16)
    ys = []
    for st in (states[0], states[1], states[0], states[1], states[0]):
        ys.append(triton_k.apply(st, x, kernel="gemv", config=cfg))
        assert triton_k.splitk_workspace.flat(1, torch.float32, DEV).data_ptr() == ptr, "split-K scratch reallocated"
    assert torch.equal(ys[0], ys[2]) and torch.equal(ys[0], ys[4]) and torch.equal(ys[1], ys[3])
    assert all(int(st.tickets.abs().sum()) == 0 for st in states)


def _pipelined_cases():
    """Every pipelined config (``configs.pipelined_configs``) at 2 and 4 bits: the GEMV's row tiles
    at one tile of rows, the tensor-core kernel's at 2 rows (the route below 8) and one tile; a
    split config is one split-K case (its id says so: gpu_check.sh's splitk shards)."""
    if "triton" not in NAMES:
        return []
    from vllm_latq.kernels.triton import configs as cfg
    cases = []
    for b in (2, 4):
        for kind, tiles in (("gemv", cfg.GEMV_TILES), ("mma", cfg.MMA_TILES)):
            for i, c in enumerate(cfg.pipelined_configs(kind, None, b)):
                bm = next(t for t in tiles if any(c == dict(x, DEPTH=c["DEPTH"]) for x in cfg.configs_for(kind, t, b)))
                ms = [{1: 1, 2: 2, 4: 3, 8: 7}[bm]] if kind == "gemv" else ([2, bm] if bm == 16 else [bm - 5])
                mode = ("ell", "csr")[i % 2]
                tag = "splitk" if c["SPLIT"] > 1 else "whole"
                cases.append(pytest.param(b, kind, bm, ms, c, mode, id=f"{b}bit-pipelined-{kind}-BM{bm}-BN{c['BN']}"
                                          f"-w{c['num_warps']}-S{c['SPLIT']}-D{c['DEPTH']}-{mode}-{tag}"))
    return cases


@pytest.mark.parametrize("bits,kind,bm,ms,cfg,mode", _pipelined_cases())
def test_pipelined_every_config(bits, kind, bm, ms, cfg, mode):
    """The pipelined kernels (kernels/triton/pipelined.py) against the reference, K = 4200 (a
    last step reaching past K, unequal splits), 3 % outliers, bias, fp16 and bf16; a split config
    bit-identical over three calls with its tickets back to 0."""
    n, k = 184, 4200
    w = weight(n, k, bits, 0.03, seed=3)
    st = triton_state(w, mode)
    for m in ms:
        for dtype in (torch.float16, torch.bfloat16):
            x = activations(m, k, dtype, seed=m)
            bias = bias_for(n, dtype)
            ys = [kernel("triton").apply(st, x, bias, kernel=kind, config=dict(cfg, BM=bm)) for _ in range(3)]
            assert all(torch.equal(ys[0], y) for y in ys[1:]), "pipelined results differ between identical calls"
            assert int(st.tickets.abs().sum()) == 0, "split-K tickets not reset"
            assert_matches_reference(ys[0], x, w, bias, what=f"pipelined {kind} M={m} {cfg} {dtype}")
