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
    # the scales as stored codes (format/scale_codes.py), for kernels that read them; ``scales``
    # is always their fp16 decode, so a kernel that takes fp16 scales ignores this
    coded: fmt.scale_codes.CodedScales | None = None

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def nnz(self) -> int:
        return self.col.numel()

    def to(self, device) -> "LatqWeight":
        return LatqWeight(self.qweight.to(device), self.scales.to(device), self.crow.to(device),
                          self.col.to(device), self.val.to(device), self.bits, self.group_size, self.in_features,
                          None if self.coded is None else self.coded.to(device))

    def bits_per_weight(self) -> float:
        """The runtime form's bytes → bits/weight (the reference kernel's served bits; each
        kernel's own: ``LatqKernel.served_bytes``)."""
        return 8 * sum(weight_bytes(self).values()) / (self.out_features * self.in_features)


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
    """A dense-kind checkpoint layer → runtime form (coded scales decoded, their codes kept)."""
    out = t["qweight"].shape[0]
    coded = fmt.scale_codes.from_tensors(t, out) if fmt.has_coded_scales(t) else None
    return LatqWeight(t["qweight"], fmt.dense_scales(t, out), t["outlier_crow"].int(), t["outlier_col"].int(),
                      t["outlier_val"].float(), bits, group_size, in_features, coded)


# ----------------------------------------------------------------------------- served bytes

NEED_MAX = 32      # GridStats bucket of entries that are outliers at every width (a CSR's)
RUNTIME_WIDTHS = tuple(range(2, 9))
FALLBACK_BYTES = 2      # per weight: the bf16 dequantize-once kernel any layer can fall back to
STATS_CHUNK = 1 << 22   # entries per chunk of GridStats.from_integers (bounds its fp64 temporaries)


