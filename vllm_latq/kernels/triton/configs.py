"""Launch configurations of the Triton kernels, fixed per GPU family and shape class so that
serving never autotunes (vLLM's warm-up and capture must not benchmark): the packaged table
(``launch_configs.json``, from ``tools/launch_table.py``), else :func:`rule`'s choice among the
same candidates. ``LATQ_AUTOTUNE=1`` tunes; ``LATQ_LAUNCH_CONFIGS=FILE`` overrides the table."""
from __future__ import annotations

import functools
import inspect
import json
from pathlib import Path

import torch
import triton

from ... import env
from .cost_model import MMA_BMS
from .layout import cdiv

MAX_SPLIT = 8
ENV_AUTOTUNE = "LATQ_AUTOTUNE"
ENV_TABLE = "LATQ_LAUNCH_CONFIGS"
TABLE_FILE = Path(__file__).with_name("launch_configs.json")
# GPU families the table covers, and the SM count of the part the offline choice plans for
# (A100, A10/A6000 class, L40S, H100 SXM)
FAMILY_SMS = {"sm_80": 108, "sm_86": 84, "sm_89": 142, "sm_90": 132}
# what the interpreter pretends to run on: (compute capability, SMs)
INTERPRETER_DEVICE = ((8, 0), 108)
CLASS_MIN, CLASS_MAX = 256, 1 << 17          # N and K classes: powers of two, clamped


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())

# Tile candidates for Ampere (A100: 108 SMs, 164 KiB smem/SM, 64 K registers/SM;
# A10/A6000/RTX 30xx: 72–84 SMs, 100 KiB). Tiles per activation-row tile BM, chosen from
# offline compilation (ptxas registers; bench/kernels.py prints them): every listed tile
# compiles without spills on sm_80/86/89/90, at ≤ ~128 registers where possible.
#
# SIMT GEMV (BN, warps): register-only (shared memory only for the final cross-warp sum),
# so the knobs are the row tile BN (bytes in flight per program: BN·64 B per plane per step,
# two steps with the prefetch), warps (registers: BM·16·BN fp32 accumulators over 32·warps
# threads), and SPLIT: programs per row tile along K, for when N/BN alone cannot give
# ~2 programs per SM (o/down projections at TP > 1, K ≥ 8k).
GEMV_TILES = {1: [(32, 2), (64, 4), (128, 8)],
              2: [(32, 2), (64, 4), (128, 8)],
              4: [(32, 4), (64, 8)],
              8: [(16, 4)]}
GEMV_SPLITS = (1, 2, 4, 8)
# Tensor-core kernel (BN, warps, BR = outlier slots per iteration) per activation-row tile BM:
# a program dequantises its weight tile once per K step and multiplies it with all BM rows
# (one tl.dot), so a batch of M rows re-dequantises each weight ⌈M/BM⌉ times; the grid runs
# M fastest, so the ⌈M/BM⌉ programs of one weight tile run side by side and read it from HBM
# once. :func:`mma_bm` picks BM from M. Every listed tile compiles without spills on sm_80 and
# sm_90 at 2/3/4/5 bits (docs/KERNELS.md, "Triton tiles and the offline compile"); 128-row tiles spill.
# BR shrinks as BM grows: the ELL outlier gather holds BM·BR·BN activations, and BM·BR = 128
# keeps it the size the 16-row tile has (a larger BR at BM = 64 spills). At BM = 64 only
# BN = 32 × 4 warps is clean everywhere and cheapest per weight (docs/KERNELS.md, "Triton tiles
# and the offline compile", has the spills and instruction counts of the others).
MMA_TILES = {16: [(32, 4, 8), (64, 4, 8), (128, 8, 8)],
             32: [(32, 4, 4), (64, 8, 4), (128, 8, 4)],
             64: [(32, 4, 2)]}
