"""Every latq kernel family that runs on CUDA, through its custom op; the bf16 fallback; the
reference on CUDA without a device context.

Run by ``scripts/gpu_check.sh`` on a CUDA machine (``TRITON_INTERPRET=0``); skipped elsewhere.
"""
from __future__ import annotations

import pytest
import torch

from tests.gpu.cases import BITS, CUDA, DEV, DTYPES, EXACT, NAMES, RAGGED, activations, assert_matches_reference, bias_for, kernel, needs_cuda, pytestmark, weight
from vllm_latq.kernels import ops, selector
from vllm_latq.kernels.reference import latq_linear_ref
from vllm_latq.kernels.weight import LatqWeight, dequantize


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 64], ids=lambda m: f"m{m}")
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("name", [n for n in NAMES if n not in ("cpu", "triton")])
def test_family_through_op(name, bits, m, dtype, monkeypatch):
    """Every other kernel family that runs on CUDA (the Triton one: above), forced
    (``LATQ_KERNEL``), prepared from CUDA tensors and called through its custom op — what the
    vLLM layer does at load and per step."""
    n, k = RAGGED
    w = weight(n, k, bits, 0.01)
    K_ = kernel(name)
    monkeypatch.setenv(selector.ENV_FORCE, name)
    ok, why = K_.can_implement(w, DEV, dtype)
    if not ok:
        pytest.skip(f"{name} cannot run this layer on {DEV}: {why}")
    assert selector.select(w, DEV, dtype) is K_
    tensors, ints = K_.flatten(K_.prepare(w))
    assert all(t is None or t.device.type == DEV.type for t in tensors), f"{name}: state not on {DEV}"
    x = activations(m, k, dtype, seed=m)
    bias = bias_for(n, dtype)
    y = ops.op_for(K_)(x, tensors, ints, bias, n)
    assert_matches_reference(y, x, w, bias, exact=name in EXACT, what=name)


def fallback_kernel():
    """The kernel selected for an 8-bit layer (no Triton kernel): the bf16 fallback, found by
    selection rather than by name. (The dry run on CPU would select the CPU kernel.)"""
    w8 = weight(256, 1024, 8, 0.01)
    if not CUDA:
        return kernel("dense")
    chosen = selector.select(w8, DEV, torch.bfloat16)
    assert chosen.name not in EXACT, f"an 8-bit layer on {DEV} selected {chosen.name}"
    return chosen


@pytest.mark.parametrize("bits", [pytest.param(4, id="b4"), pytest.param(8, id="b8")])
def test_dense_fallback_on_cuda(bits):
    """The bf16 fallback (e.g. an 8-bit layer with fp32 activations, which vLLM's kernels do not take):
    selected where Triton has no kernel, prepared from CUDA tensors, called through its op, equal to
    the reference up to bf16."""
    n, k = 256, 1024
    w = weight(n, k, bits, 0.01)
    fallback = fallback_kernel()
    tensors, ints = fallback.flatten(fallback.prepare(w))
    assert all(t is None or t.device.type == DEV.type for t in tensors)
    for m in (1, 33):
        x = activations(m, k, torch.bfloat16, seed=m)
        y = ops.op_for(fallback)(x, tensors, ints, None, n)
        assert_matches_reference(y, x, w, exact=False, what=fallback.name)


@needs_cuda
def test_reference_on_cuda():
    """``latq_linear_ref`` / ``dequantize`` on CUDA tensors, without a default-device context
    (what the reference, dequant and dense kernels do on a GPU), equal the CPU reference."""
    n, k = RAGGED
    w = weight(n, k, 3, 0.05)
    x = activations(5, k, torch.float32)
    y = latq_linear_ref(x, w)
    wc = LatqWeight(*(t.cpu() for t in (w.qweight, w.scales, w.crow, w.col, w.val)), w.bits, w.group_size, k)
    assert torch.equal(dequantize(w).cpu(), dequantize(wc))
    torch.testing.assert_close(y.cpu(), latq_linear_ref(x.cpu(), wc), rtol=1e-5, atol=1e-5)
