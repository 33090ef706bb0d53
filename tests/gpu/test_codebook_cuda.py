"""The codebook form's Triton kernels (``triton-e8``) compiled for the GPU: against ``latq_linear_ref`` at
every code width, fp16 and coded scales, batches on every route (GEMV below 8 rows; from 8, the weight
decoded once + cuBLAS, one rounding of the weight from the reference; the tensor-core kernel on request),
bias and a rotated layer through the selector — the interpreter tests' cases on ragged shapes."""
import pytest
import torch

from tests.gpu.cases import DEV, DTYPES, RAGGED, activations, assert_matches_reference, bias_for, kernel, pytestmark  # noqa: F401
from vllm_latq.kernels import selector
from vllm_latq.kernels.triton.codebook import LARGE_MIN_M, route
from vllm_latq.testing.weights import random_codebook_weight

BITS = [pytest.param(b, id=f"{b}bit") for b in (2, 3, 4)]     # ids: gpu_check.sh shards on them
SCALES = [pytest.param((64, None), id="fp16-g64"), pytest.param((16, 4), id="s4-g16"),
          pytest.param((None, None), id="fp16-row")]


def _kernel(w, dtype, monkeypatch):
    k = kernel("triton-e8")
    monkeypatch.setenv(selector.ENV_FORCE, "triton")
    if DEV.type != "cuda":
        from vllm_latq.kernels.triton.kernel import ENV_INTERPRET_OK
        monkeypatch.setenv(ENV_INTERPRET_OK, "1")        # the dry run: CPU tensors in the interpreter
    ok, why = k.can_implement(w, DEV, dtype)
    if not ok:
        pytest.skip(f"triton-e8 cannot run this layer on {DEV}: {why}")
    return k


@pytest.mark.parametrize("scales", SCALES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
def test_e8_matches_reference(bits, dtype, scales, monkeypatch):
    n, k = RAGGED
    group, scale_bits = scales
    w = random_codebook_weight(n, k, bits, group=group, scale_bits=scale_bits).to(DEV)
    kern = _kernel(w, dtype, monkeypatch)
    st = kern.prepare(w)
    for m in (1, 3, 7, 8, 17, 64, 100):
        x = activations(m, k, dtype, seed=m)
        bias = bias_for(n, dtype) if m in (3, 17) else None
        exact = route(m, dtype) == "gemv"
        assert_matches_reference(kern.apply(st, x, bias), x, w, bias, exact=exact, what=f"triton-e8 M={m}")
        if m >= LARGE_MIN_M:
            assert_matches_reference(kern.apply(st, x, bias, kernel="mma"), x, w, bias, what=f"triton-e8 mma M={m}")


@pytest.mark.parametrize("bits", BITS)
def test_e8_rotated_through_the_selector(bits, monkeypatch):
    from dataclasses import replace
    from vllm_latq.format.rotation import rotate
    n, k = 256, 1024
    g = torch.Generator().manual_seed(bits)
    w = random_codebook_weight(n, k, bits, group=64, scale_bits=4).to(DEV)
    w = replace(w, rotation=(torch.randint(0, 2, (k,), generator=g).float() * 2 - 1).to(DEV))
    _kernel(replace(w, rotation=None), torch.bfloat16, monkeypatch)
    served = selector.select(w, DEV, torch.bfloat16)
    assert served.name == "triton-e8+hadamard"
    st = served.prepare(w)
    for m in (1, 16):
        x = activations(m, k, torch.bfloat16, seed=m)
        assert_matches_reference(served.apply(st, x), rotate(x, w.rotation), replace(w, rotation=None),
                                 exact=route(m, torch.bfloat16) == "gemv", what=f"triton-e8+hadamard M={m}")
