"""Served bytes per kernel family, and the device-aware HPTQ transcode they drive.

Per family, ``served_bytes(prepare(w))`` is the sum of ``numel · element_size`` of the
state's tensors that ``apply`` reads (Triton leaves out its split-K tickets: counters, not
weights), and the cost model ``layout_bytes`` (what transcode and ``latq-inspect`` use,
without preparing) gives the same numbers. ``transcode(z, s, family=K)`` stays exact and
takes the width with K's fewest served bytes among K's widths.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.device_guard import factories_follow_inputs
from vllm_latq.kernels.cpu import kernel as cpu
from vllm_latq.kernels import selector
from vllm_latq.kernels.cpu.kernel import CPUKernel
from vllm_latq.kernels.dequantized import DequantizedBf16Kernel
from vllm_latq.kernels.served_bytes import FALLBACK_BYTES, GridStats, _grid_need, runtime_bytes
from vllm_latq.kernels.weight import dequantize
from vllm_latq.kernels.reference import latq_linear_ref
from vllm_latq.testing.weights import random_weight
from vllm_latq.kernels.transcode import transcode
from vllm_latq.kernels.reference import ReferenceKernel
from vllm_latq.kernels.triton.kernel import TritonKernel

S = float(torch.tensor(0.0137).half())   # an fp16-exact per-matrix scale


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _model(K, w):
    return K.layout_bytes(w.out_features, w.in_features, w.bits, w.group_size, GridStats.from_weight(w),
                          None if w.coded is None else w.coded.bits)


def hptq(out, cin, spread, seed):
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(out, cin, generator=g).clamp(1e-6, 1 - 1e-6) - 0.5   # Laplace by inversion
    return torch.round(-spread * u.sign() * torch.log1p(-2 * u.abs())).int().clamp(-3000, 3000)


def test_grid_need_is_the_smallest_grid():
    z = torch.arange(-70000, 70000, 7, dtype=torch.int32)
    need = _grid_need(z)
    for b in range(1, 20):
        on = (z >= -(2 ** (b - 1))) & (z < 2 ** (b - 1))
        assert torch.equal(on, need <= b), b


@pytest.mark.parametrize("bits,rate,shape,group", [(4, 0.01, (160, 320), 64), (3, 0.05, (100, 640), 128),
                                                   (2, 0.0, (48, 256), 32), (4, 0.3, (32, 96), 96),
                                                   (2, 0.02, (64, 40000), 128), (3, 0.0, (64, 576), 64),
                                                   (3, 0.01, (32, 1024), 128), (3, 0.0, (16, 300), 300),
                                                   (5, 0.01, (48, 640), 128), (5, 0.0, (40, 896), 896)])
def test_triton_served_bytes(bits, rate, shape, group):
    """Planes (padded to 16 rows and the K step; 3 bits: whole 512-column chunks + a 4-bit
    tail, 5 bits: the 1-bit plane to 512 columns), fp16 scales, ELL/CSR entries with padding
    and int16/fp16 compaction (int32 columns past K = 32768); ``rows``: a crowded row makes
    CSR win."""
    w = random_weight(*shape, bits, rate, group=group, seed=bits, rows=((3, 0.9),) if rate > 0.2 else ())
    st = TritonKernel.prepare(w)
    got = TritonKernel.served_bytes(st)
    tensors, _ = TritonKernel.flatten(st)
    assert sum(got.values()) == _nbytes(tensors) - _nbytes([st.tickets])
    assert got == _model(TritonKernel, w)
    assert (got["outliers"] > 0) == (rate > 0)
    for mode in ("ell", "csr") if rate else ():   # both outlier forms are counted as laid out
        st = TritonKernel.prepare(w, outlier_mode=mode)
        assert sum(TritonKernel.served_bytes(st).values()) == _nbytes(TritonKernel.flatten(st)[0]) - _nbytes([st.tickets])


@pytest.mark.parametrize("bits,rate,shape,group", [(4, 0.01, (160, 320), 64), (3, 0.0, (40, 640), 64),
                                                   (2, 0.02, (192, 576), 32), (5, 0.0, (48, 300), 300)])
def test_coded_scales_served_bytes(bits, rate, shape, group):
    """Coded scales (``format.scale_codes``): the Triton layout streams 12 bytes per 16 scales —
    its served bytes are its tensors', what the cost model counts with ``scale_bits`` and what
    ``latq-inspect`` reports for the stored layer, and fewer than the same layer's with fp16
    scales; the CPU family streams them as codes too where its C++ GEMV runs (≤ 4 bits), else
    decodes them at prepare and serves (and counts) fp16 scales."""
    from vllm_latq import format as fmt
    from vllm_latq.kernels.served_report import layer_served
    w = random_weight(*shape, bits, rate, group=group, seed=bits, scale_bits=4)
    fp16 = dataclasses.replace(w, coded=None)
    stats = GridStats.from_weight(w)
    st = TritonKernel.prepare(w)
    got = TritonKernel.served_bytes(st)
    assert sum(got.values()) == _nbytes(TritonKernel.flatten(st)[0]) - _nbytes([st.tickets])
    assert got == TritonKernel.layout_bytes(*shape, bits, group, stats, scale_bits=4)
    f16 = TritonKernel.served_bytes(TritonKernel.prepare(fp16))
    assert got["scales"] * 32 == f16["scales"] * 12 and sum(got.values()) < sum(f16.values())
    t = {"qweight": w.qweight, "outlier_crow": w.crow, "outlier_col": w.col, "outlier_val": w.val,
         **fmt.scale_codes.to_tensors(w.coded)}
    fams = [TritonKernel] + ([CPUKernel] if CPUKernel.can_implement(w, torch.device("cpu"), torch.bfloat16)[0] else [])
    inspected = layer_served(t, "dense", shape, bits, group, fams)
    assert inspected["triton"]["bytes"] == sum(got.values())
    if CPUKernel in fams:
        cpu_got, cpu_f16 = (CPUKernel.served_bytes(CPUKernel.prepare(v)) for v in (w, fp16))
        assert cpu_got == _model(CPUKernel, w) and inspected["cpu"]["bytes"] == sum(cpu_got.values())
        codes = cpu._codes_here(bits, True)
        assert cpu_got["scales"] * (32 if codes else 1) == cpu_f16["scales"] * (12 if codes else 1)
        assert {k: v for k, v in cpu_got.items() if k != "scales"} == {k: v for k, v in cpu_f16.items() if k != "scales"}


def test_coded_group_64_serves_fewer_bits_than_fp16_group_128():
    """Why coded scales exist: at group 64 they serve 6/64 bits a weight, fp16 at 128 16/128."""
    n, k = 256, 4096
    stats = GridStats.from_integers(torch.zeros(n, k, dtype=torch.int32), torch.ones(n))
    coded = TritonKernel.layout_bytes(n, k, 4, 64, stats, scale_bits=4)["scales"]
    fp16 = TritonKernel.layout_bytes(n, k, 4, 128, stats)["scales"]
    assert (8 * coded / (n * k), 8 * fp16 / (n * k)) == (6 / 64, 16 / 128)
    with pytest.raises(ValueError, match="scale codes"):
        TritonKernel.layout_bytes(n, k, 4, 64, stats, scale_bits=3)


@pytest.mark.parametrize("tiles", [True, False])
@pytest.mark.parametrize("fp16_values", [True, False])
@pytest.mark.parametrize("bits,rate,split", [(4, 0.01, 0.05), (3, 0.0, 0.05), (6, 0.01, 0.0), (6, 0.01, 1.0),
                                             (8, 0.02, 0.05)])
def test_cpu_served_bytes(monkeypatch, tiles, fp16_values, bits, rate, split):
    """int4pack bytes (two planes for 5–8 bits, or 4 bits + outliers), bf16 scales (alone where
    the C++ GEMV runs, else with their zeros),
    the fp32 CSR or the C++ op's tiles with their padding: 32 bits an outlier where every value
    is fp16-exact (as SSQR stores them; a split-off z·s rarely is), 48 else."""
    monkeypatch.setattr(cpu, "_tiles_here", lambda k: tiles)
    monkeypatch.setattr(cpu, "SPLIT_MAX_EXTRA_RATE", split)
    w = random_weight(192, 576, bits, rate, group=64, seed=bits, fp16_values=fp16_values)
    st = CPUKernel.prepare(w)
    got = CPUKernel.served_bytes(st)
    assert sum(got.values()) == _nbytes(CPUKernel.flatten(st)[0])
    assert got == _model(CPUKernel, w)
    assert (st.tile_col is not None) == (tiles and got["outliers"] > 0)
    if st.tile_col is not None:
        assert st.row_scale is None   # several scales per row: no int16 coding
        assert st.tile_val.dtype == (torch.float16 if fp16_values and st.planes * 4 >= bits else torch.float32)


@pytest.mark.parametrize("spread,split", [(1.5, 0.05), (6.0, 0.05), (6.0, 1.0), (40.0, 0.05)])
def test_cpu_one_scale_outliers_are_int16(monkeypatch, spread, split):
    """A one-scale (HPTQ) layer's outliers z·s, not fp16-exact, are served as int16 z times the
    row's fp32 scale: 32 bits an outlier + 4 bytes a row, exactly what the cost model counts from
    the layer's integers (as transcode and ``latq-inspect`` see it); |z| ≥ 2¹⁵ keeps fp32."""
    monkeypatch.setattr(cpu, "_tiles_here", lambda k: True)
    monkeypatch.setattr(cpu, "SPLIT_MAX_EXTRA_RATE", split)
    z = hptq(192, 576, spread, seed=7)
    if spread > 20:
        z[5, 7] = 40000                      # past int16: the layer keeps fp32 values
    n, k = z.shape
    s = torch.full((n,), S)
    w = transcode(z, S, family=CPUKernel)
    st = CPUKernel.prepare(w)
    got = CPUKernel.served_bytes(st)
    assert sum(got.values()) == _nbytes(CPUKernel.flatten(st)[0])
    assert got == CPUKernel.layout_bytes(n, k, w.bits, k, GridStats.from_integers(z, s))
    if cpu._gemv_here():   # the GEMV's layout: one bf16 scale per row and plane
        assert st.scales.shape == (st.planes, n) and st.group_size == k
    if got["outliers"]:
        int16 = spread < 20
        assert st.tile_val.dtype == (torch.int16 if int16 else torch.float32)
        assert (st.row_scale is not None) == int16
        if int16:
            assert torch.equal(st.row_scale, s)


