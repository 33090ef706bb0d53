"""No CPU-only tensor on the way to a CUDA device. The format, the kernels' prepare
and apply, the vLLM loader's TP slicing, the solvers and ``latq-quantize`` run under
:func:`tests.device_guard.factories_follow_inputs`, which fails at the first tensor factory that
names no device (the crash a CUDA run would hit); the allow-list below names the sites that
make CPU tensors on purpose, and why. The C++ helpers are CPU-only by their gates
(``t.device.type == "cpu"`` and ``native.usable()``): the solvers also run with them off, the
pure-torch path a CUDA tensor takes."""
from __future__ import annotations

import pytest
import torch

from tests.device_guard import DeviceUnspecified, factories_follow_inputs
from vllm_latq import format as fmt
from vllm_latq.testing.weights import random_weight


def test_guard_catches_the_old_unpack():
    """The unpack of 9cfa0dd built its bit positions with torch.arange(32) on the CPU."""
    def old_unpack(qweight, bits, in_features):
        tiles = qweight.shape[1] // bits
        w = qweight.to(torch.int64).reshape(-1, tiles, bits, 1) & 0xFFFFFFFF
        bitplanes = ((w >> torch.arange(32)) & 1).reshape(-1, tiles, 32, bits)
        return ((bitplanes << torch.arange(bits)).sum(-1).reshape(-1, tiles * 32)[:, :in_features]
                - 2 ** (bits - 1)).to(torch.int32)

    q = fmt.pack(torch.zeros(4, 40, dtype=torch.int32), 3)
    with factories_follow_inputs(), pytest.raises(DeviceUnspecified, match="arange"):
        old_unpack(q, 3, 40)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_format_paths(bits):
    w = random_weight(48, 200, bits, 0.05, group=64, seed=bits)
    z = fmt.unpack(w.qweight, bits, 200)
    mask = z == 0
    with factories_follow_inputs():
        assert torch.equal(fmt.pack(z, bits), w.qweight)
        assert torch.equal(fmt.unpack(w.qweight, bits, 200), z)
        fmt.dequantize(w.qweight, w.scales, w.crow, w.col, w.val, bits, 64, 200)
        fmt.csr_rows(w.crow, w.nnz)
        fmt.csr_from_mask(mask, z)
        fmt.unpack_at(w.qweight, bits, fmt.csr_rows(w.crow, w.nnz), w.col)


# ----------------------------------------------------------------------------- allow-list
# Sites that make CPU tensors on purpose, each with why (substrings of "file:function").
# the Huffman codec is numpy: encode and decode make CPU tensors (from_numpy), then move them to
# z's / the stream's device
HUFFMAN_NUMPY = ("format/layer.py:encode_layer", "format/layer.py:decode_integers")
# transformers' and torch.nn's own code: modules built under hf_model's meta-device context take
# their device from it, not from an argument; the guard is over the package's code
THIRD_PARTY = ("site-packages/transformers/", "site-packages/torch/nn/")
# the calibration token ids are host data (from Python lists); capture moves each sequence to the device
TOKEN_IDS = ("data/text.py:_windows",)


# ----------------------------------------------------------------------------- kernels' prepare/apply

@pytest.mark.parametrize("bits,rate", [(4, 0.02), (3, 0.0), (8, 0.05)])
def test_dequantized_and_reference_kernels(bits, rate):
    from vllm_latq.kernels.dequantized import DequantizedBf16Kernel, DequantizedFp32Kernel
    from vllm_latq.kernels.reference import ReferenceKernel
    w = random_weight(40, 144, bits, rate, group=64, seed=bits)
    x, bias = torch.randn(3, 144), torch.randn(40)
    with factories_follow_inputs():
        for kernel in (DequantizedBf16Kernel, DequantizedFp32Kernel, ReferenceKernel):
            st = kernel.prepare(w)
            kernel.apply(kernel.unflatten(*kernel.flatten(st)), x, bias)


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
@pytest.mark.parametrize("mode", [None, "ell", "csr"])
def test_triton_layout_and_prepare(bits, mode):
    """The Triton kernels' load-time repacking is pure torch: it runs here on CPU tensors."""
    pytest.importorskip("triton")
    from vllm_latq.kernels.triton import layout as triton_layout
    from vllm_latq.kernels.triton.kernel import TritonKernel
    w = random_weight(40, 300, bits, 0.03, group=32, seed=bits)
    scalar = random_weight(24, 200, bits, 0.0, group=200, seed=bits)   # one group: a per-tensor scale
    with factories_follow_inputs():
        triton_layout.build(w, mode)
        TritonKernel.prepare(w, mode)
        TritonKernel.prepare(scalar)


# ----------------------------------------------------------------------------- the vLLM loader's slicing

@pytest.mark.parametrize("kind,bits,g,scale_bits", [("dense", 4, 32, None), ("dense", 3, 48, None),
                                                   ("dense", 4, 32, 4), ("huffman", None, None, None)])