assert tuple(MMA_TILES) == MMA_BMS
MMA_SPLITS = {16: (1, 2, 4, 8), 32: (1, 2, 4), 64: (1, 2)}
# Register caps (.maxnreg) per kernel and bit width. Without a cap ptxas picks an
# occupancy tier (64/72/80/96/128/168 registers) and spills a few bytes to reach it in
# some variants; with a cap it allocates up to the cap and spills only if the code needs more. 2/4-bit GEMV fits 128 (≥ 16 warps/SM);
# 3-bit GEMV (three word planes, prefetched) and the tensor-core kernel (accumulator, group
# partial, B tile) take what they need (≤ 255). ``Config(maxnreg=)`` and the launch option
# are feature-detected (``MAXNREG_OK``; Triton 3.0.0, the gpu extra's floor, has both): a
# Triton without them gets no caps, and ptxas chooses (a few bytes of spills, see above).
GEMV_MAXNREG = {2: 128, 3: 255, 4: 128, 5: 128}
MMA_MAXNREG = {2: 255, 3: 255, 4: 255, 5: 255}
MAXNREG_OK = "maxnreg" in inspect.signature(triton.Config.__init__).parameters
# Software-pipeline stages: the tensor-core kernel's K loop prefetches its next word tiles
# through shared memory at 2 stages (smem ≤ 43 KB); the SIMT kernel prefetches by hand in
# registers and keeps 1. Three 2-bit tiles spill in some variant at 2 stages and in none at 1
# (BM 32: BN 32 × 4 warps and BN 128 × 8 on sm_90; BM 64: BN 32 × 4 on sm_80/86/89), so they
# stay single-buffered; the offline compile sweep (tools/triton_compile.py, the slow
# test) checks every tile at the stages it is served with.
MMA_STAGES = 2
MMA_SINGLE_STAGE = {(2, 32, 32, 4), (2, 32, 128, 8), (2, 64, 32, 4)}       # (bits, BM, BN, warps)


# Pipelined kernels (triton/pipelined.py): every tile again with DEPTH K steps of weights (and
# their scales) in a register queue instead of one, the outliers' loads riding the loop ahead of
# their use. One depth per kernel, width and row tile: the deepest of 2 and 4 at which every layer
# form of the compile record compiles without spills at the tile's register cap; tiles that spilled
# at both are left out (docs/KERNELS.md). 3-bit
# steps hold three word tiles a step: their queue halves the resident programs, so they stay
# unpipelined; 5-bit layers too (the kernels take them, the record does not compile them: at
# depth 2 their two planes gain least). Offered on PIPE_FAMILIES, whose compile the record checks;
# served only where a table entry names them (measured on a GPU): the rule and the modelled
# table keep DEPTH 1.
PIPE_DEPTH = {("gemv", 2, 2): 2, ("gemv", 4, 1): 4,
              ("mma", 2, 64): 2, ("mma", 4, 16): 4, ("mma", 4, 32): 4, ("mma", 4, 64): 2}
PIPE_FAMILIES = ("sm_80", "sm_90")


def depth(c: dict) -> int:
    """K steps of weights a config keeps in flight (1: the unpipelined kernels)."""
    return c.get("DEPTH", 1)


def pipelined(c: dict, kernel: str, bits: int) -> dict | None:
    """Launch config ``c`` (with its "BM") at the pipelined kernel's depth, or None where that
    width and row tile have no pipelined kernel."""
    d = PIPE_DEPTH.get((kernel, bits, c["BM"]))
    return None if d is None else dict(c, DEPTH=d)


def stages(kernel: str, bits: int, bm: int, bn: int, num_warps: int) -> int:
    if kernel != "mma" or (bits, bm, bn, num_warps) in MMA_SINGLE_STAGE:
        return 1
    return MMA_STAGES


# Split-K partials: only for one M tile, at most SPLITK_ROWS partial rows (SPLIT · BM) and at
# most SPLITK_MAX_N rows of weights (above that N/BN alone gives every SM programs), so the
# shared scratch never exceeds SPLITK_ROWS · SPLITK_MAX_N fp32 (8 MiB).
SPLITK_ROWS = MAX_SPLIT * 16
SPLITK_MAX_N = 16384
# Autotuning is per M bucket (next power of two of M, capped): batch 1 and batch 64 of one
# layer tune separately; every M above the cap shares the last bucket.
M_BUCKET_CAP = 256


def m_bucket(m: int) -> int:
    return min(_next_pow2(m), M_BUCKET_CAP)


def gemv_configs(bm: int | None = None, bits: int = 4) -> list[dict]:
    return [dict(BN=bn, SPLIT=sp, num_warps=nw, maxnreg=GEMV_MAXNREG[bits], num_stages=1) for b, tiles in GEMV_TILES.items()
            if bm in (None, b) for bn, nw in tiles for sp in GEMV_SPLITS]