def test_fallback_and_reference_served_bytes():
    w = random_weight(40, 256, 8, 0.01, group=32, seed=2)
    assert DequantizedBf16Kernel.served_bytes(DequantizedBf16Kernel.prepare(w)) == {"other": 2 * 40 * 256}
    got = ReferenceKernel.served_bytes(ReferenceKernel.prepare(w))
    assert sum(got.values()) == _nbytes([w.qweight, w.scales, w.crow, w.col, w.val])
    assert got == _model(ReferenceKernel, w) == runtime_bytes(40, 256, 8, 32, GridStats.from_weight(w))
    with pytest.raises(ValueError):
        CPUKernel.layout_bytes(40, 256, 8, 32, GridStats.from_weight(w))   # 40 rows: not the int4pack's 16s
    with pytest.raises(ValueError):
        TritonKernel.layout_bytes(40, 256, 8, 32, GridStats.from_weight(w))


@pytest.mark.parametrize("family", [None, CPUKernel, TritonKernel])
@pytest.mark.parametrize("shape,spread", [((256, 640), 1.5), ((128, 1024), 6.0), ((64, 576), 40.0)])
def test_transcode_picks_the_familys_cheapest_width(family, shape, spread):
    """Exact against z·s; the width is the family's cheapest by its own served bytes, or — when
    even that costs more than the bf16 fallback — one the family does not take."""
    z = hptq(*shape, spread, seed=shape[0])
    n, k = shape
    w = transcode(z, S, family=family)
    assert torch.equal(dequantize(w), z.float() * S)
    x = torch.randn(3, k)
    assert torch.equal(latq_linear_ref(x, w), x @ (z.float() * S).T)
    stats = GridStats.from_integers(z, torch.full((n,), S))
    if family is None:
        costs = {b: sum(runtime_bytes(n, k, b, k, stats).values()) for b in range(2, 9)}
        assert costs[w.bits] == min(costs.values())
        return
    costs = {b: sum(family.layout_bytes(n, k, b, k, stats).values()) for b in family.widths}
    if min(costs.values()) <= FALLBACK_BYTES * n * k:
        assert w.bits in family.widths and costs[w.bits] == min(costs.values())
        assert sum(family.served_bytes(family.prepare(w)).values()) == costs[w.bits]
    else:
        assert w.bits not in family.widths


