"""Triton kernels for latq linears, the host side (configs, prepared state, launch,
:class:`TritonKernel`): the GEMV for M = 1..7 and fp32, tensor cores for M = 8..16, dequantise-once
above."""
from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch
import triton

from ... import env
from ... import format as fmt
from . import layout as tlay
from ..base import LatqKernel
from ..weight import LatqWeight
from .dequant import DEFAULT_MAX_BYTES, Workspace, apply_large_m, large_m_reason, use_large_m
from .device import _gemv_kernel
from .mma import _mma_kernel
from .pipelined import _gemv_pipelined_kernel, _mma_pipelined_kernel
from .cost_model import mma_bm
from . import configs as cfg
from .configs import (GEMV_MAXNREG, GEMV_SPLITS, GEMV_TILES, MAX_SPLIT, MAXNREG_OK, MMA_MAXNREG,  # noqa: F401
                      MMA_SPLITS, MMA_TILES, SPLITK_MAX_N, SPLITK_ROWS, _next_pow2, gemv_configs, m_bucket,
                      mma_configs)

log = logging.getLogger(__name__)
SPLITK_SCRATCH = Workspace()        # fp32 split-K partials, one buffer per device and stream
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
ENV_INTERPRET_OK = "LATQ_TRITON_INTERPRET_OK"   # =1: accept CPU tensors when TRITON_INTERPRET=1


def interpret_ok() -> bool:
    return env.flag(ENV_INTERPRET_OK)
OUTL_NONE, OUTL_ELL, OUTL_CSR = 0, 1, 2
OUTL_CODE = {"none": OUTL_NONE, "ell": OUTL_ELL, "csr": OUTL_CSR}


# ============================================================================ configs

def spg_of(bits: int, group: int) -> int:
    """Slabs per scale application: the largest power of two dividing group/16, at most a K step's
    slabs (group % 16 == 0, or a single group)."""
    slabs = tlay.step_of(bits) // 16
    q = group // 16
    spg = 1
    while spg < slabs and q % (2 * spg) == 0:
        spg *= 2
    return spg


def _uniq(cfgs):
    out = []
    for c in cfgs:
        if c not in out:
            out.append(c)
    return out


def _prune(kernel, bits):
    """The autotuner's pruning: the shape's :func:`~.configs.candidates` (the same ones the
    table and the rule choose from)."""
    def prune(configs, named_args, **kw):
        def arg(name):
            return named_args.get(name, kw.get(name))
        bm, m_tiles = arg("BM"), tlay.cdiv(arg("M"), arg("BM"))
        can_split = m_tiles == 1
        allowed = [{k: v for k, v in c.items() if k != "maxnreg"}
                   for c in cfg.candidates(kernel, bits, bm, arg("N_PAD"), arg("NSTEPS") + arg("TSTEPS"), can_split)]
        keep = [c for c in configs if dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages) in allowed]
        return keep or configs[:1]
    return prune


def _config(c: dict) -> triton.Config:
    opts = {"maxnreg": c.get("maxnreg")} if MAXNREG_OK else {}
    return triton.Config({k: v for k, v in c.items() if k not in ("num_warps", "maxnreg", "num_stages")},
                         num_warps=c["num_warps"], num_stages=c.get("num_stages", 1), **opts)


@functools.lru_cache(maxsize=None)
def tuned(kernel: str, bits: int, bucket: int):
    """The autotuner of one kernel, bit width and M bucket (its own cache of configs, the binaries
    shared); only a bucket within one M tile may split K."""
    one_tile = bucket <= (8 if kernel == "gemv" else max(MMA_TILES))
    cfgs = [c for c in cfg.configs_for(kernel, None, bits) if one_tile or c["SPLIT"] == 1]
    return triton.autotune([_config(c) for c in _uniq(cfgs)], key=["N_PAD", "K", "BM", "BITS", "OUTL", "GROUP", "CODED"],
                           prune_configs_by={"early_config_prune": _prune(kernel, bits)})(_KERNELS[kernel])


_KERNELS = {"gemv": _gemv_kernel, "mma": _mma_kernel}
# DEPTH ≥ 2 in a launch config: the pipelined kernel of that name (triton/pipelined.py)
_PIPELINED = {"gemv": _gemv_pipelined_kernel, "mma": _mma_pipelined_kernel}