@dataclass
class GridStats:
    """How a layer's integers sit on the b-bit grids, enough for any kernel's cost model:
    ``row_need[r, w]`` counts the entries of row r whose smallest grid is w bits (bucket
    ``NEED_MAX``: stored outliers, off every grid); ``inexact[w]`` counts those whose value
    (z·s, or the stored outlier) is not fp16-exact. Off the b-bit grid = buckets > b."""
    row_need: torch.Tensor     # int64 [n, NEED_MAX + 1]
    inexact: torch.Tensor      # int64 [NEED_MAX + 1]

    def row_outliers(self, bits: int) -> torch.Tensor:
        """int64 [n]: entries per row off the ``bits`` grid (the outliers at that width)."""
        return self.row_need[:, bits + 1:].sum(1)

    def off_grid(self, bits: int) -> int:
        return int(self.row_need[:, bits + 1:].sum())

    def fp16_values(self, bits: int) -> bool:
        """Every outlier at width ``bits`` has an fp16-exact value."""
        return int(self.inexact[bits + 1:].sum()) == 0

    @classmethod
    def from_integers(cls, z: torch.Tensor, s: torch.Tensor, stored: tuple | None = None) -> "GridStats":
        """``z`` int [n, k] under fp32 scales ``s`` ([n] per row, or [n, k] per entry);
        ``stored``: (crow, val) of outliers stored beside z (bucket NEED_MAX). Row chunks bound
        the temporaries; every tensor stays on z's device."""
        n = z.shape[0]
        nb = NEED_MAX + 1
        rows = max(1, STATS_CHUNK // max(1, z.shape[1]))
        row_need = z.new_zeros(n * nb, dtype=torch.int64)
        inexact = z.new_zeros(nb, dtype=torch.int64)
        for r0 in range(0, n, rows):
            zc = z[r0:r0 + rows]
            need = _grid_need(zc)
            sc = s[r0:r0 + rows].float()
            v = zc.float() * (sc[:, None] if sc.dim() == 1 else sc)     # the fp32 value an outlier stores
            exact = v.half().float() == v
            row0 = torch.arange(r0, r0 + zc.shape[0], device=z.device)[:, None] * nb
            row_need += torch.bincount((row0 + need).reshape(-1), minlength=n * nb)
            inexact += torch.bincount(need[~exact], minlength=nb)
        row_need = row_need.view(n, nb)
        if stored is not None:
            crow, val = stored
            row_need[:, NEED_MAX] += (crow[1:] - crow[:-1]).long()
            v = val.float()
            inexact[NEED_MAX] += int((v.half().float() != v).sum())
        return cls(row_need, inexact)

    @classmethod
    def from_weight(cls, w: "LatqWeight") -> "GridStats":
        """A runtime-form layer: its inliers under their group scales, its CSR outliers."""
        z = fmt.unpack(w.qweight, w.bits, w.in_features)
        g = min(w.group_size, w.in_features)
        s = w.scales.float().repeat_interleave(g, 1)[:, :w.in_features]
        return cls.from_integers(z, s, stored=(w.crow, w.val))


def _grid_need(z: torch.Tensor) -> torch.Tensor:
    """int64: the smallest b with z on the signed b-bit grid [-2^(b-1), 2^(b-1)), at most
    NEED_MAX - 1 (exact for |z| < 2^24, where fp32 holds v exactly; beyond, ±1 — no kernel
    width comes near)."""
    v = torch.bitwise_xor(z, z >> 31) if z.dtype == torch.int32 else torch.where(z < 0, -z - 1, z)
    return (torch.frexp(v.float()).exponent.to(torch.int64) + 1).clamp_(1, NEED_MAX - 1)   # bit length + 1


def runtime_bytes(n: int, k: int, bits: int, group: int, stats: GridStats) -> dict[str, int]:
    """Bytes of the runtime form (:class:`LatqWeight`) of a layer: what the reference kernel
    reads per call and the cost model of :func:`transcode` when no kernel family is named."""
    nnz = int(stats.row_outliers(bits).sum())
    return {"inliers": n * fmt.packed_words(k, bits) * 4, "scales": n * -(-k // group) * 2,
            "outliers": (n + 1) * 4 + nnz * 8}


def weight_bytes(w: LatqWeight) -> dict[str, int]:
    """The runtime form's tensors, measured (``runtime_bytes`` is their model)."""
    def nb(*ts):
        return sum(t.numel() * t.element_size() for t in ts)
    return {"inliers": nb(w.qweight), "scales": nb(w.scales), "outliers": nb(w.crow, w.col, w.val)}


def choose_width(n: int, k: int, stats: GridStats, family=None) -> int:
    """The inlier width a transcoded layer (one scale group per row) gets: among the widths
    ``family`` takes (``family.widths``; None: the runtime form's 2..8), the one with the
    fewest served bytes by the family's cost model (``family.layout_bytes``), ties to the
    narrower. Where the family's best costs more than the bf16 fallback (``FALLBACK_BYTES``
    per weight) or it takes the layer at no width, the layer is left to that fallback: the
    runtime form's best width among those the family does not take."""
    def best(widths, cost):
        sizes = []
        for b in widths:
            try:
                sizes.append((sum(cost(n, k, b, k, stats).values()), b))
            except ValueError:   # the family cannot lay out this layer at this width
                pass
        return min(sizes, default=None)
    if family is None:
        return best(RUNTIME_WIDTHS, runtime_bytes)[1]
    got = best(family.widths, family.layout_bytes)
    if got is not None and got[0] <= FALLBACK_BYTES * n * k:
        return got[1]
    rest = [b for b in RUNTIME_WIDTHS if b not in family.widths]
    return (best(rest, runtime_bytes) or best(RUNTIME_WIDTHS, runtime_bytes))[1]


def transcode(z: torch.Tensor, scale, *, family=None, stats: GridStats | None = None) -> LatqWeight:
    """Unclipped integers under one scale per matrix (HPTQ/HRTN) — or one per row, for a
    fused layer whose parts keep their own per-matrix scales — → the dense+CSR runtime form
    with the inlier width that minimises the served bytes of ``family`` (a kernel class
    with ``widths`` and ``layout_bytes``: the kernel family that will serve the layer; None:
    the runtime form's own bytes, widths 2..8, :func:`choose_width`). Integers off the b-bit
    grid become fp32 outliers z·s (exact). The row's scale is its single group. Every tensor
    is made on z's device."""
    out, cin = z.shape
    dev = z.device
    s = torch.as_tensor(scale, dtype=torch.float32, device=dev).reshape(-1).expand(out).contiguous()
    s16 = s.half()
    if not torch.equal(s16.float(), s):
        raise ValueError("a per-tensor scale (hscale) is not fp16-exact")
    stats = GridStats.from_integers(z, s) if stats is None else stats
    b = choose_width(out, cin, stats, family)
    lo, hi = -(2 ** (b - 1)), 2 ** (b - 1) - 1
    mask = (z < lo) | (z > hi)
    rows, cols = mask.nonzero(as_tuple=True)
    crow = torch.zeros(out + 1, dtype=torch.int32, device=dev)
    crow[1:] = torch.cumsum(mask.sum(1), 0)
    val = z[rows, cols].float() * s[rows]
    inl = torch.where(mask, torch.zeros_like(z), z)
    return LatqWeight(fmt.pack(inl, b), s16.reshape(out, 1).contiguous(), crow, cols.int(), val, b, cin, cin)


def random_weight(out: int, cin: int, bits: int, rate: float, *, group: int = 128, seed: int = 0,
                  scale_lo: float = 0.001, scale_span: float = 0.05, val_std: float = 0.3,
                  rows: tuple[tuple[int, float], ...] = (), cells: tuple[tuple[int, int], ...] = (),
                  fp16_values: bool = False, scale_bits: int | None = None) -> LatqWeight:
    """A random layer in the runtime form (tests, benches): uniform b-bit inliers, fp16 group
    scales uniform in [scale_lo, scale_lo + scale_span), outliers at uniform positions with
    probability ``rate`` (``rows``: (row, probability) pairs overriding it for some rows;
    ``cells``: (row, col) positions that are outliers too) and N(0, val_std²) fp32 values
    (``fp16_values``: rounded to fp16, as SSQR checkpoints store them); the inlier at an
    outlier is 0. ``scale_bits``: the scales coded (``format.scale_codes``), ``scales`` their
    decode."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randint(-2 ** (bits - 1), 2 ** (bits - 1), (out, cin), generator=g, dtype=torch.int32)
    mask = torch.rand(out, cin, generator=g) < rate
    for r, p in rows:
        mask[r] = torch.rand(cin, generator=g) < p
    for r, c in cells:
        mask[r, c] = True
    z[mask] = 0
    scales = (torch.rand(out, -(-cin // group), generator=g) * scale_span + scale_lo).half()
    nz_rows, cols = mask.nonzero(as_tuple=True)
    crow = torch.zeros(out + 1, dtype=torch.int32)
    crow[1:] = torch.cumsum(mask.sum(1), 0)
    val = torch.randn(nz_rows.numel(), generator=g) * val_std
    if fp16_values:
        val = val.half()
    coded = None if scale_bits is None else fmt.scale_codes.code_scales(scales, scale_bits)
    if coded is not None:
        scales = coded.decode().half()
    return LatqWeight(fmt.pack(z, bits), scales, crow, cols.int(), val.float(), bits, group, cin, coded)