def mma_configs(bm: int | None = None, bits: int = 4) -> list[dict]:
    return [dict(BN=bn, SPLIT=sp, BR=br, num_warps=nw, maxnreg=MMA_MAXNREG[bits],
                 num_stages=stages("mma", bits, b, bn, nw)) for b, tiles in MMA_TILES.items()
            if bm in (None, b) for bn, nw, br in tiles for sp in MMA_SPLITS[b]]



def pipelined_configs(kernel: str, bm: int | None = None, bits: int = 4) -> list[dict]:
    """The kernel's configs at its pipelined depth (``PIPE_DEPTH``; none at 3 bits)."""
    base = gemv_configs if kernel == "gemv" else mma_configs
    return [dict(c, DEPTH=PIPE_DEPTH[kernel, bits, b]) for b in (GEMV_TILES if kernel == "gemv" else MMA_TILES)
            if bm in (None, b) and (kernel, bits, b) in PIPE_DEPTH for c in base(b, bits)]


def configs_for(kernel: str, bm: int | None = None, bits: int = 4, pipelined: bool = False) -> list[dict]:
    """The unpipelined kernel's configs, and with ``pipelined`` the pipelined ones after them."""
    return (gemv_configs if kernel == "gemv" else mma_configs)(bm, bits) + (
        pipelined_configs(kernel, bm, bits) if pipelined else [])


def max_split(n_pad: int, ksteps: int) -> int:
    """Most K splits a layer may use: one per K step, none above ``SPLITK_MAX_N`` rows."""
    return max(1, ksteps) if n_pad <= SPLITK_MAX_N else 1


def candidates(kernel: str, bits: int, bm: int, n_pad: int, ksteps: int, can_split: bool,
               fam: str | None = None) -> list[dict]:
    """The configs a launch of this shape may take (the autotuner's pruning, and the table's
    and :func:`rule`'s choices): the row tile's tiles, SPLIT ≤ the K steps and SPLIT · BM ≤
    ``SPLITK_ROWS``, and SPLIT = 1 unless M is one tile that may split (``can_split``); the
    pipelined ones too, except on a family ``fam`` outside ``PIPE_FAMILIES``."""
    top = min(max_split(n_pad, ksteps), SPLITK_ROWS // bm) if can_split else 1
    return [c for c in configs_for(kernel, bm, bits, pipelined=fam in (None, *PIPE_FAMILIES)) if c["SPLIT"] <= top]


def preference(c: dict) -> tuple:
    """Order among equally good configs: unpipelined, the fewest K splits (partials written and
    re-read), then the widest row tile (activations re-read least), then the fewest warps."""
    return depth(c) > 1, c["SPLIT"], -c["BN"], c["num_warps"]


def rule(cands: list[dict], n_pad: int, m_tiles: int, sms: int) -> dict:
    """Deterministic choice for a shape the table lacks: of the candidates that give every SM
    two programs, the first by :func:`preference`; if none fills the GPU, the one with the
    most programs (fewest splits on a tie)."""
    def programs(c):
        return m_tiles * cdiv(n_pad, c["BN"]) * c["SPLIT"]

    cands = [c for c in cands if depth(c) == 1] or cands
    full = [c for c in cands if programs(c) >= 2 * sms]
    if full:
        return min(full, key=preference)
    return max(cands, key=lambda c: (programs(c), -c["SPLIT"], -c["num_warps"]))


def family(capability: tuple[int, int]) -> str:
    """The table's GPU family of a compute capability (newer parts use the newest family)."""
    major, minor = capability
    if major < 8:
        raise ValueError(f"latq Triton kernels need compute capability ≥ 8.0 (got {major}.{minor})")
    if major >= 9:
        return "sm_90"
    return {0: "sm_80", 9: "sm_89"}.get(minor, "sm_86")


def shape_class(kernel: str, bits: int, bm: int, n_pad: int, k_pad: int) -> str:
    def cls(v):
        return min(max(_next_pow2(v), CLASS_MIN), CLASS_MAX)
    return f"{kernel}/b{bits}/bm{bm}/n{cls(n_pad)}/k{cls(k_pad)}"


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())["families"]
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"latq launch-config table {path}: unreadable ({e}); expected {{'families': "
                         "{family: {shape class: config}}}") from e