def kernel_fn(kernel: str, depth: int):
    """The ``@triton.jit`` function a launch of ``kernel`` at prefetch ``depth`` runs."""
    return (_PIPELINED if depth > 1 else _KERNELS)[kernel]


# ============================================================================ host side

@dataclass
class TritonState:
    """Prepared layer, tensor and int fields only, so a vLLM layer keeps it as buffers + static ints
    (layout: :mod:`~vllm_latq.kernels.triton.layout`)."""
    plane_a: torch.Tensor                 # int32 word blocks: the b-bit plane (3 / 5 bits: the 2- / 4-bit plane)
    plane_h: torch.Tensor | None          # int32 word blocks: 3 / 5 bits: the 1-bit plane
    plane_t: torch.Tensor | None          # int32 word blocks: 3 bits: the 4-bit tail (< 512 columns)
    scales: torch.Tensor                  # fp16 [N_pad/16, ngroups_pad, 16], or coded: int32 [N_pad/16, ngroups_pad, 3]
    outl_start: torch.Tensor | None       # where entries start: ELL off [G+1] per 16-row group, CSR crow [N_pad+1]
    outl_row: torch.Tensor | None         # CSR: each entry's row (ELL: None, the row is the slot)
    outl_col: torch.Tensor | None         # each entry's column
    outl_val: torch.Tensor | None         # each entry's value
    tickets: torch.Tensor                 # int32 [N_pad/16] split-K tickets, always back to 0
    bits: int
    group: int
    spg: int
    n: int
    k: int
    n_pad: int
    k_pad: int
    outl: int                             # OUTL_NONE / OUTL_ELL / OUTL_CSR
    nnz: int

    @property
    def coded_scales(self) -> bool:
        """The scales are laid out as codes (``triton_layout``), not fp16."""
        return self.scales.dtype == torch.int32

    @property
    def outlier_arrays(self) -> tuple:
        """The outlier arrays in the kernels' argument order (start, row, col, val)."""
        return self.outl_start, self.outl_row, self.outl_col, self.outl_val

    @classmethod
    def from_layout(cls, L: tlay.TritonLayout) -> "TritonState":
        o = L.outliers
        if L.outlier_mode == "ell":
            oo = [o["off"], None, o["col"], o["val"]]
        elif L.outlier_mode == "csr":
            oo = [o["crow"], o["row"], o["col"], o["val"]]
        else:
            oo = [None] * 4
        tickets = torch.zeros(L.n_pad // 16, dtype=torch.int32, device=L.scales.device)
        planes = L.planes + [None] * (3 - len(L.planes))
        return cls(*planes, L.scales, *oo, tickets,
                   L.bits, L.group, spg_of(L.bits, L.group), L.n, L.k, L.n_pad, L.k_pad,
                   OUTL_CODE[L.outlier_mode], L.nnz)


INDEX_LIMIT = 2**31        # the kernels index planes and outlier entries with int32


def size_reason(n: int, k: int, bits: int, nnz: int) -> str | None:
    """Why an n × k layer at ``bits`` overflows the kernels' int32 indices (planes or ELL slots of
    2³¹ or more), or None."""
    words = tlay.inlier_bytes(-(-n // tlay.ROWS) * tlay.ROWS, bits, tlay.pad_k(k, bits)) // 4
    if words >= INDEX_LIMIT:
        return f"{n}×{k} at {bits} bits is {words} int32 words of planes; the kernels index < 2³¹"
    if nnz >= INDEX_LIMIT // 16:
        return f"{nnz} outliers; the kernels index < 2³¹ / 16 (ELL slots)"
    return None


def splitk_floats(n_pad: int) -> int:
    """fp32 split-K partials a layer of ``n_pad`` rows may need (0: it never splits)."""
    return SPLITK_ROWS * n_pad if n_pad <= SPLITK_MAX_N else 0


def launch_shape(st: TritonState, M: int, kernel: str, bm: int | None = None) -> dict:
    """What a launch's config is chosen by: the row tile ``bm`` (M's, unless given), ``m_tiles``,
    ``ksteps`` and ``can_split`` (one M tile of a layer with split-K scratch)."""
    bm = bm or (min(8, _next_pow2(M)) if kernel == "gemv" else mma_bm(M))
    m_tiles = tlay.cdiv(M, bm)
    ks = tlay.k_steps(st.bits, st.k_pad)
    return dict(bm=bm, m_tiles=m_tiles, ksteps=ks["nsteps"] + ks["tsteps"],
                can_split=m_tiles == 1 and splitk_floats(st.n_pad) > 0)


def launch_candidates(st: TritonState, M: int, kernel: str) -> tuple[int, list[dict]]:
    """(row tile, the configs a launch of M rows may take): what the table and the rule choose among."""
    sh = launch_shape(st, M, kernel)
    return sh["bm"], cfg.candidates(kernel, st.bits, sh["bm"], st.n_pad, sh["ksteps"], sh["can_split"])


def launch_config(st: TritonState, M: int, kernel: str, device: torch.device, config: dict | None = None) -> dict:
    """The config one launch runs (tile, SPLIT, warps, stages, register cap, "BM"), the same on a GPU
    and in the interpreter: ``config``, else :func:`~.configs.choose`'s for ``device``'s family."""
    return _launch_plan(st, M, kernel, device, config)[0]


# (launch_config's config, launch_shape's shape at its row tile) of one launch
def _launch_plan(st: TritonState, M: int, kernel: str, device: torch.device, config: dict | None) -> tuple[dict, dict]:
    sh = launch_shape(st, M, kernel, config.get("BM") if config is not None else None)
    bm, can_split = sh["bm"], sh["can_split"]
    if config is None:
        config = cfg.choose(kernel, st.bits, bm, st.n_pad, st.k_pad, sh["ksteps"], sh["m_tiles"], can_split,
                            *cfg.device_info(device))
    if config["SPLIT"] > min(MAX_SPLIT, SPLITK_ROWS // bm) or (config["SPLIT"] > 1 and not can_split):
        raise ValueError(f"SPLIT must be ≤ {min(MAX_SPLIT, SPLITK_ROWS // bm)} at {bm}-row tiles, and 1 unless M is one tile "
                         f"of a layer of ≤ {SPLITK_MAX_N} rows")
    cap = config.get("maxnreg", (GEMV_MAXNREG if kernel == "gemv" else MMA_MAXNREG)[st.bits])
    return dict(config, BM=bm, maxnreg=cap, num_warps=config.get("num_warps", 4),
                num_stages=config.get("num_stages", 1)), sh


def _padded_xt(x2: torch.Tensor, rows: int) -> torch.Tensor:
    # the tensor-core kernel's outlier gathers read xᵀ [K, rows]: a slot's activations adjacent,
    # rows up to whole row tiles, so its loads need no row mask and vectorise. The rows past M
    # are left unset on a GPU, a launch saved: they feed only output rows the kernel never stores
    # (the interpreter zeroes them, or numpy warns about the garbage's arithmetic)
    xt = x2.new_empty(x2.shape[1], rows)
    xt[:, :x2.shape[0]] = x2.t()
    if INTERPRET:
        xt[:, x2.shape[0]:] = 0
    return xt


def launch(st: TritonState, x2: torch.Tensor, bias: torch.Tensor | None, kernel: str,
           config: dict | None = None, scratch: Workspace | None = None) -> torch.Tensor:
    """y [M, N] = x2 [M, K] @ Wᵀ (+ bias) with kernel "gemv" or "mma", at ``config`` or
    :func:`launch_config`'s; split-K partials in ``scratch`` (default ``SPLITK_SCRATCH``)."""
    M, K = x2.shape
    dev = x2.device
    y = torch.empty(M, st.n, dtype=x2.dtype, device=dev)
    if M == 0:
        return y
    autotune = config is None and cfg.autotune_enabled() and not INTERPRET
    c, sh = _launch_plan(st, M, kernel, dev, config if config is not None or not autotune else dict(SPLIT=1))
    bm, m_tiles, can_split = sh["bm"], sh["m_tiles"], sh["can_split"]
    spare = st.scales                                   # any tensor for pointers a variant never reads
    optr = [t if t is not None else spare for t in st.outlier_arrays]
    # a plane the layer lacks (2/4 bits: the 1-bit plane; 3 bits: no tail, or no whole chunk)
    # gets an int32 stand-in: Triton types the kernel by its pointers, and the word-tile code
    # behind a zero-trip loop must still compile on int32 words
    planes = [t if t is not None and t.numel() else st.tickets for t in (st.plane_a, st.plane_h, st.plane_t)]
    ks = tlay.k_steps(st.bits, st.k_pad)
    ws = (scratch or SPLITK_SCRATCH).flat(splitk_floats(st.n_pad) if can_split else 1, torch.float32, dev)
    has_bias = bias is not None
    args = [x2, y, bias if has_bias else y, *planes, st.scales, *optr, ws, st.tickets,
            M, st.n, K, x2.stride(0), y.stride(0), st.n_pad, ks["nch_a"], ks["nch_h"], st.scales.shape[1],
            ks["nsteps"], ks["tsteps"], bm]
    meta = dict(BITS=st.bits, GROUP=st.group, SPG=st.spg, BM=bm, OUTL=st.outl,
                HAS_BIAS=has_bias, ASM=not INTERPRET, CODED=st.coded_scales)
    if kernel == "mma":
        meta["F32DOT"] = INTERPRET or x2.dtype == torch.float32
        xt = _padded_xt(x2, m_tiles * bm) if st.outl else x2
        args += [xt, xt.stride(0)]

    def grid(META):
        return (m_tiles, tlay.cdiv(st.n_pad, META["BN"]), META["SPLIT"])

    if autotune:
        tuner = tuned(kernel, st.bits, m_bucket(M))
        tuner[grid](*args, **meta)
        best = tuner.best_config
        cfg.record(cfg.device_info(dev)[0], cfg.shape_class(kernel, st.bits, bm, st.n_pad, st.k_pad),
                   dict(best.kwargs, num_warps=best.num_warps, num_stages=best.num_stages))
        return y
    depth = c.get("DEPTH", 1)
    kw = {k: v for k, v in c.items() if k not in ("BM", "num_warps", "num_stages", "maxnreg", "DEPTH")}
    if depth > 1:
        kw["DEPTH"] = depth
    opts = {"maxnreg": c["maxnreg"]} if c["maxnreg"] and MAXNREG_OK and not INTERPRET else {}
    kernel_fn(kernel, depth)[grid(kw)](*args, **meta, **kw, num_warps=c["num_warps"], num_stages=c["num_stages"],
                                       **opts)
    return y


def pick_kernel(st: TritonState, x2: torch.Tensor) -> str:
    """The kernel for ``x2``'s rows: dequantise-once above ``MMA_MAX_M``, tensor cores from 8 rows,
    below that the GEMV or the table's route (:func:`~.configs.route`); fp32: the exact GEMV."""
    M = x2.shape[0]
    if use_large_m(x2):
        return "dequant"
    if x2.dtype == torch.float32:
        return "gemv"
    if M >= 8:
        return "mma"
    return cfg.route(st.bits, M, st.n_pad, st.k_pad, cfg.device_info(x2.device)[0])


def device_reason(device: torch.device, act_dtype: torch.dtype) -> str | None:
    """Why the Triton kernels cannot run on ``device`` with ``act_dtype`` activations, or None: a CUDA
    device of compute capability ≥ 8.0 (or CPU tensors in the interpreter, where allowed)."""
    device = torch.device(device)
    if device.type != "cuda":
        if not (INTERPRET and interpret_ok()):
            return (f"needs a CUDA device (got {device.type}); for CPU tensors set "
                    f"TRITON_INTERPRET=1 and {ENV_INTERPRET_OK}=1 (Triton interpreter)")
    elif torch.cuda.get_device_capability(device) < (8, 0):
        return f"needs compute capability ≥ 8.0 (got {torch.cuda.get_device_capability(device)})"
    if act_dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"activation dtype {act_dtype}"
    return None


def machine_reason() -> str | None:
    """Why the Triton kernels can run on no device of this machine, or None."""
    # device_count asks NVML where it can: no CUDA context made before vLLM forks its workers
    if (INTERPRET and interpret_ok()) or torch.cuda.device_count() > 0:
        return None
    return (f"needs a CUDA device (this machine has none); for CPU tensors set TRITON_INTERPRET=1 and "
            f"{ENV_INTERPRET_OK}=1 (Triton interpreter)")


class TritonKernel(LatqKernel):
    """Triton GPU kernels: SIMT GEMV (M ≤ 7), tensor-core GEMM (8 ≤ M ≤ 64), fused outliers;
    above 64 rows (``MMA_MAX_M``), dequantize once + cuBLAS."""
    name = "triton"
    state_cls = TritonState
    widths = tlay.WIDTHS
    workspace = Workspace(max_bytes=DEFAULT_MAX_BYTES)   # large-M scratch, one per device and stream
    splitk_workspace = SPLITK_SCRATCH                    # split-K partials, one per device and stream

    @classmethod
    def unavailable_here(cls) -> str | None:
        return machine_reason()

    @classmethod
    def reserve(cls, state: TritonState, act_dtype: torch.dtype) -> None:
        """Size both scratches for this layer at load, for every stream: they never grow during
        a CUDA graph capture, so their addresses stay those the graphs recorded."""
        dev = state.scales.device
        cls.splitk_workspace.reserve_flat(max(1, splitk_floats(state.n_pad)), torch.float32, dev)
        if large_m_reason(act_dtype) is None:
            cls.workspace.reserve(state.n, state.k, act_dtype, dev)

    @classmethod
    def can_implement(cls, w: LatqWeight, device: torch.device, act_dtype: torch.dtype):
        why = device_reason(device, act_dtype)
        if why is not None:
            return False, why
        if w.bits not in cls.widths:
            return False, f"{w.bits}-bit inliers (kernels exist for {', '.join(map(str, cls.widths))})"
        if w.scales.shape[1] > 1 and w.group_size % 16:
            return False, f"group size {w.group_size} is not a multiple of 16"
        why = size_reason(w.out_features, w.in_features, w.bits, w.nnz)
        return why is None, why

    @classmethod
    def served_bytes(cls, state: TritonState) -> dict[str, int]:
        """The planes, scales and outlier arrays as laid out (ELL padding included); the split-K
        ``tickets`` are left out (counters, not weights)."""
        def nb(*ts):
            return sum(t.numel() * t.element_size() for t in ts if t is not None)
        return {"inliers": nb(state.plane_a, state.plane_h, state.plane_t), "scales": nb(state.scales),
                "outliers": nb(*state.outlier_arrays)}

    @classmethod
    def layout_bytes(cls, n, k, bits, group, stats, scale_bits=None):
        """:meth:`served_bytes` of ``triton_layout.build``'s layout, from its shapes, planes, scales and
        outlier choice alone."""
        if bits not in cls.widths or (-(-k // group) > 1 and group % 16):
            raise ValueError(f"{bits}-bit inliers, group {group} (kernels: {cls.widths} bits, groups of 16s)")
        if scale_bits not in (None, *fmt.scale_codes.CODE_BITS):
            raise ValueError(f"{scale_bits}-bit scale codes (kernels: {fmt.scale_codes.CODE_BITS})")
        n_pad = -(-n // tlay.ROWS) * tlay.ROWS
        k_pad = tlay.pad_k(k, bits)
        g = k_pad if -(-k // group) == 1 else group
        out = {"inliers": tlay.inlier_bytes(n_pad, bits, k_pad), "scales": tlay.scale_bytes(n_pad, -(-k_pad // g),
                                                                                              scale_bits is not None),
               "outliers": 0}
        counts = stats.row_outliers(bits)
        nnz = int(counts.sum())
        if nnz:
            eb = (2 if k <= 32768 else 4) + (2 if stats.fp16_values(bits) else 4)
            crow = torch.zeros(n + 1, dtype=torch.int64, device=counts.device)
            crow[1:] = torch.cumsum(counts, 0)
            model = tlay.outlier_model(crow, n_pad, entry_bytes=eb)
            out["outliers"] = (model["slots"] * eb + 4 * (n_pad // tlay.ROWS + 1) if model["mode"] == "ell"
                               else nnz * (4 + eb) + 4 * (n_pad + 1))
        return out

    @classmethod
    def prepare(cls, w: LatqWeight, outlier_mode: str | None = None) -> TritonState:
        L = tlay.build(w, outlier_mode)
        log.debug("latq triton layout %dx%d %d-bit: outliers %s", w.out_features, w.in_features, w.bits,
                  L.outlier_reason)
        return TritonState.from_layout(L)

    @classmethod
    def apply(cls, state: TritonState, x: torch.Tensor, bias: torch.Tensor | None = None,
              kernel: str | None = None, config: dict | None = None) -> torch.Tensor:
        K = state.k
        if x.shape[-1] != K:
            raise ValueError(f"x has {x.shape[-1]} features, layer expects {K}")
        x2 = x.reshape(-1, K)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        if kernel is None:
            kernel = pick_kernel(state, x2)
        if kernel == "dequant":
            y = apply_large_m(state, x2, bias, cls.workspace)
        else:
            y = launch(state, x2, bias, kernel, config, cls.splitk_workspace)
        return y.reshape(*x.shape[:-1], state.n)
