"""torch's threads fitted to the cores other work leaves idle. Its OpenMP threads meet at the end of every
parallel region, so a thread more than the idle cores makes each region wait for the scheduler: SmolLM2's
quantization beside one busy process took 9.6× as long on 2 threads as on 1 (docs/CHECKPOINTS.md)."""
from __future__ import annotations

import logging
import os
import time
from typing import Callable

import torch

log = logging.getLogger("vllm_latq")

LOOKS = 5          # looks at the other processes' threads, LOOK_GAP s apart: the busy ones are busy at every look
LOOK_GAP = 0.05
_most: list[int | None] = [None]   # torch's own thread count, kept from before the first fitting


def running_elsewhere() -> set[int]:
    """The threads (ids) of other processes running or waiting for a core now (state R in /proc)."""
    me, running = os.getpid(), set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == me:
            continue
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:   # ended meanwhile
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            if stat[stat.rindex(b")") + 2:stat.rindex(b")") + 3] == b"R":
                running.add(int(tid))
    return running


def busy_elsewhere() -> int:
    """Threads of other processes running at every look (a short burst is not load)."""
    if not os.path.isdir("/proc"):
        return 0
    busy = running_elsewhere()
    for _ in range(LOOKS - 1):
        time.sleep(LOOK_GAP)
        busy &= running_elsewhere()
    return len(busy)


def fit_to_idle_cores(what: str, say: Callable[[str], object] = log.info) -> int:
    """Set torch's threads to the cores this process may use less those busy with other work (at least one),
    unless ``OMP_NUM_THREADS`` chose them, and ``say`` so where that is fewer → the threads."""
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    most = _most[0] = _most[0] or torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    busy = busy_elsewhere()
    threads = max(1, min(most, cores - busy))
    if threads < most:
        say(f"{what} on {threads} of {cores} cores: other work keeps {busy} busy (OMP_NUM_THREADS={most} pins "
            "the count; results depend on it in the last bits)")
    torch.set_num_threads(threads)
    return threads
