"""Test hooks: a run stopped after a block (to test ``--resume``) and a solve that fails or kills
its rank (to test what the other ranks do then). Nothing here runs unless asked."""
from __future__ import annotations

import os
import signal

from .ranks import World

STOP_ENV = "LATQ_STOP_AFTER_BLOCK"  # raise SimulatedInterruption after this block
FAULT_ENV = "LATQ_FAULT"  # "RANK:LAYER_SUBSTRING:raise|kill" fails that rank at that layer's solve


class SimulatedInterruption(RuntimeError):
    """Raised after block k when ``stop_after_block=k`` (or ``$LATQ_STOP_AFTER_BLOCK=k``)."""


def stop_after(block: int | None) -> int | None:
    """The block after which a run stops: ``block``, else ``$LATQ_STOP_AFTER_BLOCK``, else None."""
    if block is None and os.environ.get(STOP_ENV):
        return int(os.environ[STOP_ENV])
    return block


def stop_if_asked(i: int, stop: int | None) -> None:
    if stop is not None and i == stop:
        raise SimulatedInterruption(f"simulated interruption after block {i}")


def with_fault(solve, world: World):
    """``solve``, failing as ``$LATQ_FAULT`` asks."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return solve
    rank, where, how = spec.split(":")

    def faulty(method, W, H, name, **kw):
        if int(rank) == world.rank and where in name:
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"fault injected by ${FAULT_ENV}")
        return solve(method, W, H, name, **kw)
    return faulty