def test_transcode_for_triton_caps_at_five_bits():
    """A layer the runtime form would serve at 6 bits goes to Triton at 5, its widest (the
    integers beyond 5 bits as outliers), so it runs compressed instead of on the bf16 fallback."""
    z = hptq(256, 1024, 4.0, seed=3)
    assert transcode(z, S).bits == 6
    w = transcode(z, S, family=TritonKernel)
    assert w.bits == 5 and w.nnz > 0
    assert TritonKernel.served_bytes(TritonKernel.prepare(w))["outliers"] > 0


def test_transcode_is_device_clean():
    z, rows = hptq(64, 576, 6.0, seed=5), torch.full((64,), S)
    with factories_follow_inputs():
        for family in (None, CPUKernel, TritonKernel):
            transcode(z, S, family=family)
            transcode(z, rows, family=family)


def test_family_for_device(monkeypatch):
    monkeypatch.delenv("LATQ_KERNEL", raising=False)
    assert selector.family_for(torch.device("cuda")) is TritonKernel
    assert selector.family_for(torch.device("cpu")) is CPUKernel
    monkeypatch.setenv("LATQ_KERNEL", "reference")
    assert selector.family_for(torch.device("cuda")) is ReferenceKernel
    monkeypatch.setenv("LATQ_KERNEL", "bf16")
    assert selector.family_for(torch.device("cpu")) is None


