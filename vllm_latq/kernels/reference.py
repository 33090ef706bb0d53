"""The runtime form of a latq linear and the torch reference that defines its math.

Every kernel (Triton GPU, CPU fast path) computes exactly :func:`latq_linear_ref` up to
floating-point summation order, and is tested against it.

Runtime form (one per linear, built once at load): dense b-bit inliers packed as in the
checkpoint (``format.pack``), fp16 group scales, and CSR outliers with int32 columns and
**fp32** values (torch's sparse kernels have no bf16/fp16 path, and an HPTQ outlier z·s is
exact in fp32 but not always in fp16). HPTQ/HRTN layers are transcoded to this form
(:func:`transcode`), so one kernel family serves both checkpoint kinds.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import format as fmt


@dataclass
class LatqWeight:
    qweight: torch.Tensor      # int32 [out, ceil(in/32)·bits]
    scales: torch.Tensor       # fp16  [out, ceil(in/group_size)]
    crow: torch.Tensor         # int32 [out+1]
    col: torch.Tensor          # int32 [nnz]
    val: torch.Tensor          # fp32  [nnz]
    bits: int
    group_size: int
    in_features: int

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def nnz(self) -> int:
        return self.col.numel()

    def bits_per_weight(self) -> float:
        """Runtime bytes → bits/weight (what a decode step streams from memory)."""
        n = self.out_features * self.in_features
        return sum(t.numel() * t.element_size() * 8 for t in
                   (self.qweight, self.scales, self.crow, self.col, self.val)) / n


def dequantize(w: LatqWeight) -> torch.Tensor:
    """fp32 ``[out, in]``: unpack(qweight) · scales (per group) + CSR(outliers)."""
    return fmt.dequantize(w.qweight, w.scales, w.crow, w.col, w.val, w.bits, w.group_size, w.in_features)


def latq_linear_ref(x: torch.Tensor, w: LatqWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``y = x @ Wᵀ (+ bias)`` computed in fp32, returned in ``x.dtype``. x: ``[..., in]``."""
    y = x.float() @ dequantize(w).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def from_dense_tensors(t: dict[str, torch.Tensor], bits: int, group_size: int, in_features: int) -> LatqWeight:
    """A dense-kind checkpoint layer → runtime form."""
    return LatqWeight(t["qweight"], t["scales"], t["outlier_crow"].int(), t["outlier_col"].int(),
                      t["outlier_val"].float(), bits, group_size, in_features)


def transcode(z: torch.Tensor, scale, max_bits: int = 8) -> LatqWeight:
    """Unclipped integers under one scale per matrix (HPTQ/HRTN) — or one per row, for a
    fused layer whose parts keep their own per-matrix scales — → the dense+CSR runtime form
    with the inlier width b ∈ 2..max_bits that minimises runtime bytes; integers off the
    b-bit grid become fp32 outliers z·s (exact). The row's scale is its single group."""
    out, cin = z.shape
    s = torch.as_tensor(scale, dtype=torch.float32).reshape(-1).expand(out).contiguous()
    s16 = s.half()
    if not torch.equal(s16.float(), s):
        raise ValueError("a per-tensor scale (hscale) is not fp16-exact")
    lo_v, hi_v = (int(z.min()), int(z.max())) if z.numel() else (0, 0)
    best = None
    for b in range(2, max_bits + 1):
        lo, hi = -(2 ** (b - 1)), 2 ** (b - 1) - 1
        nnz = 0 if lo <= lo_v and hi_v <= hi else int(((z < lo) | (z > hi)).sum())
        size = out * fmt.packed_words(cin, b) * 4 + out * 2 + nnz * 8 + (out + 1) * 4
        if best is None or size < best[0]:
            best = (size, b)
    b = best[1]
    lo, hi = -(2 ** (b - 1)), 2 ** (b - 1) - 1
    mask = (z < lo) | (z > hi)
    rows, cols = mask.nonzero(as_tuple=True)
    crow = torch.zeros(out + 1, dtype=torch.int32)
    crow[1:] = torch.cumsum(mask.sum(1), 0)
    val = z[rows, cols].float() * s[rows]
    inl = torch.where(mask, torch.zeros_like(z), z)
    return LatqWeight(fmt.pack(inl, b), s16.reshape(out, 1).contiguous(), crow, cols.int(), val, b, cin, cin)


def random_weight(out: int, cin: int, bits: int, rate: float, *, group: int = 128, seed: int = 0,
                  scale_lo: float = 0.001, scale_span: float = 0.05, val_std: float = 0.3,
                  rows: tuple[tuple[int, float], ...] = ()) -> LatqWeight:
    """A random layer in the runtime form (tests, benches): uniform b-bit inliers, fp16 group
    scales uniform in [scale_lo, scale_lo + scale_span), outliers at uniform positions with
    probability ``rate`` (``rows``: (row, probability) pairs overriding it for some rows) and
    N(0, val_std²) fp32 values; the inlier at an outlier is 0."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randint(-2 ** (bits - 1), 2 ** (bits - 1), (out, cin), generator=g, dtype=torch.int32)
    mask = torch.rand(out, cin, generator=g) < rate
    for r, p in rows:
        mask[r] = torch.rand(cin, generator=g) < p
    z[mask] = 0
    scales = (torch.rand(out, -(-cin // group), generator=g) * scale_span + scale_lo).half()
    nz_rows, cols = mask.nonzero(as_tuple=True)
    crow = torch.zeros(out + 1, dtype=torch.int32)
    crow[1:] = torch.cumsum(mask.sum(1), 0)
    val = torch.randn(nz_rows.numel(), generator=g) * val_std
    return LatqWeight(fmt.pack(z, bits), scales, crow, cols.int(), val.float(), bits, group, cin)
