"""The CPU family's kernel for the codebook form (method e8): each block's E8 point decoded from its
code as the C++ op reads the row (``csrc/codebook.cpp``), never stored; where the op is not built,
the format's dequantization and an fp32 matmul per call (the same math). docs/KERNELS.md, "E8
codebooks"."""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from ...format import codebook as cb, scale_codes
from ...format.rotation import rotate
from ... import native
from ..base import LatqKernel
from ..reference import latq_linear_ref
from ..weight import CodebookWeight
from . import arena, layouts

ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@lru_cache(maxsize=None)
def decode_table() -> torch.Tensor:
    """fp32 ``[1024, 8]`` (one a process), ``decode_e8p``'s rule as rows a code's bytes address: 0..255
    E8P's patterns (byte 0), each signed in its last lane by its parity; 256..511 the ball, halved
    (byte 2 at 3 bits); per sign byte h (byte 1), row 512 + 2h its mask (−0.0 on each flipped lane, the
    last by the parity of h's low seven bits) and 513 + 2h its shift (±¼ by bit 7)."""
    a = cb.e8p_patterns().clone()
    odd = torch.remainder(a.sum(-1), 2) != 0
    a[odd, -1] = -a[odd, -1]
    h = (torch.arange(256)[:, None] >> torch.arange(cb.DIM - 1)) & 1
    flips = torch.cat([h, h.sum(-1, keepdim=True) % 2], -1).bool()
    masks = torch.zeros(256, cb.DIM, dtype=torch.float64).masked_fill(flips, -0.0)
    shifts = torch.where(torch.arange(256)[:, None] >= 128, -0.25, 0.25).double().expand(256, cb.DIM)
    signs = torch.stack([masks, shifts], 1).reshape(512, cb.DIM)
    return torch.cat([a, cb.e8_ball256() / 2, signs]).float().contiguous()


def coded_scale_words(cs: scale_codes.CodedScales) -> torch.Tensor:
    """Coded scales ``[N, G]`` → the op's int32 ``[ceil(N/16), G, 3]``: the integer GEMV's words (the
    stored 6 bits a scale), band-major."""
    pad = -cs.codes.shape[0] % scale_codes.ROWS
    codes = torch.nn.functional.pad(cs.codes, (0, 0, 0, pad))
    return layouts.coded_scale_words(scale_codes.CodedScales(codes, cs.min, cs.step, cs.bits)).transpose(0, 1).contiguous()


A8_ROWS = 32   # rows a half tile of the int8-activation layout (csrc/codebook_a8.cpp)


def _a8_plane() -> tuple[torch.Tensor, torch.Tensor]:
    """Each pair plane byte's row in the half tile and block in the pair (csrc/codebook_a8.cpp, "Layout")."""
    i = torch.arange(64)
    k, s, blk = i // 8, i % 8 // 2, i % 2
    j = 2 * k + s % 2
    return torch.where(s < 2, 0, 16) + torch.where(j < 8, 2 * j, 2 * (j - 8) + 1), blk