def test_one_list_of_kernel_families(monkeypatch):
    """The families the reports list are the kernels serving each device type, CPU first; the
    old ``LATQ_KERNEL=dense`` is refused, naming the kernel it meant."""
    monkeypatch.delenv("LATQ_KERNEL", raising=False)
    assert selector.families() == [CPUKernel, TritonKernel]
    assert [selector.family_for(torch.device(d)) for d in selector.FAMILY_OF_DEVICE] == selector.families()
    monkeypatch.setenv("LATQ_KERNEL", "dense")
    with pytest.raises(ValueError, match="LATQ_KERNEL='dense' is no longer a kernel name: LATQ_KERNEL=bf16"):
        selector.family_for(torch.device("cpu"))


def test_inspect_served_is_what_prepare_builds(tiny_checkpoints):
    """``latq-inspect``'s served bytes per layer and family (cost models, no prepare) equal the
    served bytes of the state that family's prepare builds from the layer as the loader forms
    it (dense as stored; HPTQ transcoded for that family)."""
    from vllm_latq import format as fmt
    from vllm_latq.format.checkpoint import Checkpoint
    from vllm_latq.format.validate import validate_checkpoint
    from vllm_latq.kernels.weight import from_dense_tensors
    from vllm_latq.kernels.selector import families
    from vllm_latq.kernels.served_report import checkpoint_served

    for method in ("ssqr", "hptq"):
        d, _ = tiny_checkpoints[method]
        rows = validate_checkpoint(d)["layers"]
        totals = checkpoint_served(d, rows)
        ck = Checkpoint(d)
        for r in rows:
            t, (n, k) = ck.layer_tensors(r["name"]), r["shape"]
            for fam in families():
                got = r["served"][fam.name]
                if ck.spec.kind == "dense":
                    w = from_dense_tensors(t, ck.spec.bits_of(r["name"]), ck.spec.group_size, k)
                else:
                    z = fmt.decode_integers(t, "huffman", (n, k), None)
                    w = transcode(z, t["hscale"].float().expand(n), family=fam)
                assert got["bits"] == w.bits
                if got["kernel"] == fam.name:
                    assert got["bytes"] == sum(fam.served_bytes(fam.prepare(w)).values()), (r["name"], fam.name)
                else:   # the bf16 fallback: dequantized once, 2 bytes/weight
                    assert got["bytes"] == 2 * n * k
        weights = sum(r["shape"][0] * r["shape"][1] for r in rows)
        assert totals == {f.name: 8 * sum(r["served"][f.name]["bytes"] for r in rows) / weights for f in families()}
