"""vLLM's real layers with latq's quant method, across the CUDA boundary (:mod:`.cuda_boundary`):
``QKVParallelLinear``, ``MergedColumnParallelLinear``, ``RowParallelLinear`` (its K cut off the
groups at TP 2), ``ColumnParallelLinear`` and a mixture-of-experts layer are built by vLLM's own
constructors, loaded from latq checkpoint tensors through their ``weight_loader``s as vLLM's model
loader calls them, processed (``process_weights_after_loading``) and applied on CPU, with the
platform stubbed as a CUDA GPU of each capability and vLLM's CUDA ops as CPU stand-ins. Each output
is compared with the same vLLM layer unquantized (fp32) holding latq's dequantized weights
(``kernels.weight.dequantize``, the reference's math): vLLM's own TP cut and reduction, latq's
numbers.

One process per rank (:func:`run_ranks`: gloo, vLLM's distributed state is per process); each
runs every case asked and writes one JSON record per case.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import subprocess
import sys
import traceback
from dataclasses import dataclass

import torch

from .. import format as fmt
from ..algorithms.result import QuantResult

PREFIX = "model.layers.0"
HIDDEN, HEAD, HEADS, KV_HEADS, INTER, DOWN_K, COL_N = 256, 64, 4, 2, 256, 576, 384
E, TOPK, MOE_INTER = 4, 2, 128
GROUP = 128            # the checkpoints' group: 576 = 4.5 groups, so down_proj's rows are cut off them
CCS = (80, 86, 89, 90)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
ULP = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -24}   # unit roundoff


@dataclass(frozen=True)
class Case:
    layer: str            # a key of LAYERS, or "moe"
    dtype: str            # a key of DTYPES
    cc: int
    bias: bool = False
    bits: int = 4
    env: tuple = ()       # (name, value) pairs set for the case (e.g. LATQ_KERNEL)

    @property
    def id(self) -> str:
        env = "".join(f"-{k}={v}" for k, v in self.env)
        return f"{self.layer}-{self.bits}bit-{self.dtype}-sm{self.cc}-{'bias' if self.bias else 'nobias'}{env}"


def quant_config(bits: int, group: int = GROUP):
    from ..plugin.config import LatqConfig
    return LatqConfig.from_config({"quant_method": "latq", "format_version": 1, "method": "rtn", "bits": bits,
                                   "group_size": group, "modules_not_converted": []})


def checkpoint_tensors(rows: int, cin: int, bits: int, seed: int, group: int = GROUP) -> dict[str, torch.Tensor]:
    """One latq layer's checkpoint tensors (dense kind, no outliers): uniform ``bits``-bit integers,
    fp16 group scales — what ``format.encode_layer`` writes for a solver's result."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randint(-2 ** (bits - 1), 2 ** (bits - 1), (rows, cin), generator=g, dtype=torch.int32)
    scales = (torch.rand(rows, -(-cin // group), generator=g) * 0.02 + 0.002).half().float()
    return fmt.encode_layer(QuantResult("rtn", z, None, scales, group, bits, float(bits)), "dense")


def dequantized(t: dict[str, torch.Tensor], rows: int, cin: int, bits: int, group: int = GROUP) -> torch.Tensor:
    return fmt.dequantize_layer(t, "dense", (rows, cin), bits, group)


# name → (constructor, its arguments, [(checkpoint module, shard id, rows)], input size)
def _layers():
    from vllm.model_executor.layers import linear as L
    q, kv = HEADS * HEAD, KV_HEADS * HEAD
    return {
        "qkv": (L.QKVParallelLinear, dict(hidden_size=HIDDEN, head_size=HEAD, total_num_heads=HEADS,
                                          total_num_kv_heads=KV_HEADS),
                [("self_attn.q_proj", "q", q), ("self_attn.k_proj", "k", kv), ("self_attn.v_proj", "v", kv)],
                HIDDEN, "self_attn.qkv_proj"),
        "gate_up": (L.MergedColumnParallelLinear, dict(input_size=HIDDEN, output_sizes=[INTER, INTER]),
                    [("mlp.gate_proj", 0, INTER), ("mlp.up_proj", 1, INTER)], HIDDEN, "mlp.gate_up_proj"),
        "down": (L.RowParallelLinear, dict(input_size=DOWN_K, output_size=HIDDEN, input_is_parallel=False),
                 [("mlp.down_proj", None, HIDDEN)], DOWN_K, "mlp.down_proj"),
        "column": (L.ColumnParallelLinear, dict(input_size=HIDDEN, output_size=COL_N), [("mlp.col", None, COL_N)],
                   HIDDEN, "mlp.col"),
    }


def _load(layer, parts: dict, suffixes=None) -> None:
    """Every tensor through its parameter's ``weight_loader``, with the shard id vLLM's model
    loader gives a fused layer's parts (none for a plain one)."""
    for shard, tensors in parts.items():
        for name, t in tensors.items():
            if suffixes is not None and name not in suffixes:
                continue
            p = getattr(layer, name)
            loader = getattr(p, "weight_loader")
            loader(p, t) if shard is None else loader(p, t, shard)


def _build(name: str, case: Case, quant, dtype: torch.dtype):
    cls, kw, parts, cin, leaf = _layers()[name]
    return cls(**kw, bias=case.bias, quant_config=quant, params_dtype=dtype, prefix=f"{PREFIX}.{leaf}")


def _reference(case: Case, deq: dict, bias: dict):
    """The same vLLM layer unquantized, fp32, holding ``deq`` (and ``bias`` where given)."""
    ref = _build(case.layer, Case(case.layer, case.dtype, case.cc, bool(bias)), None, torch.float32)
    _load(ref, deq)
    if bias:
        _load(ref, {s: {"bias": b.float()} for s, b in bias.items()})
    return ref


def dense_case(case: Case, rank: int) -> dict:
    """One linear: latq's layer and vLLM's unquantized one (the reference), same inputs."""
    cls, kw, parts, cin, leaf = _layers()[case.layer]
    dtype = DTYPES[case.dtype]
    ckpt, deq, bias = {}, {}, {}
    for i, (module, shard, rows) in enumerate(parts):
        ckpt[shard] = checkpoint_tensors(rows, cin, case.bits, seed=10 * i + case.bits)
        deq[shard] = {"weight": dequantized(ckpt[shard], rows, cin, case.bits)}
        g = torch.Generator().manual_seed(100 + i)
        if case.bias:
            bias[shard] = (torch.randn(rows, generator=g) * 4).to(dtype)
    quant = quant_config(case.bits)
    layer = _build(case.layer, case, quant, dtype)
    _load(layer, ckpt)
    if case.bias:
        _load(layer, {s: {"bias": b} for s, b in bias.items()})
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(5, cin, generator=torch.Generator().manual_seed(7)).to(dtype)
    y = layer(x)[0]
    ref = _reference(case, deq, bias)
    absolute = _reference(case, {s: {"weight": w["weight"].abs()} for s, w in deq.items()}, {})
    want, bias_out = ref(x.float())[0], ref(torch.zeros(1, cin))[0]      # the bias as this rank's output has it
    scale = absolute(x.float().abs())[0] + bias_out.abs()                # |x|·|W|ᵀ + |b|
    return _compare(y, want, dtype, scale, quant.load_report.layers[-1].kernel)


def _compare(y: torch.Tensor, want: torch.Tensor, dtype, scale: torch.Tensor, kernel: str) -> dict:
    """Within the kernel's rounding: weights rounded once to the activation type (≤ u·|x|·|W|ᵀ),
    the output once more (≤ u·|y|), fp32 sums; ``scale`` = |x|·|W|ᵀ + |b| bounds both."""
    err = (y.float() - want).abs()
    bound = 3 * ULP[dtype] * scale + 1e-6
    worst = float((err / bound).max())
    return {"kernel": kernel, "ok": worst <= 1.0 and y.dtype == dtype and y.shape == want.shape,
            "worst": worst, "max_err": float(err.max()), "dtype": str(y.dtype)}


_PROCESS = contextlib.ExitStack()     # what a rank process holds until it exits


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_ranks(world: int, rank: int, port: int) -> None:
    """vLLM's distributed state for one rank of a TP group of ``world`` (gloo)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    _PROCESS.enter_context(set_current_vllm_config(VllmConfig()))   # the process's config, as a worker holds one
    init_distributed_environment(world_size=world, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                 local_rank=rank, backend="gloo")
    initialize_model_parallel(world)


def run_case(case: Case, rank: int) -> dict:
    from .cuda_boundary import cuda_boundary
    saved = {k: os.environ.get(k) for k, _ in case.env}
    os.environ.update(dict(case.env))
    try:
        with cuda_boundary(case.cc):
            if case.layer == "moe":
                from .boundary_moe import moe_case
                out = moe_case(case, rank)
            else:
                out = dense_case(case, rank)
    except Exception as e:   # a case's failure is its record, the next case runs
        out = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return {"case": case.id, **out}


WORKER_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1", "TORCH_COMPILE_DISABLE": "1",
              "VLLM_HOST_IP": "127.0.0.1", "VLLM_LOGGING_LEVEL": "WARNING", "TRITON_INTERPRET": "1",
              "TOKENIZERS_PARALLELISM": "false"}


def run_ranks(world: int, cases: list[Case], timeout: float = 300) -> dict[str, list[dict]]:
    """Every case on each of ``world`` rank processes → case id → its records, rank by rank."""
    import tempfile
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        spec = os.path.join(tmp, "cases.json")
        with open(spec, "w") as f:
            json.dump([vars(c) for c in cases], f)
        env = {**os.environ, **WORKER_ENV}
        procs = [subprocess.Popen([sys.executable, "-m", __name__, str(world), str(r), str(port), spec,
                                   os.path.join(tmp, f"rank{r}.json")], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for r in range(world)]
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
        out: dict[str, list[dict]] = {}
        for r, p in enumerate(procs):
            path = os.path.join(tmp, f"rank{r}.json")
            if p.returncode or not os.path.exists(path):
                raise RuntimeError(f"rank {r} of {world} exited {p.returncode}:\n{logs[r][-4000:]}")
            for rec in json.load(open(path)):
                out.setdefault(rec["case"], []).append(rec)
    return out


def main(argv: list[str]) -> None:
    world, rank, port, spec, dest = int(argv[0]), int(argv[1]), int(argv[2]), argv[3], argv[4]
    init_ranks(world, rank, port)
    cases = [Case(**{**c, "env": tuple(map(tuple, c["env"]))}) for c in json.load(open(spec))]
    records = [run_case(c, rank) for c in cases]
    with open(dest, "w") as f:
        json.dump(records, f)


if __name__ == "__main__":
    main(sys.argv[1:])
