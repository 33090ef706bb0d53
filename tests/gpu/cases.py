"""What the GPU tests share: their device, marks and parameter ids (``scripts/gpu_check.sh``
shards on the bit-width ids), cached random weights and the bound against ``latq_linear_ref``."""
from __future__ import annotations

import importlib
import math
import os

import pytest
import torch

from tests.helpers import CROWDED
from vllm_latq import format as fmt
from vllm_latq.kernels import ops, selector
from vllm_latq.kernels.weight import LatqWeight, dequantize
from vllm_latq.kernels.reference import latq_linear_ref
from vllm_latq.testing.weights import random_weight

DEV = torch.device(os.environ.get("LATQ_GPU_TESTS_DEVICE", "cuda"))
CUDA = DEV.type == "cuda"
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif((not torch.cuda.is_available() or INTERPRET) if CUDA else not INTERPRET,
                       reason="GPU tests: a CUDA device with TRITON_INTERPRET=0 (scripts/gpu_check.sh)"),
]
needs_cuda = pytest.mark.skipif(not CUDA, reason="CUDA only (not in the interpreter dry run)")

NAMES = [k.name for k in selector.kernels() if not k.delegated]   # vLLM's own: test_cuda_boundary.py
EXACT = ("triton", "reference", "dequant")          # the reference's fp32 math
U_OUT = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float32: 2.0**-20}   # one ulp
BITS = [pytest.param(b, id=f"{b}bit") for b in (2, 3, 4, 5)]   # ids: gpu_check.sh shards on them
DTYPES = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")]
RATES = [pytest.param(0.0, id="r0"), pytest.param(0.01, id="r1pct"), pytest.param(0.05, id="r5pct")]
MS = [1, 2, 3, 4, 7, 8, 9, 16, 17, 33, 64, 100, 256]
RAGGED = (184, 1000)     # N % 16 = 8; K: a 104-column last scale group, not a multiple of 32
K_TAILS = {"gemma-q": (1024, 640), "smollm2-up": (1536, 576), "qwen-0.5b-q": (896, 896),
           "qwen-0.5b-down": (896, 4864), "qwen-1.5b-down": (1536, 8960)}     # K mod 512 = 128..384
QWEN3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


def kernel(name: str):
    found = {k.name: k for k in selector.kernels()}
    if name not in found:
        pytest.skip(f"no latq kernel {name!r} here (have {sorted(found)})")
    return found[name]


def triton_module():
    return importlib.import_module(kernel("triton").__module__)


def make_weight(n, k, bits, rate, group=128, seed=0, crowded=True, scale_bits=None) -> LatqWeight:
    """On DEV: test_triton's weights (random b-bit inliers, 0 at outliers, fp16 scales —
    ``scale_bits``: coded —, fp16-exact outliers at ``rate``; with ``crowded``, row 1 half
    outliers, rows 3..5 none)."""
    crowd = CROWDED if crowded and rate > 0 and n > 6 else ()
    return random_weight(n, k, bits, rate, group=group, seed=seed, scale_lo=0.002, scale_span=0.02, val_std=0.2,
                         fp16_values=True, rows=crowd, scale_bits=scale_bits).to(DEV)


_WEIGHTS: dict = {}
_STATES: dict = {}


def weight(n, k, bits, rate, group=128, seed=None, scale_bits=None) -> LatqWeight:
    key = (n, k, bits, rate, group, seed, scale_bits)
    if key not in _WEIGHTS:
        _WEIGHTS[key] = make_weight(n, k, bits, rate, group, seed=bits if seed is None else seed,
                                    scale_bits=scale_bits)
    return _WEIGHTS[key]


def triton_state(w: LatqWeight, mode: str | None = None):
    key = (id(w), mode)
    if key not in _STATES:
        _STATES[key] = kernel("triton").prepare(w, outlier_mode=mode)
    return _STATES[key]


def activations(m, k, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g).to(dtype).to(DEV)


def bias_for(n, dtype, seed=5):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEV)


def assert_matches_reference(y, x, w, bias=None, exact=True, what=""):
    """``y`` against ``latq_linear_ref`` in fp32.

    Kernels that compute the reference's fp32 math (Triton, reference, dequant) differ
    from it by summation order and the output rounding: |y − ref| ≤ ulp(dtype)·|ref| +
    16·√K·2⁻²⁴·S, with S = |x|·|W|ᵀ the sum of absolute products (√K: another fp32 order; the
    factor leaves room for tensor-core accumulation). Families on bf16 weights (the dense fallback,
    any dequantize-to-bf16 path): + 3·2⁻⁸·S. A failure prints the worst error in units of
    √K·2⁻²⁴·S, to recalibrate from the first GPU log."""
    K = w.in_features
    assert not (CUDA and torch.backends.cuda.matmul.allow_tf32), "TF32 on: the fp32 reference would not be fp32"
    with torch.device(w.scales.device):
        ref = latq_linear_ref(x.float(), w, None if bias is None else bias.float())
        W = dequantize(w)
    S = (x.float().reshape(-1, K).abs() @ W.abs().T).reshape(ref.shape)
    if bias is not None:
        S = S + bias.float().abs()
    assert y.shape == ref.shape and y.dtype == x.dtype and y.device == x.device, (y.shape, y.dtype, y.device)
    assert torch.isfinite(y).all(), f"{what}: non-finite outputs"
    unit = math.sqrt(K) * 2.0**-24 * S
    slack = 16 * unit if exact else 3 * 2.0**-8 * S
    excess = (y.float() - ref).abs() - U_OUT[x.dtype] * ref.abs() - 2.0**-24
    bad = excess > slack
    if bad.any():
        worst = (excess / unit.clamp_min(1e-30)).max().item()
        i = int(bad.flatten().nonzero()[0])
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} outputs off the reference; first at "
                             f"{i}: y={y.flatten()[i].item():.6g} ref={ref.flatten()[i].item():.6g}; worst error "
                             f"beyond the output rounding = {worst:.3g} x sqrt(K)*2^-24*S (allowed "
                             f"{16 if exact else 'bf16 bound'})")


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def fixed_config(m: int, bits: int, dtype=torch.bfloat16) -> tuple[str, dict]:
    """The kernel the launcher picks for M and dtype, with the first production tile of its row
    tile and SPLIT = 1 (the tables tests/kernels/test_triton.py and the bench use): one compile per
    variant instead of an autotuning sweep."""
    tk = triton_module()
    if m < 8 or dtype == torch.float32:
        return "gemv", next(c for c in tk.gemv_configs(min(8, _next_pow2(m)), bits) if c["SPLIT"] == 1)
    return "mma", next(c for c in tk.mma_configs(tk.mma_bm(m), bits) if c["SPLIT"] == 1)
