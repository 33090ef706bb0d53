"""The runtime forms of a latq linear, built once at load. ``LatqWeight``: dense b-bit inliers packed as in the
checkpoint (``format.pack``), fp16 group scales (with their codes beside them when the
checkpoint stores coded scales), and CSR outliers with int32 columns and **fp32** values
(torch's sparse kernels have no bf16/fp16 path, and an HPTQ outlier z·s is exact in fp32 but
not always in fp16). HPTQ/HRTN layers are transcoded to this form (``transcode.py``), so one
kernel family serves both checkpoint kinds. ``CodebookWeight``: a codebook layer (method e8) as stored,
E8 codes of 8-column blocks and their group scales (format/codebook.py)."""
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
    # a rotated checkpoint's input rotation (format/rotation.py): fp32 ±1 [b], the signs of its
    # b-column blocks; the layer computes (x·R)·Wᵀ with W = this form's weights (kernels/rotated.py)
    rotation: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def nnz(self) -> int:
        return self.col.numel()

    def to(self, device) -> "LatqWeight":
        return LatqWeight(self.qweight.to(device), self.scales.to(device), self.crow.to(device),
                          self.col.to(device), self.val.to(device), self.bits, self.group_size, self.in_features,
                          None if self.coded is None else self.coded.to(device),
                          None if self.rotation is None else self.rotation.to(device))

    def bits_per_weight(self) -> float:
        """The runtime form's bytes → bits/weight (the reference kernel's served bits; each
        kernel's own: ``LatqKernel.served_bytes``)."""
        return 8 * sum(weight_bytes(self).values()) / (self.out_features * self.in_features)


@dataclass
class CodebookWeight:
    codes: torch.Tensor        # uint8 [out, in/8, index bytes]: each block's code (format/codebook.py)
    scales: torch.Tensor       # fp16  [out, ceil(in/group_size)]
    bits: int                  # the code's bits a weight (its CODEBOOKS entry)
    group_size: int            # a multiple of 8: a block lies in one group
    in_features: int
    coded: fmt.scale_codes.CodedScales | None = None   # as LatqWeight's
    rotation: torch.Tensor | None = None               # as LatqWeight's (a codebook layer is always rotated)

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def nnz(self) -> int:   # a codebook has no outliers: every block is a point of it
        return 0

    def to(self, device) -> "CodebookWeight":
        return CodebookWeight(self.codes.to(device), self.scales.to(device), self.bits, self.group_size,
                              self.in_features, None if self.coded is None else self.coded.to(device),
                              None if self.rotation is None else self.rotation.to(device))


RuntimeWeight = LatqWeight | CodebookWeight


def dequantize(w: RuntimeWeight) -> torch.Tensor:
    """fp32 ``[out, in]``: unpack(qweight) · scales (per group) + CSR(outliers), or each block's codebook
    point times its group's scale — of a rotated layer, the weights its rotated inputs multiply."""
    if isinstance(w, CodebookWeight):
        return fmt.codebook.dequantize(w.codes, w.scales, w.bits, w.group_size)
    return fmt.dequantize(w.qweight, w.scales, w.crow, w.col, w.val, w.bits, w.group_size, w.in_features)


def from_dense_tensors(t: dict[str, torch.Tensor], bits: int, group_size: int, in_features: int) -> LatqWeight:
    """A dense-kind checkpoint layer → runtime form (coded scales decoded, their codes kept)."""
    out = t["qweight"].shape[0]
    coded = fmt.scale_codes.from_tensors(t, out) if fmt.has_coded_scales(t) else None
    return LatqWeight(t["qweight"], fmt.dense_scales(t, out), t["outlier_crow"].int(), t["outlier_col"].int(),
                      t["outlier_val"].float(), bits, group_size, in_features, coded)


def from_codebook_tensors(t: dict[str, torch.Tensor], bits: int, group_size: int,
                          in_features: int) -> CodebookWeight:
    """A codebook-kind checkpoint layer → runtime form (coded scales decoded, their codes kept)."""
    out = t["codes"].shape[0]
    coded = fmt.scale_codes.from_tensors(t, out) if fmt.has_coded_scales(t) else None
    return CodebookWeight(t["codes"], fmt.dense_scales(t, out), bits, group_size, in_features, coded)


def weight_bytes(w: RuntimeWeight) -> dict[str, int]:
    """The runtime form's tensors, measured (``runtime_bytes`` is their model)."""
    def nb(*ts):
        return sum(t.numel() * t.element_size() for t in ts)
    if isinstance(w, CodebookWeight):
        return {"codes": nb(w.codes), "scales": nb(w.scales)}
    return {"inliers": nb(w.qweight), "scales": nb(w.scales), "outliers": nb(w.crow, w.col, w.val)}
