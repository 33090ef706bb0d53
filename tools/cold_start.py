"""Cold start offline: one rank's first ``vllm serve`` of an 8B dense model's projections, in
vLLM's start-up order — load, the profile run, the CUDA-graph memory profile, the warm-ups and
captures of the default capture sizes —: the distinct Triton kernel variants (compile keys) it
instantiates, what compiling them costs on this CPU, and the latq scratch bytes held after
each phase (all of them must be allocated at load, before vLLM sizes the KV cache).

Every launch is planned by the serving code itself (``TritonKernel.apply`` with the kernels
recorded instead of run, on meta tensors of the real shapes, the device family and the CUDA
streams stubbed): the path (SIMT / tensor cores / dequantise + cuBLAS), the table's config, and
the arguments whose values Triton specialises on (an int's ``== 1`` and ``% 16``, pointer
alignment; not those a kernel marks ``do_not_specialize``). ``--compile N`` compiles N of the
distinct (kernel, tile, constexpr) jobs with :mod:`tools.triton_compile` (no cache) and scales
the mean time to all variants.

    python -m tools.cold_start [--bits 4] [--outliers ell] [--family sm_80] [--tp 2] [--aux] [--compile 4]
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from unittest import mock

import torch

from vllm_latq.kernels import graphs
from vllm_latq.kernels.triton import configs as cfg
from vllm_latq.kernels.triton import dequant as td
from vllm_latq.kernels.triton import kernel as tk
from vllm_latq.kernels.triton import layout as tlay
from vllm_latq.testing.capture import compile_key, unspecialized

# vLLM's default capture sizes (CompilationConfig: 1, 2, 4, 8..248 by 8, 256..512 by 16)
CAPTURE_SIZES = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, 513, 16))
PROFILE_TOKENS = 8192      # vLLM's memory-profiling forward: max_num_batched_tokens rows
SERVE_SIZES = CAPTURE_SIZES + [PROFILE_TOKENS]
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


def rank_shapes(shapes: dict, tp: int) -> dict:
    """One tensor-parallel rank's share: column-parallel layers (qkv, gate_up) split N, row-parallel
    ones (o, down) split K."""
    return {name: ((n // tp, k) if name in ("qkv", "gate_up") else (n, k // tp)) for name, (n, k) in shapes.items()}


@dataclass
class ServeStart:
    """What one rank's first ``vllm serve`` does with latq's Triton kernels: the variants it
    compiles ({compile key: (kernel, constexpr keywords)}) and the scratch bytes held after each
    phase (load, vLLM's profile run, its CUDA-graph memory profile, the captures)."""
    variants: dict = field(default_factory=dict)
    scratch: dict = field(default_factory=dict)


DEFAULT_STREAM, PROFILER_STREAM, CAPTURE_STREAM, AUX_STREAM = 1, 2, 3, 9


def serve_start(bits: int, outliers: str, family: str, tp: int = 1, shapes: dict | None = None,
                sizes: list[int] | None = None, aux: bool = False, act_dtype=torch.bfloat16) -> ServeStart:
    """Replays vLLM's start-up order on meta tensors of one rank's layers (``shapes``: the 8B
    model's): load (every layer reserves its scratch), the profile run (``PROFILE_TOKENS`` rows,
    default stream), the CUDA-graph memory profile (two capture sizes on a stream of its own),
    the warm-ups and captures of ``sizes`` (vLLM's capture sizes) on the capture stream, and with
    ``aux`` the MoE shared-experts stream running every capture size up to 256 concurrently."""
    out = ServeStart()
    current = [DEFAULT_STREAM]

    class Record:
        def __init__(self, name, fn):
            self.name, self.skip = name, unspecialized(fn)

        def __getitem__(self, grid):
            def launch(*args, **kw):
                out.variants.setdefault(compile_key(self.name, args, kw, self.skip), (self.name, kw))
            return launch

    class Stream:
        stream_id = AUX_STREAM

    sizes = sizes or CAPTURE_SIZES
    states = [meta_state(n, k, bits, outliers) for n, k in rank_shapes(shapes or MODEL_8B, tp).values()]
    kern, ws, splitk = tk.TritonKernel, td.Workspace(max_bytes=td.DEFAULT_MAX_BYTES), td.Workspace()

    def run(stream: int, ms) -> None:
        current[0] = stream
        for st in states:
            for m in ms:
                kern.apply(st, torch.empty(m, st.k, dtype=act_dtype, device="meta"))

    with mock.patch.dict(tk._KERNELS, {k: Record(k, tk._KERNELS[k]) for k in ("gemv", "mma")}), \
            mock.patch.dict(tk._PIPELINED, {k: Record(f"{k}_pipe", tk._PIPELINED[k]) for k in ("gemv", "mma")}), \
            mock.patch.object(td, "_dequant_kernel", Record("dequant", td._dequant_kernel)), \
            mock.patch.object(td, "_outlier_kernel", Record("outliers", td._outlier_kernel)), \
            mock.patch.object(cfg, "INTERPRETER_DEVICE", (FAMILY_CC[family], cfg.FAMILY_SMS[family])), \
            mock.patch.object(td, "stream_key", lambda device: current[0]), \
            mock.patch.object(graphs, "concurrent_streams", lambda: [Stream()] if aux else []), \
            mock.patch.object(kern, "workspace", ws), mock.patch.object(kern, "splitk_workspace", splitk):
        for st in states:
            kern.reserve(st, act_dtype)
        out.scratch["load"] = ws.nbytes() + splitk.nbytes()
        run(DEFAULT_STREAM, [PROFILE_TOKENS])
        out.scratch["profile"] = ws.nbytes() + splitk.nbytes()
        run(PROFILER_STREAM, sorted(sizes)[-2:])
        out.scratch["graph_profile"] = ws.nbytes() + splitk.nbytes()
        run(CAPTURE_STREAM, sorted(sizes, reverse=True))
        if aux:
            run(AUX_STREAM, [m for m in sizes if m <= 256])
        out.scratch["captured"] = ws.nbytes() + splitk.nbytes()
    return out


def variants(bits: int, outliers: str, family: str, tp: int = 1, shapes: dict | None = None) -> dict:
    """{compile key: (kernel name, constexpr keywords)} one rank's first serve compiles."""
    return serve_start(bits, outliers, family, tp, shapes).variants


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
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size: one rank's shares of the shapes")
    ap.add_argument("--aux", action="store_true", help="a MoE shared-experts stream runs layers concurrently")
    ap.add_argument("--compile", type=int, default=0, metavar="N", help="compile N distinct jobs to time them")
    a = ap.parse_args(argv)
    run = serve_start(a.bits, a.outliers, a.family, a.tp, aux=a.aux)
    found = run.variants
    by_kernel: dict[str, int] = {}
    for name, kw in found.values():
        by_kernel[name] = by_kernel.get(name, 0) + 1
    for key, (name, kw) in sorted(found.items(), key=lambda t: (t[1][0], repr(t[1][1]))):
        print(name, {k: v for k, v in kw.items() if k not in ("ASM",)})
    line = (f"HEADLINE variants={len(found)} " + " ".join(f"{k}={v}" for k, v in sorted(by_kernel.items()))
            + f" bits={a.bits} outliers={a.outliers} family={a.family} tp={a.tp} sizes={len(CAPTURE_SIZES)} "
            + " ".join(f"scratch_mib_{k}={v / 2**20:.0f}" for k, v in run.scratch.items()))
    if a.compile:
        per = compile_seconds(found, a.bits, a.outliers, a.family, a.compile)
        line += f" compile_s_per_variant={per:.1f} compile_s_total_est={per * len(found):.0f}"
    print(line)


if __name__ == "__main__":
    main()
