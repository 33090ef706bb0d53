"""The CPU family's kernel for the codebook form (method e8): each block's E8 point decoded from its
code as the C++ op reads the row (``csrc/codebook.cpp``), never stored; where the op is not built,
the format's dequantization and an fp32 matmul per call (the same math). docs/KERNELS.md, "E8
codebooks"."""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from ...format import codebook as cb
from ... import native
from ..base import LatqKernel
from ..reference import latq_linear_ref
from ..weight import CodebookWeight

ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@lru_cache(maxsize=None)
def decode_table() -> torch.Tensor:
    """fp32 ``[642, 8]``, one per process, what the op decodes a code with (``decode_e8p``'s rule):
    rows 0..255 E8P's patterns, each with its parity (Σ a mod 2) as the sign of its last coordinate;
    256..511 the 256-point ball; 512..639 the sign masks of a code's seven sign bits h (−0.0 where a
    lane's sign flips: bit j, and the last lane by the parity of h), XOR'd onto a pattern, so the last
    sign is the parity of Σσa; 640, 641 the shifts +¼ and −¼."""
    a = cb.e8p_patterns().clone()
    odd = torch.remainder(a.sum(-1), 2) != 0
    a[odd, -1] = -a[odd, -1]
    h = (torch.arange(128)[:, None] >> torch.arange(cb.DIM - 1)) & 1
    flips = torch.cat([h, h.sum(-1, keepdim=True) % 2], -1).bool()
    masks = torch.zeros(128, cb.DIM, dtype=torch.float64).masked_fill(flips, -0.0)
    shifts = torch.tensor([[0.25] * cb.DIM, [-0.25] * cb.DIM], dtype=torch.float64)
    return torch.cat([a, cb.e8_ball256(), masks, shifts]).float().contiguous()


@dataclass
class CodebookState:
    codes: torch.Tensor     # uint8 [out, in/8, bits]: the form's codes, as stored
    scales: torch.Tensor    # fp16  [out, ceil(in/group_size)] (coded scales decoded)
    table: torch.Tensor     # fp32  [642, 8]: decode_table(), shared by every layer
    bits: int
    group_size: int
    in_features: int


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class CPUCodebookKernel(LatqKernel):
    """E8 codes → fp32 points → FMA with x in fp32 (large M: tiles of decoded rows + a GEMM)."""
    name = "cpu-e8"
    family = "cpu"
    forms = (CodebookWeight,)
    state_cls = CodebookState
    native_rotation = True   # its native op rotates x by a trailing signs tensor (kernels/rotated.py)

    @classmethod
    def can_implement(cls, w, device, act_dtype):
        device = torch.device(device)
        if not isinstance(w, CodebookWeight):
            return False, f"serves CodebookWeight layers, not {type(w).__name__}"
        if device.type != "cpu":
            return False, f"device {device} is not a CPU"
        if act_dtype not in ACT_DTYPES:
            return False, f"activation dtype {act_dtype} unsupported (bf16/fp16/fp32)"
        if w.bits not in cb.CODEBOOKS:
            return False, f"{w.bits}-bit codes: the codebooks are {sorted(cb.CODEBOOKS)} bits"
        if w.in_features % cb.DIM or w.group_size % cb.DIM:
            return False, (f"in_features={w.in_features}, group size {w.group_size}: both must be multiples of "
                           f"{cb.DIM}")
        return True, None

    @classmethod
    def prepare(cls, w: CodebookWeight) -> CodebookState:
        ok, why = cls.can_implement(w, torch.device("cpu"), torch.float32)
        if not ok:
            raise ValueError(f"kernel {cls.name} cannot run this layer: {why}")
        scales = w.coded.decode() if w.coded is not None else w.scales
        return CodebookState(w.codes.contiguous(), scales.half().contiguous(), decode_table(), w.bits,
                             w.group_size, w.in_features)

    @classmethod
    def native_op(cls):
        """``latq_cpu::codebook_linear`` (C++, every M), where the C++ ops are built."""
        return torch.ops.latq_cpu.codebook_linear.default if native.usable() else None

    @classmethod
    def apply(cls, state: CodebookState, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        N = state.codes.shape[0]
        if native.usable():
            return torch.ops.latq_cpu.codebook_linear(x, [state.codes, state.scales, state.table],
                                                      [state.bits, state.group_size, state.in_features], bias, N)
        # without the op: the reference itself, on the state's codes and fp16 scales
        return latq_linear_ref(x, CodebookWeight(state.codes, state.scales, state.bits, state.group_size,
                                                 state.in_features), bias)

    @classmethod
    def served_bytes(cls, state: CodebookState) -> dict[str, int]:
        """The codes, the fp16 scales and the shared table (a model's load report counts it once)."""
        return {"codes": _nbytes(state.codes), "scales": _nbytes(state.scales), "table": _nbytes(state.table)}

    @classmethod
    def shared_tensors(cls, state: CodebookState) -> dict[str, torch.Tensor]:
        return {"table": state.table}

    @classmethod
    def codebook_bytes(cls, n, k, bits, group, scale_bits=None):
        """A layer's own bytes: its codes and fp16 scales (coded ones are decoded at prepare); the
        table, one for the model, is not a layer's (``shared_tensors``)."""
        if bits not in cb.CODEBOOKS or k % cb.DIM or group % cb.DIM:
            raise ValueError(f"kernel {cls.name} cannot lay out a {n}x{k} {bits}-bit codebook layer with group {group}")
        return {"codes": n * k // cb.DIM * cb.CODEBOOKS[bits].index_bytes,
                "scales": 2 * n * math.ceil(k / group)}
