"""Speed proxies of one compiled Triton config, read from its compile without a GPU: the width
of its K loop's global loads (bytes per load instruction, from the SASS opcode's width
modifier: ``LDG.E.128`` is 16 bytes), the programs (CTAs) one SM holds at once (registers,
shared memory, warps) and the bytes of weights in flight per SM (prefetch depth × a K step's
tile bytes × resident CTAs): by Little's law a GPU streams at most that many bytes per SM per
memory latency. docs/KERNELS.md, "Speed proxies", says how they are read.
"""
from __future__ import annotations

# per target: shared memory one SM holds (bytes), most warps and CTAs an SM holds
SM_LIMITS = {80: dict(smem=167936, warps=64, ctas=32), 86: dict(smem=102400, warps=48, ctas=16),
             89: dict(smem=102400, warps=48, ctas=24), 90: dict(smem=233472, warps=64, ctas=32)}
REGS_PER_SM = 65536         # 4 sub-partitions of 16 K 32-bit registers
REG_UNIT = 256              # registers are allocated to a warp in units of 256
SMEM_RESERVED = 1024        # shared memory the driver reserves per CTA (sm_80+)
WIDTH_BYTES = {"128": 16, "64": 8, "U16": 2, "S16": 2, "U8": 1, "S8": 1}
GLOBAL_LOADS = ("LDG", "LDGSTS")


def load_width(modifiers: str) -> int:
    """Bytes one global load moves, from its modifiers (``.E.128`` → 16; none of the widths: 4)."""
    return next((WIDTH_BYTES[t] for t in modifiers.split(".") if t in WIDTH_BYTES), 4)


def resident_ctas(regs: int, num_warps: int, smem: int, cc: int) -> int:
    """CTAs one SM of target ``cc`` holds at once: the least of what its registers, shared memory,
    warp slots and CTA slots allow."""
    lim = SM_LIMITS[cc]
    warp_regs = -(-regs * 32 // REG_UNIT) * REG_UNIT
    by_regs = 4 * ((REGS_PER_SM // 4) // warp_regs) // num_warps
    by_smem = lim["smem"] // (smem + SMEM_RESERVED)
    return max(0, min(by_regs, by_smem, lim["warps"] // num_warps, lim["ctas"]))


def step_bytes(job: dict) -> int | None:
    """Bytes of weights one CTA of a GEMV, tensor-core or MoE job (pipelined or not) loads per K
    step: its BN rows' word tiles, their group scales (fp16, or 12 bytes per 16 coded) and, where
    the tensor-core kernel prefetches them with the word tiles, its ELL outlier slots (int16 column
    + fp16 value, the upper bound: every slot present). None for kernels without such a loop."""
    if job["kernel"] not in ("gemv", "mma", "moe", "gemv_pipe", "mma_pipe"):
        return None
    from vllm_latq.kernels.triton.layout import step_of
    cols, bn = step_of(job["bits"]), job["BN"]
    groups = -(-cols // 128)
    scales = bn * groups * 2 if job["scales"] == "fp16" else bn // 16 * groups * 12
    slots = 0
    if job["kernel"] in ("mma", "mma_pipe") and job["outl"] == "ell":
        slots = min(job["BR"], cols // 64) * bn * 4
    elif job["kernel"] == "gemv_pipe" and job["outl"] == "ell":
        slots = cols // 64 * bn * 4
    return bn * cols * job["bits"] // 8 + scales + slots


def prefetch_depth(job: dict, async_copies: bool) -> int:
    """K steps of weights a CTA has in flight: a pipelined kernel's ``DEPTH`` (register queue),
    else ``num_stages − 1`` where the K loop copies asynchronously (``LDGSTS``), else one step
    (the kernels' register prefetch)."""
    if "DEPTH" in job:
        return job["DEPTH"]
    return max(1, job.get("num_stages", 1) - 1) if async_copies else 1


def inflight_bytes(job: dict, ctas: int, async_copies: bool) -> int | None:
    """Bytes of weights in flight per SM: the prefetch depth × a step's tile bytes × resident CTAs."""
    tile = step_bytes(job)
    if tile is None:
        return None
    return prefetch_depth(job, async_copies) * tile * ctas


def proxies(job: dict, loop_loads: dict, loop_ops: dict, regs: int, smem: int) -> dict:
    """The record's proxy fields of one compiled job: ``ldg_width`` (mean bytes per global load of
    a K step), ``ldg_min`` (the narrowest), ``ctas_sm`` and ``inflight_sm``."""
    widths = {int(w): n for w, n in loop_loads.items()}
    loads = sum(widths.values())
    ctas = resident_ctas(regs, job["num_warps"], smem, job["cc"])
    return dict(ldg_width=round(sum(w * n for w, n in widths.items()) / loads, 2) if loads else None,
                ldg_min=min(widths) if widths else None, ctas_sm=ctas,
                inflight_sm=inflight_bytes(job, ctas, loop_ops.get("LDGSTS", 0) > 0))
