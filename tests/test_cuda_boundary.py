"""The CUDA boundary on CPU (``vllm_latq/testing/cuda_boundary.py``): vLLM's platform stubbed as
a CUDA GPU of capability sm_80/86/89/90, its CUDA ops replaced by CPU stand-ins.

First the stand-ins themselves, checked the way vLLM's own kernel tests check the real ops
(``tests/kernels/quantization/test_marlin_gemm.py``, ``test_machete_mm.py``, the Marlin MoE test):
a weight quantized and laid out by vLLM's pure-torch helpers, the op's product against
``a @ w_ref`` (a bias case included), and the contract checks a GPU would fail on. Then vLLM's real
linear and mixture-of-experts layers with latq's quant method, loaded from latq checkpoint tensors
through their weight loaders, processed and applied — fp16 and bf16, biases on and off, TP 1 and
2 (gloo, one process per rank), every capability — against latq's dequantized reference.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm.model_executor.layers.quantization.utils.marlin_utils_test")
from vllm import _custom_ops as ops  # noqa: E402
from vllm.model_executor.layers.quantization.utils.marlin_utils import marlin_permute_bias  # noqa: E402
from vllm.model_executor.layers.quantization.utils.marlin_utils_test import (  # noqa: E402
    get_weight_perm, marlin_quantize, marlin_weights)
from vllm.model_executor.layers.quantization.utils.quant_utils import (  # noqa: E402
    gptq_pack, gptq_quantize_weights, pack_rows, quantize_weights)
from vllm.scalar_type import scalar_types  # noqa: E402

from vllm_latq.testing import boundary_layers as bl  # noqa: E402
from vllm_latq.testing.cuda_boundary import cuda_boundary  # noqa: E402
from vllm_latq.testing.cuda_ops import OpContractError  # noqa: E402

WTYPES = [pytest.param(scalar_types.uint4b8, id="uint4b8"), pytest.param(scalar_types.uint8b128, id="uint8b128")]
DTYPES = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")]


def _max_diff(out, ref):
    """vLLM's kernel tests' measure: mean |error| over mean |reference|."""
    return float((out.float() - ref).abs().mean() / ref.abs().mean())


@pytest.fixture
def boundary():
    with cuda_boundary(80):
        yield


# ============================================================================ the stand-ins, as vLLM tests the ops

@pytest.mark.parametrize("wtype", WTYPES)
@pytest.mark.parametrize("group", [-1, 32, 128])
def test_marlin_repack_is_vllms_layout(wtype, group, boundary):
    k, n = 256, 192
    _, q, _ = gptq_quantize_weights(torch.randn(k, n, dtype=torch.float16), wtype, k if group == -1 else group)
    got = ops.gptq_marlin_repack(gptq_pack(q, wtype.size_bits, k, n), k, n, wtype.size_bits)
    assert torch.equal(got, marlin_weights(q, k, n, wtype.size_bits, get_weight_perm(wtype.size_bits)))


@pytest.mark.parametrize("wtype", WTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [-1, 32, 64, 128])
@pytest.mark.parametrize("m", [1, 33])
def test_marlin_gemm_with_and_without_bias(wtype, dtype, group, m, boundary):
    """``marlin_quantize``'s layout (vLLM's test helper) in, ``a @ w_ref (+ bias)`` out — within
    the output's rounding, far inside vLLM's own 0.04; an unpermuted bias is not that."""
    k, n = 512, 256
    g = torch.Generator().manual_seed(group + m)
    w_ref, q, s = marlin_quantize(torch.randn(k, n, generator=g).to(dtype), wtype, group)
    a = torch.randn(m, k, generator=g).to(dtype)
    bias = (torch.randn(n, generator=g) * 10).to(dtype)
    for b, want in ((None, a.float() @ w_ref.float()), (bias, a.float() @ w_ref.float() + bias.float())):
        out = ops.marlin_gemm(a, None, q, None if b is None else marlin_permute_bias(b), s, None, None, None, None,
                              wtype, m, n, k)
        assert out.dtype == dtype and _max_diff(out, want) < 4 * bl.ULP[dtype]
    wrong = ops.marlin_gemm(a, None, q, bias, s, None, None, None, None, wtype, m, n, k)
    assert _max_diff(wrong, a.float() @ w_ref.float() + bias.float()) > 0.1


@pytest.mark.parametrize("wtype", WTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [-1, 64, 128])
def test_machete_prepack_and_mm(wtype, dtype, group, boundary):
    """As vLLM's Machete test: ``quantize_weights``, ``pack_rows``, column-major, prepacked, against
    ``a @ w_ref``; the plain GPTQ words are not the prepacked layout."""
    k, n, m = 512, 256, 7
    g = torch.Generator().manual_seed(group)
    w_ref, q, s, _ = quantize_weights(torch.randn(k, n, generator=g).to(dtype), wtype, k if group == -1 else group)
    words = pack_rows(q, wtype.size_bits, k, n).t().contiguous().t()
    a = torch.randn(m, k, generator=g).to(dtype)
    out = ops.machete_mm(a=a, b_q=ops.machete_prepack_B(words, dtype, wtype, dtype), b_type=wtype,
                         b_group_scales=s, b_group_size=group)
    assert out.dtype == dtype and _max_diff(out, a.float() @ w_ref.float()) < 4 * bl.ULP[dtype]
    plain = ops.machete_mm(a=a, b_q=words.contiguous(), b_type=wtype, b_group_scales=s, b_group_size=group)
    assert _max_diff(plain, a.float() @ w_ref.float()) > 0.1


def test_contracts_a_gpu_enforces(boundary):
    """What the CUDA ops refuse: 32-bit activations (Marlin, Machete), scales of another type than
    the activations (Machete), a row-major B for Machete's prepack."""
    k, n = 256, 128
    w_ref, q, s = marlin_quantize(torch.randn(k, n, dtype=torch.float16), scalar_types.uint4b8, 64)
    with pytest.raises(OpContractError, match="unsupported `a` scalar_type"):
        ops.marlin_gemm(torch.randn(2, k), None, q, None, s.float(), None, None, None, None,
                        scalar_types.uint4b8, 2, n, k)
    _, qm, sm, _ = quantize_weights(torch.randn(k, n, dtype=torch.float16), scalar_types.uint4b8, 64)
    words = pack_rows(qm, 4, k, n)
    with pytest.raises(OpContractError, match="column-major"):
        ops.machete_prepack_B(words, torch.float16, scalar_types.uint4b8, torch.float16)
    with pytest.raises(OpContractError, match="no kernel for torch.float32"):
        ops.machete_prepack_B(words.t().contiguous().t(), torch.float32, scalar_types.uint4b8, torch.float32)
    packed = ops.machete_prepack_B(words.t().contiguous().t(), torch.float16, scalar_types.uint4b8, torch.float16)
    with pytest.raises(OpContractError, match="group scales torch.bfloat16"):
        ops.machete_mm(a=torch.randn(2, k).half(), b_q=packed, b_type=scalar_types.uint4b8,
                       b_group_scales=sm.bfloat16(), b_group_size=64)