def tile_codes_a8(codes: torch.Tensor) -> torch.Tensor:
    """Codes ``[N, in/8, B]`` → ``[N/32, in/16, B, 64]``: pairs of blocks as planes of 32 rows (the same bytes)."""
    n, nb, nbytes = codes.shape
    rows, blk = _a8_plane()
    return codes.reshape(n // A8_ROWS, A8_ROWS, nb // 2, 2, nbytes)[:, rows, :, blk, :].permute(1, 2, 3, 0).contiguous()


def tile_codes(codes: torch.Tensor, rows: int) -> torch.Tensor:
    """Codes ``[N, in/8, B]`` → ``[N/rows, in/8, B, rows]``: a block's bytes as planes of ``rows`` rows."""
    if rows == 1:
        return codes.contiguous()
    if rows == A8_ROWS:   # the int8-activation layout
        return tile_codes_a8(codes)
    n, nb, nbytes = codes.shape
    return codes.reshape(n // rows, rows, nb, nbytes).permute(0, 2, 3, 1).contiguous()


def state_codes(state: "CodebookState") -> torch.Tensor:
    """uint8 ``[out, in/8, B]``: the state's codes in the format's row layout."""
    c = state.codes
    if state.tile_rows == A8_ROWS:
        rows, blk = _a8_plane()
        out = c.new_empty(c.shape[0], A8_ROWS, c.shape[1], 2, c.shape[2])
        out[:, rows, :, blk, :] = c.permute(3, 0, 1, 2)
        return out.reshape(-1, 2 * c.shape[1], c.shape[2])
    return c if c.dim() == 3 else c.permute(0, 3, 1, 2).reshape(-1, c.shape[1], c.shape[2])


def a8_block(group_size: int, in_features: int) -> int:
    """The columns of x one scale rounds in ``cpu-e8-a8``: 64, or the group where 64 does not divide it."""
    return 64 if group_size >= in_features or group_size % 64 == 0 else group_size


def round_to_int8(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    """x as ``cpu-e8-a8`` multiplies it, in fp32: each block of ``block`` columns of a row (the last may be
    shorter) on int8 steps of its max |x| / 127, halves to even."""
    xf = x.float()
    out = torch.empty_like(xf)
    for c0 in range(0, xf.shape[-1], block):
        xb = xf[..., c0:c0 + block]
        amax = xb.abs().amax(-1, keepdim=True)
        inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
        out[..., c0:c0 + block] = torch.round(xb * inv) * (amax / 127.0)
    return out


def state_rows(state: "CodebookState") -> int:
    """The layer's output rows, in either layout (no copy of the codes)."""
    return state.codes.shape[0] * state.tile_rows


def state_scales(state: "CodebookState") -> torch.Tensor:
    """fp16 ``[out, G]``: the state's scales as the format decodes them (coded words decoded)."""
    if state.scales.dtype == torch.float16:
        return state.scales
    return layouts.decode_scale_words(state.scales.transpose(0, 1))[:, :state_rows(state)].T.half()


@dataclass
class CodebookState:
    codes: torch.Tensor     # uint8 [out, in/8, bits] as stored, or tiled [out/64, in/8, bits, 64] (tile_codes)
    scales: torch.Tensor    # fp16 [out, ceil(in/group_size)], or coded: int32 [ceil(out/16), G, 3] (as stored)
    table: torch.Tensor     # fp32 [1024, 8]: decode_table(), shared by every layer
    bits: int
    group_size: int
    in_features: int
    tile_rows: int = 1      # 64 where the op's 64-row tiles' path runs (AVX-512 VBMI + GFNI), out % 64 == 0;
                            # 32: the int8-activation layout (tile_codes_a8)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class CPUCodebookKernel(LatqKernel):
    """E8 codes → fp32 points × scales (fp16 or coded, as stored) → FMA with x in fp32 (large M: tiles of
    decoded rows + a GEMM)."""
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
        scales = coded_scale_words(w.coded) if w.coded is not None else w.scales.half().contiguous()
        rows = cls.tile_rows(w.out_features)
        return CodebookState(tile_codes(w.codes, rows), scales, decode_table(), w.bits, w.group_size, w.in_features, rows)

    @classmethod
    def place(cls, state: CodebookState) -> None:
        """Codes and scales into the weight arenas, as the integer kernel's (the shared table stays)."""
        state.codes, state.scales = arena.place(state.codes), arena.place(state.scales)

    @staticmethod
    def tile_rows(out_features: int) -> int:
        """64 where the op's tiles' path runs here and the rows fill whole tiles, else 1 (rows)."""
        if not native.usable():
            return 1
        rows = int(torch.ops.latq_cpu.codebook_tile_rows())
        return rows if out_features % rows == 0 else 1

    @classmethod
    def native_op(cls):
        """``latq_cpu::codebook_linear`` (C++, every M), where the C++ ops are built."""
        return torch.ops.latq_cpu.codebook_linear.default if native.usable() else None

    @classmethod
    def apply(cls, state: CodebookState, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return cls.apply_rotated(state, x, None, bias)

    @classmethod
    def apply_rotated(cls, state: CodebookState, x: torch.Tensor, signs: torch.Tensor | None,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
        """``apply`` on x·R (R's fp32 ``signs``; None: on x), rotated in the same C++ call."""
        N = state_rows(state)
        if native.usable():
            tensors = [state.codes, state.scales, state.table] + ([] if signs is None else [signs])
            return cls.native_op()(x, tensors, [state.bits, state.group_size, state.in_features, state.tile_rows],
                                   bias, N)
        # without the op: the reference itself, on the state's codes and fp16 scales
        return latq_linear_ref(cls.activations(x if signs is None else rotate(x, signs), state),
                               CodebookWeight(state_codes(state), state_scales(state), state.bits, state.group_size,
                                              state.in_features), bias)

    @staticmethod
    def activations(x: torch.Tensor, state: CodebookState) -> torch.Tensor:
        """x as the kernel multiplies it (here: as it is)."""
        return x

    @classmethod
    def served_bytes(cls, state: CodebookState) -> dict[str, int]:
        """The codes, the fp16 scales and the shared table (a model's load report counts it once)."""
        return {"codes": _nbytes(state.codes), "scales": _nbytes(state.scales), "table": _nbytes(state.table)}

    @classmethod
    def shared_tensors(cls, state: CodebookState) -> dict[str, torch.Tensor]:
        return {"table": state.table}

    @classmethod
    def codebook_bytes(cls, n, k, bits, group, scale_bits=None):
        """A layer's own bytes: its codes and its scales as stored (fp16, or coded: 12 bytes per 16 rows
        and group); the table, one for the model, is not a layer's (``shared_tensors``)."""
        if bits not in cb.CODEBOOKS or k % cb.DIM or group % cb.DIM:
            raise ValueError(f"kernel {cls.name} cannot lay out a {n}x{k} {bits}-bit codebook layer with group {group}")
        return {"codes": n * k // cb.DIM * cb.CODEBOOKS[bits].index_bytes,
                "scales": (math.ceil(n / scale_codes.ROWS) * 12 if scale_bits else 2 * n) * math.ceil(k / group)}


class CPUCodebookA8Kernel(CPUCodebookKernel):
    """Opt-in (``LATQ_KERNEL=cpu-e8-a8``): ``cpu-e8`` on x rounded to int8 (:func:`round_to_int8`), integer
    products (``csrc/codebook_a8.cpp``): the reference's numbers on the rounded x; AVX-512 VBMI + VNNI + GFNI."""
    name = "cpu-e8-a8"
    family = None
    auto_select = False

    @classmethod
    def unavailable_here(cls):
        if not native.usable():
            return "needs latq's C++ ops, not built here"
        if not torch.ops.latq_cpu.codebook_a8_runs():
            return "needs AVX-512 VBMI, VNNI and GFNI (in the build and on this CPU)"
        return None

    @classmethod
    def can_implement(cls, w, device, act_dtype):
        ok, why = super().can_implement(w, device, act_dtype)
        if ok and (w.out_features % A8_ROWS or w.in_features % 16
                   or (w.group_size % 16 and w.group_size < w.in_features)):
            ok, why = False, (f"{w.out_features}x{w.in_features}, group size {w.group_size}: needs out_features a "
                              f"multiple of {A8_ROWS}, in_features of 16, the group of 16 or the whole row")
        missing = cls.unavailable_here() if ok else None
        return (False, missing) if missing else (ok, why)

    @staticmethod
    def tile_rows(out_features: int) -> int:   # its own layout's; can_implement asks out_features a multiple
        return A8_ROWS

    @classmethod
    def native_op(cls):
        """``latq_cpu::codebook_linear_a8``, where the C++ ops are built."""
        return torch.ops.latq_cpu.codebook_linear_a8.default if native.usable() else None

    @staticmethod
    def activations(x: torch.Tensor, state: CodebookState) -> torch.Tensor:
        return round_to_int8(x, a8_block(state.group_size, state.in_features))
