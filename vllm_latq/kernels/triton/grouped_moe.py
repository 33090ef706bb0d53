"""Grouped experts on the GPU: a MoE layer's experts in one stacked Triton layout (:func:`stack`)
and one launch per projection over the routed (token, slot) pairs only (:func:`route`), with no
host sync and launch parameters set by the batch size alone, so CUDA graphs replay it."""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import layout as tlay
from . import cost_model as triton_model
from ..base import flatten_dataclass, unflatten_dataclass
from .device import UNSPECIALIZED, _ell_gemv, _ell_rows, _gemv_step, _scale_base, _word_tile_ptrs, _word_tiles
from .kernel import GEMV_MAXNREG, INTERPRET, MAXNREG_OK, OUTL_CSR, OUTL_ELL, OUTL_NONE, TritonState

# Rows per program → (BN, warps), fixed, not autotuned: the first call may be inside a CUDA-graph
# capture. Chosen by the offline compile (-m bench.kernels --static-only): the fewest K-loop
# instructions per weight among spill-free tiles. Register caps: the GEMV's up to 2 rows; at 4
# and 8 rows its 128 cap of 2/4 bits spilled 16–184 B on sm_90 with ELL outliers: uncapped (255).
MOE_TILES = {1: (64, 4), 2: (64, 4), 4: (64, 4), 8: (32, 4)}
MOE_INTERP = dict(BN=64, num_warps=4)
MAX_BM = max(MOE_TILES)
# The K loop's SASS lane-instructions per weight per program of BM rows (triton_compile "i/w",
# sm_80, these tiles, no outliers): the cost model's issue term (docs/KERNELS.md).
MOE_IPW = {(2, 1): 5.75, (3, 1): 8.17, (4, 1): 6.31, (2, 2): 8.03, (3, 2): 10.20, (4, 2): 8.91,
           (2, 4): 11.97, (3, 4): 14.02, (4, 4): 13.03, (2, 8): 17.25, (3, 8): 19.16, (4, 8): 19.19}
MOE_IPW_CODED = {(2, 1): 6.26, (3, 1): 8.70, (4, 1): 7.33, (2, 2): 8.55, (3, 2): 10.73, (4, 2): 9.89,  # coded scales
                 (2, 4): 12.48, (3, 4): 14.54, (4, 4): 14.05, (2, 8): 18.25, (3, 8): 20.19, (4, 8): 21.12}


def moe_maxnreg(bits: int, bm: int) -> int:
    return GEMV_MAXNREG[bits] if bm <= 2 else 255


# ============================================================================ device code

