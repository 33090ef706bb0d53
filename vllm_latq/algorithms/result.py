"""What every solver returns."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..format.csr import csr_from_mask, csr_rows
from ..format.scale_codes import CodedScales
from .scales import expand


@dataclass
class CSR:
    """Sparse outliers of an ``[out, in]`` matrix in compressed-sparse-row form:
    ``crow`` int32 ``[out+1]``, ``col`` int32 ``[nnz]`` (original column indices, sorted
    within a row), ``val`` fp16 ``[nnz]``."""
    crow: torch.Tensor
    col: torch.Tensor
    val: torch.Tensor
    shape: tuple[int, int]

    @classmethod
    def from_mask(cls, mask: torch.Tensor, values: torch.Tensor) -> "CSR":
        crow, col, val = csr_from_mask(mask, values)
        return cls(crow, col.int(), val.half(), tuple(mask.shape))

    @property
    def nnz(self) -> int:
        return self.col.numel()

    def to_dense(self) -> torch.Tensor:
        """fp32 ``[out, in]`` with the outlier values, zeros elsewhere."""
        out = torch.zeros(self.shape, device=self.val.device)
        rows = csr_rows(self.crow, self.nnz)
        out[rows, self.col.long()] = self.val.float()
        return out


@dataclass
class QuantResult:
    """A quantized ``[out, in]`` matrix: integers ``z`` (int8 from clipped RTN), their dequantized
    weights ``q`` as a loader reconstructs them, ``scales`` (groups, or 0-d per matrix), the column
    ``order`` used, ``coded_scales`` (with ``scale_bits``) and the per-row certificate ``bound``
    ¼ Σ D s² (unclipped solvers; ``error(W, H)`` measures its left-hand side)."""
    method: str
    z: torch.Tensor
    stored_q: torch.Tensor | None
    scales: torch.Tensor
    group_size: int | None
    bits: int | None
    bits_per_weight: float
    order: torch.Tensor | None = None
    damp: float | None = None
    bound: torch.Tensor | None = None
    outliers: CSR | None = None
    info: dict = field(default_factory=dict)
    coded_scales: CodedScales | None = None   # the scales as stored codes (format/scale_codes.py)
    codes: torch.Tensor | None = None          # a codebook layer's codes (format/codebook.py); z is None

    @property
    def q(self) -> torch.Tensor:
        if self.stored_q is not None:
            return self.stored_q
        q = self.z.float() * expand(self.scales.float(), self.group_size, tuple(self.z.shape))
        return q if self.outliers is None else q + self.outliers.to_dense().to(q.device)

    @q.setter
    def q(self, value: torch.Tensor) -> None:
        self.stored_q = value

    @property
    def outlier_rate(self) -> float:
        return 0.0 if self.outliers is None else self.outliers.nnz / self.z.numel()

    def error(self, W: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
        """Measured per-row ``(q_i - w_i)ᵀ H_d (q_i - w_i)`` with the damping this result used,
        on W's device."""
        from .lattice import layer_error
        return layer_error(W, self.q.to(W.device), H, self.damp or 0.0)
