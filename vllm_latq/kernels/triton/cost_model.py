"""The Triton kernels' cost model: what the tensor-core kernel and dequantise-once + cuBLAS are
predicted to cost against bf16 ``F.linear``, and where it puts their crossover — pure functions of
the layer's shape and a :class:`DeviceModel` read from the device's properties. Serving does not
route by it: its threshold ``dequant.MMA_MAX_M`` is measured.
Formulas and sources: docs/KERNELS.md."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .layout import scale_bytes

# tensor-core kernel row tiles (triton_kernels.MMA_TILES is keyed by these)
MMA_BMS = (16, 32, 64)


def mma_bm(m: int) -> int:
    """Activation rows per tensor-core program: the smallest tile ≥ M, else the largest
    (128-row tiles spill on sm_80 and sm_90: docs/KERNELS.md)."""
    return next((bm for bm in MMA_BMS if bm >= m), MMA_BMS[-1])


@dataclass(frozen=True)
class DeviceModel:
    name: str
    hbm_bw: float          # bytes/s
    l2_bytes: int
    tc_flops: float        # fp16/bf16 tensor-core FLOP/s without 2:4 sparsity, the datasheet peak
    issue: float           # SASS lane-instructions/s (SMs × 4 schedulers × 32 lanes × clock)
    sms: int
    tc_eff: float = 1.0    # η: the achievable fraction of tc_flops (docs/KERNELS.md)

    @property
    def tc_achievable(self) -> float:
        return self.tc_flops * self.tc_eff


# η: MAMF / peak, bf16 (docs/KERNELS.md): A100 SXM 271.2 / 312, H100 SXM 794.5 / 989
A100_TC_EFF = 271.2 / 312
H100_TC_EFF = 794.5 / 989
DEVICES = {
    "a100": DeviceModel("A100", 2.0e12, 40 * 2**20, 312e12, 108 * 128 * 1.41e9, 108, A100_TC_EFF),
    "h100": DeviceModel("H100", 3.35e12, 50 * 2**20, 990e12, 132 * 128 * 1.98e9, 132, H100_TC_EFF),
    "h200": DeviceModel("H200", 4.8e12, 60 * 2**20, 990e12, 132 * 128 * 1.98e9, 132, H100_TC_EFF),
}
# MMA kernel K loop: SASS lane-instructions per weight per program of BM rows (triton_compile
# "i/w", median over the tile configs of that BM, sm_80; docs/KERNELS.md)
MMA_IPW = {(2, 16): 5.00, (3, 16): 8.50, (4, 16): 5.12, (5, 16): 8.12,
           (2, 32): 6.20, (3, 32): 10.22, (4, 32): 6.41, (5, 32): 9.69,
           (2, 64): 8.70, (3, 64): 13.22, (4, 64): 8.47, (5, 64): 11.78}
MMA_IPW_CODED = {(2, 16): 5.53, (3, 16): 9.52, (4, 16): 5.63, (5, 16): 8.65,   # the same, coded scales
                 (2, 32): 6.78, (3, 32): 11.22, (4, 32): 7.41, (5, 32): 10.72,
                 (2, 64): 10.30, (3, 64): 16.44, (4, 64): 9.56, (5, 64): 12.84}
NEVER = 2**31 - 1          # threshold when the MMA kernel wins for every M searched
M_SEARCH = 1 << 16


def hbm_bandwidth(props) -> float | None:
    """Peak DRAM bandwidth (bytes/s) from device properties: 2 × memory clock (kHz) × bus
    width (bits) / 8; None when torch does not report them."""
    clock_khz = getattr(props, "memory_clock_rate", 0) or 0
    bus_bits = getattr(props, "memory_bus_width", 0) or 0
    return 2 * clock_khz * 1e3 * bus_bits / 8 if clock_khz and bus_bits else None


def device_model(device_props=None) -> DeviceModel:
    """``device_props``: None (A100 defaults), a :class:`DeviceModel`, a key of ``DEVICES``,
    or ``torch.cuda.get_device_properties(...)`` — the family's model (A100 for sm_8x, H100
    for sm_9x+) with that part's HBM bandwidth, SM count, SM clock and L2 size."""
    if device_props is None:
        return DEVICES["a100"]
    if isinstance(device_props, DeviceModel):
        return device_props
    if isinstance(device_props, str):
        return DEVICES[device_props.lower()]
    base = DEVICES["h100" if device_props.major >= 9 else "a100"]
    sms = device_props.multi_processor_count
    clock_khz = getattr(device_props, "clock_rate", 0) or 0
    issue = sms * 128 * clock_khz * 1e3 if clock_khz else base.issue * sms / base.sms
    l2 = getattr(device_props, "L2_cache_size", 0) or base.l2_bytes
    return DeviceModel(device_props.name, hbm_bandwidth(device_props) or base.hbm_bw, l2,
                       base.tc_flops * sms / base.sms, issue, sms, base.tc_eff)


