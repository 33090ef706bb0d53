"""The served-bytes model: how a layer's integers sit on the b-bit grids (``GridStats``), the
runtime form's bytes per width, and a transcoded layer's width (``choose_width``)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import format as fmt
from .weight import LatqWeight

NEED_MAX = 32      # GridStats bucket of entries that are outliers at every width (a CSR's)
RUNTIME_WIDTHS = tuple(range(2, 9))
FALLBACK_BYTES = 2      # per weight: the bf16 dequantize-once kernel any layer can fall back to
STATS_CHUNK = 1 << 22   # entries per chunk of GridStats.from_integers (bounds its fp64 temporaries)


@dataclass
class GridStats:
    """How a layer's integers sit on the b-bit grids: ``row_need[r, w]`` counts row r's entries whose
    smallest grid is w bits (``NEED_MAX``: stored outliers); ``inexact[w]`` those not fp16-exact."""
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
        """``z`` int [n, k] under fp32 scales ``s`` ([n] or [n, k]); ``stored``: (crow, val) of outliers
        beside z. Row chunks bound the temporaries, on z's device."""
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
    """int64: the smallest b with z on the signed b-bit grid, at most NEED_MAX - 1 (exact for
    |z| < 2^24)."""
    v = torch.bitwise_xor(z, z >> 31) if z.dtype == torch.int32 else torch.where(z < 0, -z - 1, z)
    return (torch.frexp(v.float()).exponent.to(torch.int64) + 1).clamp_(1, NEED_MAX - 1)   # bit length + 1


def runtime_bytes(n: int, k: int, bits: int, group: int, stats: GridStats) -> dict[str, int]:
    """Bytes of the runtime form (:class:`LatqWeight`) of a layer: what the reference kernel
    reads per call and the cost model of :func:`transcode` when no kernel family is named."""
    nnz = int(stats.row_outliers(bits).sum())
    return {"inliers": n * fmt.packed_words(k, bits) * 4, "scales": n * -(-k // group) * 2,
            "outliers": (n + 1) * 4 + nnz * 8}


def choose_width(n: int, k: int, stats: GridStats, family=None) -> int:
    """The inlier width a transcoded layer gets: among ``family.widths`` (None: 2..8), the fewest
    served bytes by ``family.layout_bytes``, ties to the narrower; where that costs more than the
    bf16 fallback, or the family takes no width, the form's best width the family does not take."""
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
