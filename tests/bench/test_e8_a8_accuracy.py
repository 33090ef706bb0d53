"""bench/e8_a8_accuracy.py: its hooks give each quantized linear of the dequantized model the input
``cpu-e8-a8`` multiplies — rotated, rounded to int8, back — so the perplexity it prints is the kernel's."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import torch

from bench.e8_a8_accuracy import round_inputs
from tests.kernels.test_cpu_codebook import weight
from vllm_latq.format.rotation import Rotation, rotate, unrotate
from vllm_latq.kernels.cpu.codebook import a8_block, round_to_int8
from vllm_latq.kernels.reference import latq_linear_ref
from vllm_latq.kernels.weight import dequantize


def test_hooked_layer_computes_the_kernels_arithmetic():
    rotation = Rotation(0)
    w = weight(3, n=32, k=128, group=16, coded=True)               # the stored Q, in the rotated frame
    model = torch.nn.Sequential(torch.nn.Linear(128, 32, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(unrotate(dequantize(w), rotation.signs(128)))   # the served Q·Rᵀ, as latq-eval reads it
    x = torch.randn(3, 128)
    exact = model(x)
    spec = SimpleNamespace(rotation=rotation, group_size=16)
    hooks = round_inputs(model, SimpleNamespace(spec=spec, layers=lambda: {"0": {}}))
    y = model(x)
    want = latq_linear_ref(round_to_int8(rotate(x, rotation.signs(128)), a8_block(16, 128)), replace(w, rotation=None))
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert not torch.allclose(y, exact, rtol=1e-5, atol=1e-6)   # the rounding changed something
    for h in hooks:
        h.remove()
    torch.testing.assert_close(model(x), exact)
