"""The input transform of a rotated layer on a GPU: ``y = x·R`` (format/rotation.py), one
launch before the layer's GEMV/GEMM. A program holds a [BM, b] tile of one block column in
registers: the signs and 1/√b applied after the load (in fp32), log2(b) butterfly passes — each a
reshape that pairs every element with its partner b/2^(i+1) apart, ``a + c`` and ``a − c``
joined back —, one cast to the output's dtype. Checked against the torch reference in the
interpreter (tests/kernels/test_rotation_kernels.py)."""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .layout import cdiv


@triton.jit
def _hadamard_kernel(x_ptr, s_ptr, y_ptr, M, stride_xm, stride_ym, scale,
                     B: tl.constexpr, LOG: tl.constexpr, BM: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * B + tl.arange(0, B)
    mask = rows[:, None] < M
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + tl.arange(0, B)) * scale
    x = x * s[None, :]
    for i in tl.static_range(LOG):   # butterflies of half-width 2^i: blocks of 2^(i+1), pairs 2^i apart
        x = tl.permute(tl.reshape(x, (BM, B // (2 << i), 2, 1 << i)), (0, 1, 3, 2))
        a, c = tl.split(x)
        x = tl.reshape(tl.permute(tl.join(a + c, a - c), (0, 1, 3, 2)), (BM, B))
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], x.to(y_ptr.dtype.element_ty), mask=mask)


def rows_per_program(b: int) -> int:
    """Rows of a program's tile: 16, fewer for wide blocks (a tile of at most 4096 values)."""
    return max(1, min(16, 4096 // b))


def hadamard(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """``x·R`` in x's dtype; ``signs``: fp32 ±1 ``[b]`` on x's device, b a power of two dividing
    x's last dimension."""
    b, n = signs.numel(), x.shape[-1]
    if b & (b - 1) or n % b:
        raise ValueError(f"a rotation with {b}-column blocks on {n} columns (a power of two dividing it)")
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    M = x2.shape[0]
    if M:
        bm = rows_per_program(b)
        _hadamard_kernel[(cdiv(M, bm), n // b)](x2, signs, y, M, x2.stride(0), y.stride(0),
                                                       1.0 / math.sqrt(b), B=b, LOG=b.bit_length() - 1, BM=bm)
    return y.reshape(x.shape)
