"""CPU fast path: small M as one C++ op (the int4 GEMM or its own GEMV, then outliers, bias and
the cast in one pass; torch calls without a compiler), large M as a chunked dequantize + bf16
GEMM. Layouts: :mod:`~vllm_latq.kernels.cpu.layouts`; the choices and their measurements:
docs/KERNELS.md, "CPU kernel"."""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ... import format as fmt
from ... import env, native
from . import arena, dequant as cpu_dequant
from ..base import LatqKernel
from .layouts import (GEMV_LAYOUT, code_values, coded_scale_words, coo_to_csr, detect_layout, has_int4_op, int4_ops,
                      nbytes, op_scales_zeros, pack_gemv, state_bytes, tiles_from_csr, unpack_int4pack, value_bytes)
from ..derived_cache import DerivedCache
from ..weight import LatqWeight

OP_GROUPS = (256, 128, 64, 32)       # group sizes the op accepts, preferred first
MAX_BITS = 8
# bits > 4: weights off the 4-bit grid become fp32 outliers when they are at most this
# fraction of the layer, else a second int4 plane: below where the two cost the same time and
# memory (docs/KERNELS.md, "CPU kernel", 5- to 8-bit inliers).
SPLIT_ENV = "LATQ_CPU_SPLIT_MAX_EXTRA_RATE"
LARGE_M_ENV = "LATQ_CPU_LARGE_M"


def split_max_extra_rate() -> float:
    return env.number(SPLIT_ENV, 0.05, minimum=0.0, maximum=1.0)


def forced_large_m() -> int:
    """Rows (tokens) from which the dequantize + bf16 GEMM path takes over (0: by kernel, :func:`large_m`)."""
    return env.integer(LARGE_M_ENV, 0, minimum=0)


SPLIT_MAX_EXTRA_RATE = split_max_extra_rate()
LARGE_M = forced_large_m()
PREPARE_CHUNK = 1 << 22   # weights unpacked at a time in prepare (bounds its memory)
# Small M runs through the C++ op (vllm_latq.native) where ``native.usable()``: built, and not
# switched off by ``with native.disabled():`` (tests and benches compare both paths).

# ----------------------------------------------------------------------------- state

@dataclass
class CPUState:
    packed: torch.Tensor          # uint8 [N, Kp/2]  the op's int4pack (Kp = K·planes)
    scales: torch.Tensor          # bf16  [Kp/g, N]: scales alone where the C++ GEMV runs (zero 0, or 8·s on a
                                  #       two-plane layer's low plane); else [Kp/g, N, 2] torch's op's (s, z);
                                  #       or coded (int32 [K/g, N/16, 3], cpu_layouts.coded_scale_words), read
                                  #       by the C++ GEMV only: a checkpoint's coded scales where it runs
    crow: torch.Tensor | None     # int32 [N+1]  outliers as an fp32 CSR (None: none, or as tiles)
    col: torch.Tensor | None      # int32 [nnz]
    val: torch.Tensor | None      # fp32  [nnz]
    tile_off: torch.Tensor | None   # int32 [T+1]    outliers as the C++ op's tiles (tiles_from_csr)
    tile_rows: torch.Tensor | None  # int32 [T, 16]
    tile_col: torch.Tensor | None   # int16 [S, 16]
    tile_val: torch.Tensor | None   # [S, 16] fp16, int16 (× row_scale) or fp32: cpu_layouts.code_values
    row_scale: torch.Tensor | None  # fp32  [N]  each row's fp16 scale, for int16 tile values (else None)
    out_features: int
    in_features: int
    group_size: int               # g: the scales' group (scales alone: K for a one-scale layer)
    planes: int                   # 1: bits ≤ 4 (or split), 2: two nibble planes along K
    layout_block: int             # packed layout for the large-M dequant (0: unknown → op)
    layout_halves: int


def _op_group(K: int, g: int) -> int | None:
    for go in OP_GROUPS:
        if K % go == 0 and (g % go == 0 or g >= K):
            return go
    return None


def _unpack_rows(w: LatqWeight, r0: int, r1: int) -> torch.Tensor:
    """Signed integers of rows [r0, r1) → int32 [r1 - r0, K]: the format's unpacker on a row
    range (prepare works in row chunks to bound its memory)."""
    return fmt.unpack(w.qweight[r0:r1], w.bits, w.in_features)