@functools.lru_cache(maxsize=None)
def _table(override: str | None) -> dict:
    table = {f: dict(v) for f, v in _read(TABLE_FILE).items()}
    if override and checked_override_path() and Path(override).exists():
        for f, v in _read(Path(override)).items():
            table.setdefault(f, {}).update(v)
    return table


def table() -> dict:
    """The packaged table with the override file (``LATQ_LAUNCH_CONFIGS``) on top."""
    return _table(override_path())


def override_path() -> str | None:
    """The override table's file (``LATQ_LAUNCH_CONFIGS``), or None; asked per launch, so not stat'ed."""
    return env.path(ENV_TABLE)


def checked_override_path() -> str | None:
    """:func:`override_path`, refused unless a regular file or one autotuning is to write."""
    return env.regular_file(ENV_TABLE)


def autotune_enabled() -> bool:
    return env.flag(ENV_AUTOTUNE)


def _strip(c: dict) -> dict:
    return {k: v for k, v in c.items() if k not in ("maxnreg", "num_stages") and not (k == "DEPTH" and v == 1)}


def choose(kernel: str, bits: int, bm: int, n_pad: int, k_pad: int, ksteps: int, m_tiles: int,
           can_split: bool, capability: tuple[int, int], sms: int) -> dict:
    """The launch config of one launch: the table's entry when it is a candidate of the shape, else
    :func:`rule`'s; stages and register cap always the candidate's (what the compile checked).
    Remembered per shape and table: an eager forward asks once per layer."""
    return dict(_choose(kernel, bits, bm, n_pad, k_pad, ksteps, m_tiles, can_split, capability, sms,
                        override_path()))


@functools.lru_cache(maxsize=65536)
def _choose(kernel, bits, bm, n_pad, k_pad, ksteps, m_tiles, can_split, capability, sms, override) -> dict:
    fam = family(capability)
    cands = candidates(kernel, bits, bm, n_pad, ksteps, can_split, fam)
    entry = _table(override).get(fam, {}).get(shape_class(kernel, bits, bm, n_pad, k_pad))
    if entry is not None:
        for c in cands:
            if _strip(c) == _strip(entry):
                return c
    return rule(cands, n_pad, m_tiles, sms)


def route(bits: int, m: int, n_pad: int, k_pad: int, capability: tuple[int, int]) -> str:
    """The kernel for 1 ≤ M < 8 rows: the tensor-core kernel where the table's ``route`` entry
    of the shape class says a GPU timed it faster, else the GEMV."""
    return _route(bits, min(8, _next_pow2(m)), n_pad, k_pad, capability, override_path())


@functools.lru_cache(maxsize=4096)
def _route(bits, bm, n_pad, k_pad, capability, override) -> str:
    entry = _table(override).get(family(capability), {}).get(shape_class("route", bits, bm, n_pad, k_pad))
    return "mma" if entry is not None and entry.get("kernel") == "mma" else "gemv"


def record(capability: tuple[int, int], key: str, config: dict) -> None:
    """Write one autotuned choice into the override table (``LATQ_LAUNCH_CONFIGS``), which
    later processes read instead of tuning again."""
    path = override_path()
    if not path:
        return
    p = Path(path)
    data = json.loads(p.read_text()) if p.exists() else {"families": {}}
    data["families"].setdefault(family(capability), {})[key] = _strip(config) | {
        "num_stages": config.get("num_stages", 1)}
    p.write_text(json.dumps(data, indent=1, sort_keys=True))
    reload_table()


def reload_table() -> None:
    """Forget the tables read and the choices made from them (after the override file changed)."""
    _table.cache_clear()
    _choose.cache_clear()
    _route.cache_clear()


@functools.lru_cache(maxsize=None)
def _cuda_info(index: int) -> tuple[tuple[int, int], int]:
    return torch.cuda.get_device_capability(index), torch.cuda.get_device_properties(index).multi_processor_count


def device_info(device: torch.device) -> tuple[tuple[int, int], int]:
    """(compute capability, SMs) of ``device``; the interpreter's stand-in for a CPU tensor."""
    if device.type != "cuda":
        return INTERPRETER_DEVICE
    return _cuda_info(device.index if device.index is not None else torch.cuda.current_device())