def test_loader_slices_and_merges(kind, bits, g, scale_bits):
    """Every TP rank's shards of qkv, gate_up, column- and row-parallel layers (splits off the
    tiles and groups; coded scales kept or not), assembled by ``LoadState``; and the padded rows
    of an lm_head shard."""
    pytest.importorskip("vllm")
    from tests.plugin.test_plugin import _Cfg, _layers, _result
    from vllm_latq.plugin.geometry import geometry
    from vllm_latq.plugin.loading import LoadState
    from vllm_latq.plugin.slicing import pad_rows
    cfg, seed, tp = _Cfg(kind, bits, g, scale_bits), 0, 4
    for r in range(tp):
        layers, full = _layers(tp, r)
        for layer in layers:
            tensors = {}
            for sid, rows in full[layer.prefix].items():
                seed += 1
                tensors[sid] = fmt.encode_layer(_result(rows, layer.input_size, kind, bits, g, 0.05, seed, scale_bits),
                                                kind)
            names = [f"{layer.prefix}.{s}" for s in full[layer.prefix]]
            with factories_follow_inputs(allow=HUFFMAN_NUMPY):
                st = LoadState(layer, cfg, geometry(layer, names if len(names) > 1 else [layer.prefix]))
                for sid, t in tensors.items():
                    for name, x in t.items():
                        st.add(name, x, sid)
                assert st.weight is not None, st.missing()
                w = st.weight
                if w.coded is None or w.out_features % 16 == 0:   # coded: padded after whole grids only
                    pad_rows(w, w.out_features + 5)


# ----------------------------------------------------------------------------- the solvers

@pytest.fixture(scope="module")
def problem():
    """A small layer: W [24, 80] (80 columns: a ragged 32-group), H = XᵀX of correlated inputs."""
    g = torch.Generator().manual_seed(0)
    X = torch.randn(300, 80, generator=g, dtype=torch.float64) @ (torch.eye(80, dtype=torch.float64)
                                                                   + 0.3 * torch.randn(80, 80, generator=g,
                                                                                       dtype=torch.float64))
    return torch.randn(24, 80, generator=g) * 0.05, X.T @ X / 300


@pytest.mark.parametrize("native_on", [True, False], ids=["native", "torch"])
def test_solvers(problem, native_on):
    """Every solver, order and rounding mode; ``torch``: the pure-torch path a CUDA tensor takes."""
    from vllm_latq import native
    from vllm_latq.algorithms import lattice, solvers
    from vllm_latq.algorithms.hptq import hptq, hrtn
    from vllm_latq.algorithms.ssqr import ssqr
    W, H = problem
    perm = torch.randperm(80, generator=torch.Generator().manual_seed(1))
    s = torch.tensor(0.01)
    with native.disabled(not native_on), factories_follow_inputs(allow=HUFFMAN_NUMPY):
        on_grid = [solvers.rtn(W, bits=4, group_size=32),
                   solvers.gptq(W, H, bits=4, group_size=32, clip=True, block_size=32, keep_rho=True),
                   solvers.gptq(W, H, bits=3, group_size=32, order=perm),
                   solvers.babai(W, H, bits=4, group_size=32, clip=True, order="reverse"),
                   ssqr(W, H, bits=3, group_size=32, outlier_rate=0.05, block_size=32),
                   hptq(W, H, target_bits=3.5, block_size=32),
                   hrtn(W, target_bits=3.5)]
        unclipped = [solvers.rtn(W, bits=3, group_size=32, clip=False, scales=s),
                     solvers.gptq(W, H, bits=4, group_size=32, clip=False, order="min-pivot", block_size=32),
                     solvers.babai(W, H, bits=4, group_size=32, order="natural", block_size=32)]
        for r in on_grid + unclipped:
            r.error(W, H)
        for r in on_grid:   # the checkpoint tensors (unclipped integers have no dense encoding)
            fmt.encode_layer(r, fmt.kind_of(r.method))
            if r.outliers is not None:
                r.outliers.to_dense()
        lattice.min_pivot_order(H)
        lattice.ldl_diag(H, "act")
        lattice.error_bound(H, unclipped[1].scales, "min-pivot", group_size=32)
        lattice.error_bound(H, s, perm)


# ----------------------------------------------------------------------------- the pipeline

@pytest.mark.parametrize("method,head", [("ssqr", True), ("hrtn", False)])
def test_quantize_model(tiny_llama, tmp_path, method, head):
    """``latq-quantize`` end to end (``device="cpu"``, the proxy for ``--device cuda``): source,
    capture, Hessians, solvers, the head, writing, validation."""
    from vllm_latq.testing.tiny_models import TINY_OPTS
    from vllm_latq.quantize.pipeline import QuantizeOptions, quantize_model
    opts = QuantizeOptions(method=method, device="cpu", **{**TINY_OPTS, "quantize_lm_head": head})
    with factories_follow_inputs(allow=THIRD_PARTY + TOKEN_IDS + HUFFMAN_NUMPY):
        quantize_model(tiny_llama, tmp_path / "out", opts, progress=False)
