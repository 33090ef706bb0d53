"""torch's threads fitted to the idle cores (vllm_latq/threads.py): fewer where other work keeps cores busy, said
in one line, back up when it stops, never where OMP_NUM_THREADS chose the count."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from vllm_latq import threads


@pytest.fixture
def fitted(monkeypatch):
    """Fitting on, on 2 cores whose own count is 2; torch's count restored after."""
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "_most", [2])
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda _: {0, 1})
    yield monkeypatch
    torch.set_num_threads(before)


def test_a_busy_core_takes_a_thread_and_is_said_once(fitted):
    said = []
    fitted.setattr(threads, "busy_elsewhere", lambda: 1)
    assert threads.fit_to_idle_cores("quantizing", say=said.append) == 1 == torch.get_num_threads()
    assert said == ["quantizing on 1 of 2 cores: other work keeps 1 busy (OMP_NUM_THREADS=2 pins the count; "
                    "results depend on it in the last bits)"]
    fitted.setattr(threads, "busy_elsewhere", lambda: 0)
    assert threads.fit_to_idle_cores("quantizing", say=said.append) == 2 == torch.get_num_threads()
    fitted.setattr(threads, "busy_elsewhere", lambda: 5)   # never below one thread
    assert threads.fit_to_idle_cores("quantizing", say=said.append) == 1
    assert len(said) == 2


def test_omp_num_threads_is_the_users_count(fitted):
    fitted.setenv("OMP_NUM_THREADS", "2")
    fitted.setattr(threads, "busy_elsewhere", lambda: 1)
    torch.set_num_threads(2)
    said = []
    assert threads.fit_to_idle_cores("quantizing", say=said.append) == 2 and said == []


def test_a_busy_process_is_counted_and_a_sleeping_one_is_not():
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.5)
        running = set()
        for _ in range(20):   # on a loaded machine the busy one may be waiting at one look: it is R then too
            running |= threads.running_elsewhere()
        assert busy.pid in running and idle.pid not in running
    finally:
        busy.kill(), idle.kill()