@triton.jit(do_not_specialize=UNSPECIALIZED)        # the step and chunk counts (no M here): device.py
def _moe_gemv_kernel(x_ptr, y_ptr, pa_ptr, ph_ptr, pt_ptr, s_ptr, start_ptr, col_ptr, val_ptr, blk_ptr,
                     N, K, stride_xm, stride_ym, N_PAD, NCH_A, NCH_H, NGP, NSTEPS, TSTEPS,
                     EXP_A, EXP_H, EXP_T, EXP_S, EXP_O,
                     BITS: tl.constexpr, GROUP: tl.constexpr, SPG: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, OUTL: tl.constexpr, ASM: tl.constexpr,
                     CODED: tl.constexpr):
    """Program (b, n-tile): the expert of block b (``blocks``) on its ≤ BM rows of the
    expert-sorted activations, by the GEMV's K step (one K split, z·s formed once per slab)."""
    STEP: tl.constexpr = 16 * (32 if BITS == 3 else 32 // BITS)
    pid_b = tl.program_id(0)            # blocks fastest: the blocks of one expert share its tiles in L2
    pid_n = tl.program_id(1)
    e = tl.load(blk_ptr + 3 * pid_b)
    r0 = tl.load(blk_ptr + 3 * pid_b + 1)
    r1 = tl.load(blk_ptr + 3 * pid_b + 2)
    eo = tl.maximum(e, 0).to(tl.int64)
    rn = pid_n * BN + tl.arange(0, BN)
    rm = r0 + tl.arange(0, BM)
    w16 = tl.arange(0, 16)
    g16 = rn // 16
    r16 = rn % 16
    rn3 = rn[None, None, :]
    w3 = w16[None, :, None]
    rm3 = rm[:, None, None]
    xrow = x_ptr + rm3 * stride_xm
    mmask = rm3 < r1
    ta = _word_tile_ptrs(pa_ptr + eo * EXP_A, g16, r16, w3, NCH_A)
    th = _word_tile_ptrs(ph_ptr + eo * EXP_H, g16, r16, w3, NCH_H)
    sp = _scale_base(s_ptr + eo * EXP_S, g16, r16, NGP, CODED)[None, None, :]
    rs3 = r16[None, None, :]

    acc = tl.zeros([BM, 16, BN], dtype=tl.float32)
    if BITS == 3:       # the 4-bit tail (< 512 columns from NSTEPS·512), as a linear's GEMV runs it;
        # before the main steps, whose prefetched tiles would otherwise be live across it
        tt = _word_tile_ptrs(pt_ptr + eo * EXP_T, g16, r16, w3, TSTEPS)
        t_end = tl.where(e >= 0, TSTEPS, 0)
        for t in range(0, t_end):
            w4, _, _ = _word_tiles(tt, tt, t, t_end, rn3, w3, N_PAD, 4)
            acc = _gemv_step(acc, w4, w4, w4, NSTEPS * STEP + 128 * t, xrow, mmask, K, sp, rs3, rn3, w3, N_PAD,
                             4, GROUP, SPG, BM == 1, ASM, CODED)

    s_end = tl.where(e >= 0, NSTEPS, 0)                          # an unused block runs no step
    wa_n, wb_n, wh_n = _word_tiles(ta, th, 0, s_end, rn3, w3, N_PAD, BITS)
    for s in range(0, s_end):
        wa = wa_n
        wb = wb_n
        wh = wh_n
        wa_n, wb_n, wh_n = _word_tiles(ta, th, s + 1, s_end, rn3, w3, N_PAD, BITS)
        acc = _gemv_step(acc, wa, wb, wh, s * STEP, xrow, mmask, K, sp, rs3, rn3, w3, N_PAD, BITS, GROUP, SPG,
                         False, ASM, CODED)

    if OUTL == 1:       # ELL-16, offsets absolute into the concatenated entries
        e0, cnt, rmax = _ell_rows(start_ptr + eo * EXP_O, rn, N_PAD)
        acc = _ell_gemv(acc, e0, cnt, col_ptr, val_ptr, xrow, mmask, r16, w3, 0, tl.where(e >= 0, rmax, 0), 16)

    out = tl.sum(acc, axis=1)
    rm2 = rm[:, None]
    omask = (rm2 < r1) & (rn < N)[None, :]
    tl.store(y_ptr + rm2 * stride_ym + rn[None, :], out.to(y_ptr.dtype.element_ty), mask=omask)


# ============================================================================ stacked layout

@dataclass
class StackedTriton:
    """The Triton layouts of one projection of E experts, stacked (:func:`stack`)."""
    plane_a: torch.Tensor                 # int32 [E, words]
    plane_h: torch.Tensor | None          # int32 [E, words] (3 bits)
    plane_t: torch.Tensor | None          # int32 [E, words] (3 bits: the 4-bit tail, maybe 0 words)
    scales: torch.Tensor                  # fp16 [E, N_pad/16, ngroups_pad, 16], or coded: int32 [..., 3]
    off: torch.Tensor | None              # int32 [E, N_pad/16 + 1] ELL offsets, absolute
    col: torch.Tensor | None              # int16/32 [Σ slots]
    val: torch.Tensor | None              # fp16/32 [Σ slots]
    experts: int
    bits: int
    group: int
    spg: int
    n: int
    k: int
    n_pad: int
    k_pad: int
    outl: int                             # OUTL_NONE / OUTL_ELL

    @property
    def coded_scales(self) -> bool:
        return self.scales.dtype == torch.int32

    def nbytes(self) -> dict[str, int]:
        def nb(*ts):
            return sum(t.numel() * t.element_size() for t in ts if t is not None)
        return {"inliers": nb(self.plane_a, self.plane_h, self.plane_t), "scales": nb(self.scales),
                "outliers": nb(self.off, self.col, self.val)}

    def flatten(self):
        return flatten_dataclass(self)

    @classmethod
    def unflatten(cls, tensors, ints) -> "StackedTriton":
        return unflatten_dataclass(cls, tensors, ints)


# TritonState's fields this module reads or rebuilds (a field added to the layout must be
# taught here before experts with it are stacked)
READ_FIELDS = {"plane_a", "plane_h", "plane_t", "scales", "outl_start", "outl_row", "outl_col", "outl_val", "tickets", "bits", "group", "spg", "n", "k",
               "n_pad", "k_pad", "outl", "nnz"}


def plane_words(bits: int, n_pad: int, k_pad: int) -> list[int]:
    """int32 words of each plane of an ``n_pad``×``k_pad`` layer, as the kernel reads them."""
    return [n_pad * cols * pb // 32 for pb, cols in tlay.plane_columns(bits, k_pad)]


def stack_reason(states: list) -> str | None:
    """None if ``states`` (one projection's per-expert states) can be stacked and run by the
    grouped kernel, else why not."""
    if not states:
        return "no experts"
    if not all(isinstance(s, TritonState) for s in states):
        return "not every expert runs the Triton kernel"
    s0 = states[0]
    if s0.bits not in (2, 3, 4):
        return f"{s0.bits}-bit inliers (the grouped kernel reads 2, 3 and 4 bits)"
    shape = (s0.bits, s0.group, s0.spg, s0.n, s0.k, s0.n_pad, s0.k_pad)
    if any((s.bits, s.group, s.spg, s.n, s.k, s.n_pad, s.k_pad) != shape for s in states):
        return "experts differ in shape, bits or scale group"
    if any(s.scales.shape != s0.scales.shape or s.scales.dtype != s0.scales.dtype for s in states):
        return "experts differ in their scales' form (fp16 or coded)"
    unknown = {f.name for f in dataclasses.fields(TritonState)} - READ_FIELDS
    if unknown:
        return f"the Triton layout has parts the grouped kernel does not read: {sorted(unknown)}"
    words = plane_words(s0.bits, s0.n_pad, s0.k_pad)
    for s in states:
        have = [p.numel() for p in (s.plane_a, s.plane_h, s.plane_t) if p is not None]
        if have != words:
            return (f"{s.bits}-bit planes of {have} words, the grouped kernel reads the chunked planes of "
                    f"{words} words")
    if any(s.outl not in (OUTL_NONE, OUTL_ELL, OUTL_CSR) for s in states):
        return "unknown outlier layout"
    if sum(words) * len(states) >= 2**31:
        return f"{len(states)} experts of {sum(words)} words: the stack's int32 word index would pass 2³¹"
    return None


def _ell_of(st: TritonState) -> dict[str, torch.Tensor] | None:
    """The expert's outliers as ELL-16 (off, col, val), None without outliers."""
    if st.outl == OUTL_ELL:
        return {"off": st.outl_start, "col": st.outl_col, "val": st.outl_val}
    if st.outl == OUTL_CSR:
        return tlay.build_ell(st.outl_start, st.outl_col, st.outl_val, st.n_pad, st.k)[0]
    return None


def stack(states: list[TritonState]) -> tuple[StackedTriton, list[TritonState]]:
    """One projection's per-expert states → (the stack, the experts' states as views of it): planes
    and scales stacked along an expert axis, outliers ELL-16 with absolute offsets; a caller that
    replaces its states by the views keeps the weights stored once."""
    why = stack_reason(states)
    if why is not None:
        raise ValueError(f"latq: cannot stack these experts: {why}")
    s0, E = states[0], len(states)
    ells = [_ell_of(s) for s in states]
    outl = OUTL_ELL if any(o is not None for o in ells) else OUTL_NONE
    off = col = val = None
    if outl == OUTL_ELL:
        dev = s0.scales.device
        groups = s0.n_pad // tlay.ROWS
        empty = {"off": torch.zeros(groups + 1, dtype=torch.int32, device=dev),
                 "col": torch.zeros(0, dtype=torch.int16, device=dev),
                 "val": torch.zeros(0, dtype=torch.float16, device=dev)}
        ells = [o if o is not None else empty for o in ells]
        cdt = torch.int32 if any(o["col"].dtype == torch.int32 for o in ells) else torch.int16
        vdt = torch.float32 if any(o["val"].dtype == torch.float32 for o in ells) else torch.float16
        sizes = torch.tensor([o["col"].numel() for o in ells], dtype=torch.int64)
        base = torch.cumsum(sizes, 0) - sizes
        if int(sizes.sum()) >= 2**31:
            raise ValueError("latq: the experts' outliers exceed int32 offsets")
        off = torch.stack([o["off"].long() + int(b) for o, b in zip(ells, base)]).to(torch.int32)
        col = torch.cat([o["col"].to(cdt) for o in ells])
        val = torch.cat([o["val"].to(vdt) for o in ells])
    st = StackedTriton(torch.stack([s.plane_a for s in states]),
                       torch.stack([s.plane_h for s in states]) if s0.plane_h is not None else None,
                       torch.stack([s.plane_t for s in states]) if s0.plane_t is not None else None,
                       torch.stack([s.scales for s in states]), off, col, val,
                       E, s0.bits, s0.group, s0.spg, s0.n, s0.k, s0.n_pad, s0.k_pad, outl)
    views = []
    for e, s in enumerate(states):
        v = dict(plane_a=st.plane_a[e], plane_h=None if st.plane_h is None else st.plane_h[e],
                 plane_t=None if st.plane_t is None else st.plane_t[e], scales=st.scales[e])
        if outl == OUTL_ELL and s.outl != OUTL_NONE:
            b, n_e = int(base[e]), int(sizes[e])
            v.update(outl_start=(off[e] - b).to(torch.int32), outl_row=None, outl_col=col[b:b + n_e],
                     outl_val=val[b:b + n_e], outl=OUTL_ELL)
        views.append(dataclasses.replace(s, **v))
    return st, views


# ============================================================================ routing and launch

def row_block(pairs: int, experts: int) -> int:
    """Rows per program: the expected pairs per expert (uniform routing), a power of two ≤ 8."""
    return min(MAX_BM, 1 << max(0, (-(-pairs // experts) - 1).bit_length()))


def max_blocks(pairs: int, experts: int, bm: int) -> int:
    """Upper bound of Σ_e ⌈c_e/BM⌉ over every routing of ``pairs`` pairs to ``experts``."""
    return min(pairs, pairs // bm + min(experts, pairs))


def route(ids: torch.Tensor, experts: int, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat expert ids [P] (−1: not on this rank) → (order: the pairs sorted by expert, −1 last;
    blocks int32 [NB, 3]: expert or −1, first row, end row), each expert's pairs cut into blocks of
    BM rows; NB = min(P, ⌊P/BM⌋ + min(E, P)) bounds any routing. Torch ops only, capturable."""
    P = ids.numel()
    key = torch.where(ids >= 0, ids.long(), experts)
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(experts + 1, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    c = counts[:experts]
    nblk = (c + bm - 1) // bm
    blk_end = torch.cumsum(nblk, 0)
    row0 = torch.cumsum(c, 0) - c
    b = torch.arange(max_blocks(P, experts, bm), device=ids.device)
    e = torch.searchsorted(blk_end, b, right=True)
    used = e < experts
    ec = e.clamp(max=experts - 1)
    first = row0[ec] + (b - (blk_end[ec] - nblk[ec])) * bm
    end = torch.minimum(first + bm, row0[ec] + c[ec])
    blocks = torch.stack([torch.where(used, ec, -1), first, torch.where(used, end, first)], 1)
    return order, blocks.to(torch.int32).contiguous()


def launch(st: StackedTriton, xs: torch.Tensor, blocks: torch.Tensor, bm: int,
           config: dict | None = None) -> torch.Tensor:
    """y [P, N]: row r of the expert-sorted ``xs`` [P, K] through the expert of its block;
    rows in no block are left unwritten."""
    P, K = xs.shape
    if K != st.k:
        raise ValueError(f"activations have {K} features, the experts expect {st.k}")
    if xs.stride(-1) != 1:
        xs = xs.contiguous()
    y = torch.empty(P, st.n, dtype=xs.dtype, device=xs.device)
    if P == 0:
        return y
    if P * max(xs.stride(0), y.stride(0)) >= 2**31:
        # the kernel's row addresses are int32 (int64 ones cost the 3-bit coded variant spills)
        raise ValueError(f"latq grouped MoE: {P} routed rows × {max(xs.stride(0), y.stride(0))} columns pass "
                         "the kernel's int32 row addresses (2³¹); run the host path")
    spare = st.scales
    # a plane the experts lack (2/4 bits: the 1-bit plane and the tail; 3 bits: no tail, or no
    # whole chunk) gets an int32 stand-in of stride 0, as a linear's launch does: behind a
    # zero-trip loop, never read
    planes = [p if p is not None and p.numel() else blocks for p in (st.plane_a, st.plane_h, st.plane_t)]
    strides = [p.stride(0) if p is not blocks else 0 for p in planes]
    ks = tlay.k_steps(st.bits, st.k_pad)
    args = [xs, y, *planes, st.scales, *(t if t is not None else spare for t in (st.off, st.col, st.val)),
            blocks, st.n, K, xs.stride(0), y.stride(0), st.n_pad, ks["nch_a"], ks["nch_h"], st.scales.shape[2],
            ks["nsteps"], ks["tsteps"], *strides, st.scales.stride(0), st.off.stride(0) if st.off is not None else 0]
    if config is None:
        bn, nw = MOE_TILES[bm] if not INTERPRET else (MOE_INTERP["BN"], MOE_INTERP["num_warps"])
        config = dict(BN=bn, num_warps=nw)
    opts = {"maxnreg": moe_maxnreg(st.bits, bm)} if MAXNREG_OK and not INTERPRET else {}
    grid = (blocks.shape[0], tlay.cdiv(st.n_pad, config["BN"]))
    _moe_gemv_kernel[grid](*args, BITS=st.bits, GROUP=st.group, SPG=st.spg, BM=bm, BN=config["BN"],
                           OUTL=st.outl, ASM=not INTERPRET, CODED=st.coded_scales, num_warps=config["num_warps"],
                           num_stages=1, **opts)
    return y


def compile_all(st: StackedTriton, act_dtype: torch.dtype) -> None:
    """Compile the kernel for every row block at load, by launches over one unused block: a
    batch size first seen inside a CUDA-graph capture must not compile (load a module) there."""
    dev = st.plane_a.device
    xs = torch.zeros(1, st.k, dtype=act_dtype, device=dev)
    idle = torch.tensor([[-1, 0, 0]], dtype=torch.int32, device=dev)
    for bm in MOE_TILES:
        launch(st, xs, idle, bm)


def grouped_forward(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: StackedTriton,
                    w2: StackedTriton, act, weights_on_input: bool = False) -> torch.Tensor:
    """The experts' forward on the stacks (``act``: w13's outputs to w2's inputs), each slot summed per
    token in slot order (fp32): independent of how the pairs were sorted."""
    T, k = topk_ids.shape
    P = T * k
    bm = row_block(P, w13.experts)
    ids = topk_ids.reshape(-1)
    order, blocks = route(ids, w13.experts, bm)
    p = topk_weights.reshape(-1)[order].float()[:, None]
    xs = x[order // k]
    if weights_on_input:
        xs = xs * p.to(x.dtype)
    y = launch(w2, act(launch(w13, xs, blocks, bm)), blocks, bm).float()
    y = torch.where(ids[order][:, None] >= 0, y if weights_on_input else p * y, 0.0)
    out = torch.empty_like(y).index_copy_(0, order, y)      # back to (token, slot) order
    return out.view(T, k, w2.n).sum(1).to(x.dtype)


# ============================================================================ when it runs

LAUNCH_S = 5e-6     # one torch op from Python on the host path (launch + dispatch)
REPLAY_S = 2e-6     # one kernel of a replayed CUDA graph (device-side launch gap)
SYNC_S = 20e-6      # the host path's count read (device → host sync, the stream drained)


def path_times(tokens: int, topk: int, w13: StackedTriton, w2: StackedTriton,
               device: torch.device | None = None) -> dict[str, float]:
    """Model seconds of one layer's experts on each path of :mod:`~vllm_latq.kernels.moe` (cached
    per batch and shapes): ``stacked`` pays SIMT issue per block, ``host`` a sync and torch ops per
    routed expert, ``masked`` every expert on every token."""
    idx = None
    if device is not None and torch.device(device).type == "cuda":
        idx = torch.device(device).index
        idx = torch.cuda.current_device() if idx is None else idx
    shapes = tuple((s.n, s.k, s.bits, s.group, s.coded_scales) for s in (w13, w2))
    return _path_times(tokens, topk, w13.experts, shapes, idx)


@functools.lru_cache(maxsize=4096)
def _path_times(T: int, topk: int, E: int, shapes: tuple, device_index: int | None) -> dict[str, float]:
    props = torch.cuda.get_device_properties(device_index) if device_index is not None else None
    d = triton_model.device_model(props)
    P = T * topk
    routed = max(1.0, E * (1 - (1 - 1 / E) ** P))               # expected distinct experts (uniform routing)
    bm = row_block(P, E)
    blocks = min(max_blocks(P, E, bm), P / bm + routed)
    issue = blocks * sum(n * k * (MOE_IPW_CODED if c else MOE_IPW)[b, bm] for n, k, b, _, c in shapes) / d.issue

    def expert(rows):
        return sum(triton_model.model_times(rows, n, k, b, 0, group=g, device_props=props, coded=c)["mma"]
                   for n, k, b, g, c in shapes)
    per_routed = expert(max(1, round(P / routed)))
    return {"stacked": 10 * LAUNCH_S + max(routed * per_routed, issue),
            "host": SYNC_S + routed * (6 * LAUNCH_S + per_routed),
            "masked": E * (6 * REPLAY_S + expert(T))}
