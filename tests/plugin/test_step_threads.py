"""The decode team in vLLM's CPU worker (``plugin/step_threads.py``): on two threads a decode step
runs vLLM's ops on one and latq's GEMV on both, a prefill step every op on both; vLLM's CPU
attention checks that its metadata and its kernel saw the same count, so a switch at the wrong
moment fails the run."""
from __future__ import annotations

import pytest

from tests import vllm_helpers as h
from vllm_latq import native
from vllm_latq.plugin import step_threads

pytestmark = pytest.mark.skipif(not native.available(), reason=f"C++ op unavailable: {native.load()}")


def test_a_step_runs_on_one_thread_up_to_the_glue_rows(monkeypatch):
    from vllm_latq.kernels.cpu import kernel as cpu
    monkeypatch.setattr(cpu, "GLUE_SERIAL_M", 1)
    assert [step_threads.step_threads(n, 2) for n in (0, 1, 2, 64)] == [2, 1, 2, 2]
    monkeypatch.setattr(cpu, "GLUE_SERIAL_M", 0)
    assert step_threads.step_threads(1, 2) == 2


def test_decode_team_in_vllms_cpu_worker(tmp_path):
    """Two generate calls (the second's prefill follows decode steps on one thread), one prompt:
    in process the last decode step leaves one thread and the GEMV ran on two; tokens equal the
    run with every op on both threads (``LATQ_CPU_GLUE_SERIAL_M=0``) and the default multiprocess
    path's."""
    src = h.make_tiny_llama(tmp_path / "model", hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512)
    ck = h.quantize_dir(src, tmp_path / "rtn", "rtn", bits=4, group_size=32)   # 4+ blocks of 64 rows a layer
    ids = h.tokenize(ck, h.PROMPTS[:1])
    job = {"model": ck, "prompt_ids": ids, "max_tokens": 12, "rounds": 2, "dtype": "bfloat16",
           "env": {"LATQ_KERNEL": "cpu"}}
    two = {"OMP_NUM_THREADS": "2"}
    team = h.run_vllm_jobs([job], extra_env=two, tmp=tmp_path)[0]
    assert "error" not in team, team.get("traceback", "") + team["log"][-4000:]
    assert (team["gemv_threads"], team["omp_threads"]) == (2, 1), team["log"][-4000:]
    every = h.run_vllm_jobs([job], extra_env={**two, "LATQ_CPU_GLUE_SERIAL_M": "0"}, tmp=tmp_path)[0]
    assert "error" not in every, every.get("traceback", "") + every["log"][-4000:]
    assert (every["gemv_threads"], every["omp_threads"]) == (2, 2)
    spawned = h.run_vllm_jobs([job], extra_env={**two, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, tmp=tmp_path)[0]
    assert "error" not in spawned, spawned.get("traceback", "") + spawned["log"][-4000:]
    assert team["tokens"] == every["tokens"] == spawned["tokens"]
