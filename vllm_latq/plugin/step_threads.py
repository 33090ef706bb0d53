"""The decode team on vLLM's CPU worker: a step of at most ``GLUE_SERIAL_M`` tokens runs vLLM's
ops (norms, attention, glue, sampling) on one OpenMP thread and latq's GEMVs on all the worker's;
a larger step (prefill) runs every op on all of them.

At batch 1 a decode step's ops around the linears are small: waking a second thread for each
costs more than it saves, while the GEMV streams the weights faster on every core
(docs/KERNELS.md, "CPU kernel", Decode threads). The count is set as the step starts, before
vLLM's CPU attention builds its metadata: that records the thread count its kernel must run on."""
from __future__ import annotations

import functools
import sys

import torch

from ..kernels.cpu import kernel as cpu

# vLLM's CPU model runners (V1's, and V2's where the worker uses it): whichever is imported when a
# latq layer loads on the CPU kernel is the one this worker runs
RUNNER_MODULES = ("vllm.v1.worker.cpu_model_runner", "vllm.v1.worker.cpu.model_runner")


def step_threads(num_tokens: int, team: int) -> int:
    """OpenMP threads for the ops of a step of ``num_tokens`` tokens on a worker of ``team``."""
    return 1 if 0 < num_tokens <= cpu.GLUE_SERIAL_M else team


def install() -> list[str]:
    """Wrap ``execute_model`` of the CPU model runners this process has imported (once each) →
    their modules. No-op where the GEMV has no team of two or more."""
    if cpu.decode_team() < 2:
        return []
    done = []
    for name in RUNNER_MODULES:
        runner = getattr(sys.modules.get(name), "CPUModelRunner", None)
        if runner is None or getattr(runner.execute_model, "latq_step_threads", False):
            continue
        runner.execute_model = _wrapped(runner.execute_model)
        done.append(name)
    return done


def _wrapped(execute_model):
    @functools.wraps(execute_model)
    def execute(self, scheduler_output, *args, **kwargs):
        team = cpu.decode_team()
        if team > 1:
            torch.ops.latq_cpu.set_omp_threads(step_threads(scheduler_output.total_num_scheduled_tokens, team))
        return execute_model(self, scheduler_output, *args, **kwargs)

    execute.latq_step_threads = True
    return execute
