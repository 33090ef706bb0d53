"""The CUDA-boundary cases, one process per rank (gloo, TP 1 or 2), each run under
:func:`~.cuda_boundary.cuda_boundary` or the host platform, one JSON record per case;
:func:`run_ranks` starts the ranks and collects the records."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback

import torch

from .boundary_layers import Case, dense_case, placement_case

_PROCESS = contextlib.ExitStack()     # what a rank process holds until it exits


def free_port() -> int:
    """A TCP port free on the loopback now (gloo's rendezvous)."""
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
    from vllm.v1.worker.workspace import init_workspace_manager
    init_workspace_manager(torch.device("cpu"))      # the MoE kernels' scratch, as a model runner sets it up


def run_case(case: Case) -> dict:
    """One case under the CUDA boundary of its capability (the host's platform for ``cc`` 0) with
    its environment: its record, or its failure as one."""
    from .cuda_boundary import cuda_boundary
    t0 = time.perf_counter()
    saved = {k: os.environ.get(k) for k, _ in case.env}
    os.environ.update(dict(case.env))
    try:
        with cuda_boundary(case.cc) if case.cc else contextlib.nullcontext():
            if case.layer.startswith("moe"):
                from .boundary_moe import moe_case
                out = moe_case(case)
            elif case.layer.startswith("export"):
                from .boundary_export import export_case
                out = export_case(case)
            else:
                out = (placement_case if case.layer == "placement" else dense_case)(case)
    except Exception as e:   # a case's failure is its record, the next case runs
        out = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return {"case": case.id, "seconds": round(time.perf_counter() - t0, 3), **out}


WORKER_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1", "TORCH_COMPILE_DISABLE": "1",
              "VLLM_HOST_IP": "127.0.0.1", "VLLM_LOGGING_LEVEL": "WARNING", "TRITON_INTERPRET": "1",
              "TOKENIZERS_PARALLELISM": "false"}


def run_ranks(plan: dict[int, list[Case]], timeout: float = 600) -> dict[int, dict[str, list[dict]]]:
    """``plan``'s cases on each rank of a TP group of each size it names, all groups at once →
    world → case id → its records, rank by rank."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, **WORKER_ENV}
        procs = {}
        for world, cases in plan.items():
            spec = os.path.join(tmp, f"tp{world}-cases.json")
            with open(spec, "w") as f:
                json.dump([vars(c) for c in cases], f)
            port = free_port()
            for r in range(world):
                dest = os.path.join(tmp, f"tp{world}-rank{r}.json")
                procs[world, r, dest] = subprocess.Popen(
                    [sys.executable, "-m", __name__, str(world), str(r), str(port), spec, dest], env=env,
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        logs = {key: p.communicate(timeout=timeout)[0] for key, p in procs.items()}
        out: dict[int, dict[str, list[dict]]] = {w: {} for w in plan}
        for (world, r, dest), p in procs.items():
            if p.returncode or not os.path.exists(dest):
                raise RuntimeError(f"rank {r} of {world} exited {p.returncode}:\n{logs[world, r, dest][-4000:]}")
            for rec in json.load(open(dest)):
                out[world].setdefault(rec["case"], []).append(rec)
    return out


def main(argv: list[str]) -> None:
    from .cuda_boundary import vllm_sees_triton
    world, rank, port, spec, dest = int(argv[0]), int(argv[1]), int(argv[2]), argv[3], argv[4]
    vllm_sees_triton()           # vLLM's Triton kernel classes in the interpreter, as the GPU runs them
    init_ranks(world, rank, port)
    cases = [Case(**{**c, "env": tuple(map(tuple, c["env"]))}) for c in json.load(open(spec))]
    records = [run_case(c) for c in cases]
    with open(dest, "w") as f:
        json.dump(records, f)


if __name__ == "__main__":
    main(sys.argv[1:])
