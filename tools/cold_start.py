"""Cold start offline: how many distinct Triton kernel variants (compile keys) vLLM's default
CUDA-graph capture sizes instantiate for an 8B dense model's projections, and what compiling
them costs on this CPU.

Every launch is planned by the serving code itself (``TritonKernel.apply`` with the kernels
recorded instead of run, on meta tensors of the real shapes, the device family stubbed): the
path (SIMT / tensor cores / dequantise + cuBLAS), the table's config, and the arguments whose
values Triton specialises on (an int's ``== 1`` and ``% 16``, pointer alignment). ``--compile
N`` compiles N of the distinct (kernel, tile, constexpr) jobs with :mod:`tools.triton_compile`
(no cache) and scales the mean time to all variants.

    python -m tools.cold_start [--bits 4] [--outliers ell] [--family sm_80] [--compile 4]
"""
from __future__ import annotations

import argparse
import time
from unittest import mock

import torch

from vllm_latq.kernels.triton import configs as cfg
from vllm_latq.kernels.triton import dequant as td
from vllm_latq.kernels.triton import kernel as tk
from vllm_latq.kernels.triton import layout as tlay
from vllm_latq.testing.capture import compile_key

# vLLM's default capture sizes (CompilationConfig: 1, 2, 4, 8..248 by 8, 256..512 by 16)
CAPTURE_SIZES = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, 513, 16))
MODEL_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
FAMILY_CC = {"sm_80": (8, 0), "sm_86": (8, 6), "sm_89": (8, 9), "sm_90": (9, 0)}


def meta_state(n: int, k: int, bits: int, outliers: str, group: int = 128) -> tk.TritonState:
    """A prepared layer's shapes without its data (meta tensors)."""
    n_pad = -(-n // tlay.ROWS) * tlay.ROWS
    k_pad = tlay.pad_k(k, bits)
    meta = torch.device("meta")
    planes = [torch.empty(n_pad * pb * cols // 32, dtype=torch.int32, device=meta)
              for pb, cols in tlay.plane_columns(bits, k_pad)]
    planes += [None] * (3 - len(planes))
    scales = torch.empty(n_pad // 16, -(-k_pad // group), 16, dtype=torch.float16, device=meta)
    if outliers == "ell":
        arrays = [torch.empty(n_pad // 16 + 1, dtype=torch.int32, device=meta), None,
                  torch.empty(n_pad, dtype=torch.int16, device=meta), torch.empty(n_pad, dtype=torch.float16, device=meta)]
    else:
        arrays = [None] * 4
    tickets = torch.empty(n_pad // 16, dtype=torch.int32, device=meta)
    return tk.TritonState(*planes, scales, *arrays, tickets, bits, group, tk.spg_of(bits, group), n, k, n_pad, k_pad,
                          tk.OUTL_CODE[outliers], n_pad if outliers == "ell" else 0)


def variants(bits: int, outliers: str, family: str) -> dict:
    """{compile key: (kernel name, constexpr keywords)} over the capture sizes and the shapes."""
    seen: dict = {}

    class Record:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.setdefault(compile_key(self.name, args, kw), (self.name, kw))
            return launch

    sms = cfg.FAMILY_SMS[family]
    with mock.patch.dict(tk._KERNELS, {"gemv": Record("gemv"), "mma": Record("mma")}), \
            mock.patch.object(td, "_dequant_kernel", Record("dequant")), \
            mock.patch.object(td, "_outlier_kernel", Record("outliers")), \
            mock.patch.object(cfg, "INTERPRETER_DEVICE", (FAMILY_CC[family], sms)), \
            mock.patch.object(tk.TritonKernel, "workspace", td.Workspace(max_bytes=td.DEFAULT_MAX_BYTES)):
        for n, k in MODEL_8B.values():
            st = meta_state(n, k, bits, outliers)
            for m in CAPTURE_SIZES:
                x = torch.empty(m, k, dtype=torch.bfloat16, device="meta")
                tk.TritonKernel.apply(st, x)
    return seen


def compile_seconds(found: dict, bits: int, outliers: str, family: str, sample: int) -> float:
    """Mean offline compile seconds of up to ``sample`` distinct tensor-core / SIMT jobs."""
    from tools import triton_compile as tc
    jobs = []
    for name, kw in found.values():
        if name not in ("gemv", "mma"):
            continue
        j = dict(kernel=name, bits=bits, BM=kw["BM"], SPLIT=kw["SPLIT"], outl=outliers, scales="fp16",
                 cc=int(family[3:]), BN=kw["BN"], num_warps=kw["num_warps"], maxnreg=kw.get("maxnreg"),
                 **({"BR": kw["BR"]} if name == "mma" else {}))
        if j not in jobs:
            jobs.append(j)
    jobs = jobs[:sample]
    if not jobs:
        return 0.0
    t0 = time.perf_counter()
    tc.run(jobs, workers=1, cache=False)
    return (time.perf_counter() - t0) / len(jobs)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--outliers", choices=("none", "ell"), default="ell")
    ap.add_argument("--family", choices=tuple(FAMILY_CC), default="sm_80")
    ap.add_argument("--compile", type=int, default=0, metavar="N", help="compile N distinct jobs to time them")
    a = ap.parse_args(argv)
    found = variants(a.bits, a.outliers, a.family)
    by_kernel: dict[str, int] = {}
    for name, kw in found.values():
        by_kernel[name] = by_kernel.get(name, 0) + 1
    for key, (name, kw) in sorted(found.items(), key=lambda t: (t[1][0], repr(t[1][1]))):
        print(name, {k: v for k, v in kw.items() if k not in ("ASM",)})
    line = (f"HEADLINE variants={len(found)} " + " ".join(f"{k}={v}" for k, v in sorted(by_kernel.items()))
            + f" bits={a.bits} outliers={a.outliers} family={a.family} sizes={len(CAPTURE_SIZES)}")
    if a.compile:
        per = compile_seconds(found, a.bits, a.outliers, a.family, a.compile)
        line += f" compile_s_per_variant={per:.1f} compile_s_total_est={per * len(found):.0f}"
    print(line)


if __name__ == "__main__":
    main()
