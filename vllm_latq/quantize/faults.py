"""Test hooks: a run stopped after a block (to test ``--resume``), a solve that fails or kills
its rank (to test what the other ranks do then), a process killed or paused at a stage of writing
OUT (to test what the next run finds). Nothing here runs unless asked."""
from __future__ import annotations

import os
import signal
import time

from .. import env
from .ranks import World

STOP_ENV = "LATQ_STOP_AFTER_BLOCK"  # raise SimulatedInterruption after this block
FAULT_ENV = "LATQ_FAULT"  # "RANK:LAYER_SUBSTRING:raise|kill" fails that rank at that layer's solve
AT_ENV = "LATQ_FAULT_AT"  # "STAGE:kill|stop|hold": SIGKILL, SIGSTOP or sleep until killed at STAGE
# a block's shard and progress saved; then output_dir.replace_with's: the run directory sealed, OUT moved
# to OUT.old-latq, the run directory moved to OUT, the old checkpoint's removal begun
STAGES = ("saved-block", "sealed", "aside", "replaced", "removing-old")
ACTIONS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "hold": None}   # hold: threads (watches) run on


class SimulatedInterruption(RuntimeError):
    """Raised after block k when ``stop_after_block=k`` (or ``$LATQ_STOP_AFTER_BLOCK=k``)."""


def stop_after(block: int | None) -> int | None:
    """The block after which a run stops: ``block``, else ``$LATQ_STOP_AFTER_BLOCK``, else None."""
    asked = env.integer(STOP_ENV, None, minimum=0)
    return asked if block is None else block


def fault_spec() -> tuple[int, str, str] | None:
    """``$LATQ_FAULT`` as (rank, layer substring, how), or None."""
    spec = env.text(FAULT_ENV, r"[0-9]+:[^:]+:(raise|kill)", "RANK:LAYER_SUBSTRING:raise or kill")
    if spec is None:
        return None
    rank, where, how = spec.split(":")
    return int(rank), where, how


def stop_if_asked(i: int, stop: int | None) -> None:
    if stop is not None and i == stop:
        raise SimulatedInterruption(f"simulated interruption after block {i}")


def stage_fault() -> tuple[str, signal.Signals | None] | None:
    """``$LATQ_FAULT_AT`` parsed → (stage, signal), or None; any other value is refused naming the variable."""
    spec = env.text(AT_ENV, f"({'|'.join(STAGES)}):({'|'.join(ACTIONS)})",
                    f"STAGE:ACTION, STAGE one of {', '.join(STAGES)}, ACTION one of {', '.join(ACTIONS)}")
    if spec is None:
        return None
    stage, _, action = spec.partition(":")
    return stage, ACTIONS[action]


def at(stage: str) -> None:
    """The run reached ``stage``: killed or stopped there if ``$LATQ_FAULT_AT`` says so."""
    fault = stage_fault()
    if fault is not None and fault[0] == stage:
        while fault[1] is None:
            time.sleep(1.0)
        os.kill(os.getpid(), fault[1])


def with_fault(solve, world: World):
    """``solve``, failing as ``$LATQ_FAULT`` asks."""
    spec = fault_spec()
    if spec is None:
        return solve
    rank, where, how = spec

    def faulty(method, W, H, name, **kw):
        if rank == world.rank and where in name:
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"fault injected by ${FAULT_ENV}")
        return solve(method, W, H, name, **kw)
    return faulty