def packed_bytes(n: int, k: int, bits: int, nnz: int, group: int = 128, coded: bool = False) -> int:
    """Bytes the kernels stream for one layer: b-bit inliers, scales (fp16, or coded: 12 bytes
    per 16, ``triton_layout.scale_bytes``), 4-byte outliers."""
    return n * k * bits // 8 + scale_bytes(16 * math.ceil(n / 16), math.ceil(k / group), coded) + 4 * nnz


def model_times(m: int, n: int, k: int, bits: int, nnz: int, dtype: torch.dtype = torch.bfloat16,
                device_props=None, group: int = 128, coded: bool = False) -> dict[str, float]:
    """Seconds for one layer at M rows: ``mma``, ``deq`` (dequantise once + GEMM) and
    ``unquantized`` (``F.linear`` of the unquantised weight); ``coded``: the scales are codes (docs/KERNELS.md)."""
    d = device_model(device_props)
    e = dtype.itemsize
    wq = packed_bytes(n, k, bits, nnz, group, coded)
    w16, act = e * n * k, e * m * (k + n)
    bm = mma_bm(m)
    t = math.ceil(m / bm)
    issue = t * (n * k * (MMA_IPW_CODED if coded else MMA_IPW)[bits, bm] + (1 + bm) * nnz) / d.issue
    unquantized = max((w16 + act) / d.hbm_bw, 2 * m * n * k / d.tc_achievable)
    return {"mma": max((wq + act) / d.hbm_bw, issue + 2 * bm * t * n * k / d.tc_achievable),
            "deq": (wq + w16) / d.hbm_bw + unquantized, "unquantized": unquantized}


def large_m_threshold(n: int, k: int, bits: int, nnz: int, dtype: torch.dtype = torch.bfloat16,
                      device_props=None, group: int = 128, coded: bool = False) -> int:
    """Smallest M ≥ 17 from which on dequantise-once + GEMM is predicted faster than the MMA
    kernel for every larger M (``NEVER`` if it loses at M = 65536)."""
    ends = sorted({mma_bm(m) * math.ceil(m / mma_bm(m)) for m in range(17, M_SEARCH + 1, 16)}, reverse=True)
    for i, m in enumerate(ends):
        times = model_times(m, n, k, bits, nnz, dtype, device_props, group, coded)
        if times["deq"] >= times["mma"]:
            return NEVER if i == 0 else m + 1
    return 17


# ----------------------------------------------------------------------------- one launch

@dataclass(frozen=True)
class LaunchFit:
    """Constants of :func:`launch_time` fitted on a GPU's timings (``tools/cost_fit.py``)."""
    gemv_latency_ns: float   # a GEMV K step's exposed latency with one step of weights in flight
    mma_latency_ns: float    # the same for the tensor-core kernel (its in-step gathers included)
    issue_overlap: float     # the share of a step's instruction issue not hidden behind its latency
    chain_us: float          # a program's fixed chain (its first loads, the epilogue)
    split_us: float          # the split-K reduction's added chain (partials, ticket, sum)


# fitted on sm_90 (H100 and H200) timings of the GEMV and the tensor-core kernel, 4-bit 1 % outliers
# (python -m tools.cost_fit --fit; its fit error and what it does not explain: docs/KERNELS.md)
SM90_FIT = LaunchFit(gemv_latency_ns=491.6033, mma_latency_ns=1092.5996, issue_overlap=0.9944, chain_us=2.7634,
                     split_us=2.5372)


def launch_time(d: DeviceModel, fit: LaunchFit, *, kernel: str, n: int, m: int, bm: int, bn: int, split: int,
                steps: int, step_weights: int, ipw: float, ctas_sm: int, step_bytes: int, bw_eff: float,
                depth: int = 1) -> float:
    """Seconds of one launch: waves of programs of ``steps`` K steps and a fixed chain; a step waits
    its latency over ``depth`` or its share of the HBM rate, plus its unhidden SASS issue (as
    1 / depth: an assumption, the fit saw depth 1 only; docs/KERNELS.md)."""
    n_pad = -(-n // 16) * 16
    programs = -(-m // bm) * -(-n_pad // bn) * split
    ctas = max(1, ctas_sm)
    resident = min(ctas, -(-programs // d.sms))
    latency = (fit.gemv_latency_ns if kernel == "gemv" else fit.mma_latency_ns) * 1e-9
    memory = max(latency / depth, resident * step_bytes * d.sms / (bw_eff * d.hbm_bw))
    issue = resident * step_weights * ipw / (d.issue / d.sms)
    program = steps * (memory + fit.issue_overlap / depth * issue) + (fit.chain_us + (fit.split_us if split > 1 else 0)) * 1e-6
    return math.ceil(programs / (d.sms * ctas)) * program
