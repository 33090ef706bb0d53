"""The codebook runtime form (method e8): its dequantization is the format's, the selector asks only the
kernels of its form, and the dequantize-once kernels serve it like the reference."""
import pytest
import torch

from vllm_latq.format import codebook as cb
from vllm_latq.kernels import selector
from vllm_latq.kernels.dequantized import DequantizedBf16Kernel, DequantizedFp32Kernel
from vllm_latq.kernels.reference import latq_linear_ref
from vllm_latq.kernels.weight import CodebookWeight, dequantize, weight_bytes


def _weight(bits=3, n=32, k=64, group=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k // cb.DIM, cb.CODEBOOKS[bits].index_bytes), generator=g, dtype=torch.uint8)
    return CodebookWeight(codes, (torch.rand(n, k // group, generator=g) + 0.5).half(), bits, group, k)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_dequantize_is_the_formats(bits):
    w = _weight(bits)
    assert torch.equal(dequantize(w), cb.dequantize(w.codes, w.scales, bits, w.group_size))
    assert weight_bytes(w) == {"codes": w.codes.numel(), "scales": 2 * w.scales.numel()}


def test_selector_asks_only_kernels_of_the_form(monkeypatch):
    w = _weight()
    kernel, reasons = selector.select_with_reasons(w, torch.device("cpu"), torch.float32)
    assert kernel.forms and CodebookWeight in kernel.forms
    for r in reasons:   # an integer-only kernel refuses by the form, the form's GPU kernel by the device
        assert "not CodebookWeight" in r or r.startswith("triton-e8: needs a CUDA device")
    monkeypatch.setenv(selector.ENV_FORCE, "dequant")
    assert selector.select(w, torch.device("cpu"), torch.float32) is DequantizedFp32Kernel
    monkeypatch.setenv(selector.ENV_FORCE, "reference")
    with pytest.raises(ValueError, match="reference: serves LatqWeight layers, not CodebookWeight"):
        selector.select(w, torch.device("cpu"), torch.float32)


def test_dequantized_kernels_serve_the_reference():
    w = _weight(4)
    x = torch.randn(5, w.in_features)
    ref = latq_linear_ref(x, w)
    assert torch.equal(DequantizedFp32Kernel.apply(DequantizedFp32Kernel.prepare(w), x), ref)
    y = DequantizedBf16Kernel.apply(DequantizedBf16Kernel.prepare(w), x.bfloat16())
    torch.testing.assert_close(y.float(), ref, rtol=3e-2, atol=3e-2 * ref.abs().max().item())


def test_every_codebook_kernel_installs_on_a_rotated_layer():
    """What a vLLM layer does at load (``install_kernel``): the kernel for a rotated codebook layer, its
    prepared state flattened, its op and lean op looked up, and the op's output the reference's."""
    from dataclasses import replace

    from vllm_latq.format.rotation import Rotation
    from vllm_latq.kernels import ops
    w = _weight(3)
    w = replace(w, rotation=Rotation(0).signs(w.in_features))
    x = torch.randn(2, w.in_features)
    served = 0
    for k in selector.kernels():   # the families' codebook kernels that run here (the fallback: above)
        if k.family is None or CodebookWeight not in k.forms or not k.can_implement(w, torch.device("cpu"),
                                                                                     torch.float32)[0]:
            continue
        served += 1
        kernel = selector.for_weight(k, w)
        state = kernel.prepare(w)
        tensors, ints = kernel.flatten(state)
        ops.plain_call(kernel, state, tensors)
        y = ops.op_for(kernel)(x, tensors, ints, None, w.out_features)
        torch.testing.assert_close(y, latq_linear_ref(x, w), rtol=1e-4, atol=1e-4, msg=kernel.name)
    assert served