def _scale_group(K: int, g: int, codes: bool = False) -> int | None:
    """The state's scale group, None where the kernel cannot lay the layer out: the op group (K for
    a one-scale layer where the GEMV runs), else g itself for scales kept as ``codes`` (g = 4k | K)."""
    go = _op_group(K, g)
    if go is None:
        return g if codes and K % g == 0 and g % 4 == 0 else None
    return K if g >= K and _gemv_here() else go


def _codes_here(bits: int, coded: bool) -> bool:
    """Whether the state keeps a layer's coded scales as codes: where the C++ GEMV runs, on a
    one-plane layer (≤ 4 bits); else they are decoded at prepare."""
    return coded and bits <= 4 and _gemv_here()


def _op_scales(w: LatqWeight, go: int, rows: slice) -> torch.Tensor:
    """fp32 [N', K/go] scale of every op group (each op group lies inside one latq group)."""
    K, g = w.in_features, w.group_size
    idx = torch.arange(K // go) * go // min(g, K) if g < K else torch.zeros(K // go, dtype=torch.long)
    return w.scales[rows].float()[:, idx]


def _planes(w: LatqWeight) -> int:
    """2 nibble planes for a layer past 4 bits with many weights off the 4-bit grid, else 1 (the
    4-bit grid, the rest split off as fp32 outliers)."""
    if w.bits <= 4:
        return 1
    N, K = w.out_features, w.in_features
    off = 0
    for r0 in range(0, N, 1024):
        z = _unpack_rows(w, r0, min(N, r0 + 1024))
        off += int(((z < -8) | (z > 7)).sum())
    return 1 if off <= SPLIT_MAX_EXTRA_RATE * N * K else 2


def _pack_rows(w: LatqWeight, planes: int, go: int, pack, r0: int, r1: int):
    """Rows [r0, r1) packed, their op-group (scale, zero) pairs, and the weights split off the
    4-bit grid as COO (rows, cols, fp32 values; None when not split)."""
    z = _unpack_rows(w, r0, r1)
    s = _op_scales(w, go, slice(r0, r1))                           # [R, K/go] fp32
    split = None
    if planes == 2:
        v = z + 128
        a, c = v >> 4, v & 15                                       # z = 16(a-8) + (c-8) + 8
        u = torch.cat([c, a], 1)
        szs = torch.cat([torch.stack([s, 8 * s], -1), torch.stack([16 * s, torch.zeros_like(s)], -1)], 1)
        return pack(u.int().contiguous(), 1), szs, split
    if w.bits > 4:
        m = (z < -8) | (z > 7)
        rr, cc = m.nonzero(as_tuple=True)
        split = (rr + r0, cc, z[rr, cc].float() * s[rr, cc // go])    # exact: ≤ 19 bits
        z = torch.where(m, torch.zeros_like(z), z)
    szs = torch.stack([s, torch.zeros_like(s)], -1)                 # [R, K/go, 2]
    return pack((z + 8).int().contiguous(), 1), szs, split


def _state_scales(w: LatqWeight, go: int, coded: bool, gemv: bool, pairs: list[torch.Tensor]) -> torch.Tensor:
    """The state's scales: coded words, the scales alone (the GEMV derives the zeros), or the
    (scale, zero) pairs of torch's op."""
    if coded:   # the codes of each scale group (op groups inside one latq group repeat them)
        idx = torch.arange(w.in_features // go) * go // w.group_size
        c = w.coded
        return coded_scale_words(fmt.scale_codes.CodedScales(c.codes[:, idx], c.min[:, idx], c.step[:, idx]))
    sz = torch.cat(pairs, 0).transpose(0, 1).to(torch.bfloat16)            # [Kp/go, N, 2]
    return (sz[..., 0] if gemv else sz).contiguous()


def _state_outliers(w: LatqWeight, split: list, tiles: bool):
    """The layer's CSR merged with the weights split off the grid (row-major, sorted), as a CSR
    or, where the C++ op reads them, its tiles: (crow, col, val, tile fields, row_scale)."""
    N, K = w.out_features, w.in_features
    rows = fmt.csr_rows(w.crow, w.nnz)
    cols, vals = w.col.long(), w.val.float()
    if split:
        rows = torch.cat([rows, *[r for r, _, _ in split]])
        cols = torch.cat([cols, *[c.long() for _, c, _ in split]])
        vals = torch.cat([vals, *[v for _, _, v in split]])
    if not vals.numel():
        return None, None, None, (None,) * 4, None
    crow, col, val = coo_to_csr(rows, cols, vals, N, K, sort=bool(split))
    if not (tiles and _tiles_here(K)):
        return crow, col, val, (None,) * 4, None
    # the C++ op's layout replaces the CSR
    s_row = w.scales[:, 0].float() if w.group_size >= K else None   # one scale per row
    coded = code_values(val, None if s_row is None else s_row[fmt.csr_rows(crow, val.numel())])
    row_scale = s_row.contiguous() if coded.dtype == torch.int16 else None
    return None, None, None, tiles_from_csr(crow, col, coded), row_scale


class CPUKernel(LatqKernel):
    """torch's int4pack GEMM + MKL CSR outliers; bf16 compute, output in x.dtype."""
    name = "cpu"
    state_cls = CPUState
    widths = tuple(range(2, MAX_BITS + 1))
    native_rotation = True   # its native ops rotate x by the signs (kernels/rotated.py): plain_op(rotated=True)

    @classmethod
    def can_implement(cls, w, device, act_dtype):
        device = torch.device(device)
        if device.type != "cpu":
            return False, f"device {device} is not a CPU"
        if act_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return False, f"activation dtype {act_dtype} unsupported (bf16/fp16/fp32)"
        if not has_int4_op():
            return False, f"torch {torch.__version__} has no aten._weight_int4pack_mm_for_cpu"
        if w.bits > MAX_BITS or w.bits < 1:
            return False, f"{w.bits}-bit inliers: the CPU path takes 1..{MAX_BITS} bits"
        if w.out_features % 16:
            return False, f"out_features={w.out_features} is not a multiple of 16 (int4pack layout)"
        if _scale_group(w.in_features, w.group_size, _codes_here(w.bits, w.coded is not None)) is None:
            return False, (f"in_features={w.in_features} with group size {w.group_size}: the int4 op "
                           f"needs a group size in {OP_GROUPS} dividing both in_features and the "
                           f"latq group size (the C++ GEMV reads coded scales at any group of 4k dividing it)")
        return True, None

    @classmethod
    def served_bytes(cls, state: CPUState) -> dict[str, int]:
        """Every state tensor (``scales_and_zeros`` with its zeros: the op reads them)."""
        t = [getattr(state, f) for f in ("crow", "col", "val", "tile_off", "tile_rows", "tile_col", "tile_val",
                                         "row_scale")]
        return {"inliers": nbytes(state.packed), "scales": nbytes(state.scales), "outliers": nbytes(*t)}

    @classmethod
    def layout_bytes(cls, n, k, bits, group, stats, scale_bits=None):
        """:meth:`served_bytes` from :meth:`prepare`'s decisions: op group, two planes or 4 bits
        + outliers past 4 bits (``SPLIT_MAX_EXTRA_RATE``), tiles or CSR (``_tiles_here``), coded
        scales (``scale_bits``) kept as codes or decoded (``_codes_here``)."""
        coded = _codes_here(bits, scale_bits is not None)
        go = _scale_group(k, group, coded)
        if not 1 <= bits <= MAX_BITS or n % 16 or go is None:   # can_implement's checks
            raise ValueError(f"the CPU kernel cannot lay out a {n}x{k} {bits}-bit layer with group {group}")
        planes = 2 if bits > 4 and stats.off_grid(4) - stats.off_grid(bits) > SPLIT_MAX_EXTRA_RATE * n * k else 1
        width = 4 if bits > 4 and planes == 1 else bits            # the outliers are those off this grid
        return state_bytes(n, k, planes, go, stats.row_outliers(width), _tiles_here(k),
                           value_bytes(stats, width, one_scale=group >= k), pairs=not _gemv_here(), coded=coded)

    @classmethod
    def native_op(cls):
        """``latq_cpu::linear`` (C++): small M in C++, large M back to ``latq::cpu_linear``."""
        if not native.usable():
            return None
        torch.ops.latq_cpu.set_large_m(large_m())
        return torch.ops.latq_cpu.linear.default

    @classmethod
    def plain_op(cls, state: CPUState, rotated: bool = False):
        """``latq_cpu::plain_linear`` for a state without outliers (the native op is the layer's);
        ``rotated``: ``latq_cpu::rotated_plain_linear``, which takes the signs after ``out_features``."""
        if cls.native_op() is None or _has_outliers(state) or state.row_scale is not None:
            return None
        return torch.ops.latq_cpu.rotated_plain_linear.default if rotated else torch.ops.latq_cpu.plain_linear.default

    # ------------------------------------------------------------------ prepare
    @classmethod
    def prepare(cls, w: LatqWeight, tiles: bool = True) -> CPUState:
        """``tiles``: store the outliers as the C++ op's tiles where its GEMV runs (False:
        keep the CSR, as for a layer with in_features ≥ 2¹⁵ or without the GEMV)."""
        ok, why = cls.can_implement(w, torch.device("cpu"), torch.bfloat16)
        if not ok:
            raise ValueError(f"CPU kernel cannot run this layer: {why}")
        # where the GEMV runs, its own layout on every CPU (one state whatever the instruction set;
        # torch's AVX2 kernel would pack other blocks); else torch's op's
        gemv = _gemv_here()
        pack = (lambda u, _inner: pack_gemv(u)) if gemv else int4_ops()[0]
        coded = _codes_here(w.bits, w.coded is not None)
        N, K, go = w.out_features, w.in_features, _scale_group(w.in_features, w.group_size, coded)
        planes = _planes(w)
        step = max(64, PREPARE_CHUNK // K // 64 * 64)   # whole 64-row pack blocks
        parts = [_pack_rows(w, planes, go, pack, r0, min(N, r0 + step)) for r0 in range(0, N, step)]
        packed = torch.cat([p for p, _, _ in parts], 0) if len(parts) > 1 else parts[0][0]
        if len(parts) > 1:
            # the layout packs blocks of rows independently, but check the concatenation anyway
            assert packed.shape == (N, K * planes // 2)
        sz = _state_scales(w, go, coded, gemv, [sz for _, sz, _ in parts])
        split = [e for _, _, e in parts if e is not None]
        crow, col, val, tile_fields, row_scale = _state_outliers(w, split, tiles)
        layout = GEMV_LAYOUT if gemv else detect_layout()
        if layout is not None and not cls._layout_reads_back(w, packed, planes, layout, split):
            layout = None
        return CPUState(packed, sz, crow, col, val, *tile_fields, row_scale, N, K, go, planes,
                        layout[0] if layout else 0, int(layout[1]) if layout else 0)

    @classmethod
    def _layout_reads_back(cls, w, packed, planes, layout, split) -> bool:
        """Whether the large-M dequant reads the layer's first and last row blocks back exactly."""
        N, K, B = w.out_features, w.in_features, layout[0]
        last = (N - 1) // B * B
        for r0, r1 in ((0, min(N, B)), (last, N)):
            got = unpack_int4pack(packed, N, K * planes, layout, r0, r1).T.int() + 8
            if not torch.equal(got, cls._reference_u(w, planes, r0, r1, split)):
                return False
        return True

    @staticmethod
    def _reference_u(w, planes, r0, r1, split):
        z = _unpack_rows(w, r0, r1)
        if planes == 2:
            v = z + 128
            return torch.cat([v & 15, v >> 4], 1)
        if split:
            z = torch.where((z < -8) | (z > 7), torch.zeros_like(z), z)
        return z + 8

    @classmethod
    def place(cls, state: CPUState) -> None:
        """The state's tensors into this process's weight arenas (huge pages, load order): what a
        decode step streams, kept together (:mod:`~vllm_latq.kernels.cpu.arena`)."""
        for f in fields(state):
            v = getattr(state, f.name)
            if isinstance(v, torch.Tensor):
                setattr(state, f.name, arena.place(v))

    # ------------------------------------------------------------------ apply
    @classmethod
    def apply(cls, state: CPUState, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        N, K = state.out_features, state.in_features
        x2 = x if x.dim() == 2 else x.reshape(-1, K)
        M = x2.shape[0]
        dtype = x.dtype
        large = M >= large_m() and state.layout_block
        if not large and native.usable():   # the same math in one C++ call
            y = torch.ops.latq_cpu.small_linear(x2, state.packed, state.scales, state.crow, state.col,
                                                state.val, state.tile_off, state.tile_rows, state.tile_col,
                                                state.tile_val, state.row_scale, bias, state.group_size,
                                                state.planes)
            return y if x.dim() == 2 else y.reshape(*x.shape[:-1], N)
        if large:
            y = cpu_dequant.large_m_linear(state, x2)                              # bf16 [M, N], outliers included
        else:
            xb = x2 if dtype == torch.bfloat16 and x2.is_contiguous() else x2.to(torch.bfloat16).contiguous()
            if state.planes == 2:
                xb = torch.cat([xb, xb], 1)
            sz, go = _op_scales_zeros(state)
            y = int4_ops()[1](xb, _op_packed(state), go, sz)              # bf16 [M, N]
        if _has_outliers(state) and not large:
            csr = _csr(state)
            xf = x2.float()
            ys = torch.mv(csr, xf[0]) if M == 1 else torch.sparse.mm(csr, xf.t()).t()   # fp32
            if dtype == torch.bfloat16 and bias is None:
                y = y.add_(ys)            # fp32 math, one rounding to bf16
            else:
                y = torch.add(ys, y)      # fp32
        if bias is not None:
            y = y.add_(bias) if y.dtype == torch.float32 else torch.add(y.float(), bias)
        if y.dtype != dtype:
            y = y.to(dtype)
        if not y.is_contiguous():
            y = y.contiguous()
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], N)


# ----------------------------------------------------------------------------- outlier tiles

_HAS_GEMV: bool | None = None


def _gemv_here() -> bool:
    """The C++ op is usable here (built, not disabled in this context) with its GEMV (AVX-512
    BF16 or AVX2, the same state and bits either way)."""
    global _HAS_GEMV
    if not native.usable():
        return False
    if _HAS_GEMV is None:   # a property of the build and the CPU: ask once
        _HAS_GEMV = bool(torch.ops.latq_cpu.has_gemv())
    return _HAS_GEMV


def gemv_isa() -> str:
    """The instruction set the C++ GEMV runs on here: "avx512", "avx2", or "" (torch's op)."""
    return str(torch.ops.latq_cpu.gemv_isa()) if _gemv_here() else ""


def _tiles_here(in_features: int) -> bool:
    """Whether prepare stores outliers as the C++ op's tiles: where its GEMV runs (elsewhere
    the CSR loop / MKL is faster) and columns fit int16."""
    return in_features < 2 ** 15 and _gemv_here()


def large_m() -> int:
    """Rows from which the dequantize + GEMM path runs: ``LARGE_M`` if set, else 640 with the
    C++ GEMV, 128 with torch's op: below each crossover (docs/KERNELS.md, "CPU kernel", Large M)."""
    return LARGE_M or (640 if _gemv_here() else 128)


def _has_outliers(state: CPUState) -> bool:
    return state.crow is not None or state.tile_col is not None


_CSR = DerivedCache()
_OP_SCALES = DerivedCache()
_OP_PACKED = DerivedCache()


def _op_scales_zeros(state: CPUState) -> tuple[torch.Tensor, int]:
    """torch's op's (s, z) pairs and op group for the state's scales (built once per layer
    when the state holds the scales alone or coded: the pure-torch path on a GEMV host)."""
    if state.scales.dim() == 3 and not cpu_dequant.is_coded(state):
        return state.scales, state.group_size
    return _OP_SCALES.get((state.scales,), lambda: op_scales_zeros(
        cpu_dequant.scales_alone(state), state.group_size, state.planes, state.in_features * state.planes, OP_GROUPS))


def _op_packed(state: CPUState) -> torch.Tensor:
    """The state's packed weights as torch's op reads them here: the state's own, or (a GEMV
    state on a CPU whose torch packs other blocks, run by the pure-torch path) repacked once per
    layer."""
    layout = (state.layout_block, bool(state.layout_halves))
    if not state.layout_block or layout == detect_layout():
        return state.packed
    N, Kp = state.out_features, state.in_features * state.planes
    return _OP_PACKED.get((state.packed,), lambda: int4_ops()[0](
        (unpack_int4pack(state.packed.detach(), N, Kp, layout).T.int() + 8).contiguous(), 1))


def _csr(state: CPUState) -> torch.Tensor:
    """The layer's fp32 CSR as a torch sparse tensor (from the tiles if the state holds those),
    built on first use and kept while the layer's tensors live (the op's state holds only
    non-sparse tensors)."""
    src = (state.crow, state.col, state.val) if state.crow is not None else (state.tile_off, state.tile_col,
                                                                            state.tile_val)

    def build():
        N, K = state.out_features, state.in_features
        if state.crow is not None:   # aliases without a view's _base: must not own the state's tensors
            crow, col, val = state.crow.detach(), state.col.detach(), state.val.detach()
        else:
            crow, col, val = coo_to_csr(*cpu_dequant.tile_entries_of(state, 0, N), N, K, sort=True)
        return torch.sparse_csr_tensor(crow, col, val, (N, K), check_invariants=False)

    return _CSR.get(src, build)


def clear_prefill_cache() -> None:
    cpu_dequant.clear()
    _CSR.clear()
    _OP_SCALES.clear()
    _OP_PACKED.clear()
