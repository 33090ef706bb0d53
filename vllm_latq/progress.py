"""Progress of the long steps on stderr (stdout holds results): a bar on a terminal, one line saying what is
under way elsewhere (a log), nothing with ``--no-progress``; a step quiet for :data:`DELAY` s says nothing."""
from __future__ import annotations

import contextlib
import sys
import threading
from typing import Callable, Iterator

from .errors import in_units

DELAY = 2.0   # a step shorter than this stays quiet: a small model's steps, and a refusal found at once stays one line


def terminal() -> bool:   # where a bar redraws in place; a log or a pipe would keep every redraw
    return sys.stderr.isatty()


def say(line: str) -> None:   # flushed: a pipe would hold the line back until the step is over
    print(line, file=sys.stderr, flush=True)


def _ignore(n: int = 1) -> None:
    pass


@contextlib.contextmanager
def _later(line: str) -> Iterator[None]:
    """``line`` said once the block has run :data:`DELAY` seconds (at once with no delay)."""
    if DELAY <= 0:
        say(line)
        yield
        return
    timer = threading.Timer(DELAY, say, [line])
    timer.daemon = True   # a step that never ends must not keep the process alive
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


@contextlib.contextmanager
def step(what: str, enabled: bool = True, *, total: int | None = None, unit: str = "it",
         bar: bool = True) -> Iterator[Callable[[int], object]]:
    """``what`` within the block: a bar of ``total`` ``unit`` ("B": bytes) on a terminal (``bar=False``: the library
    called draws it), else one line; yields ``advance(n)``."""
    if not enabled or (not bar and terminal()):
        yield _ignore
    elif not terminal():
        with _later(f"{what}: {in_units(total)}" if unit == "B" and total is not None else what):
            yield _ignore
    else:
        from tqdm.auto import tqdm
        nbytes = unit == "B"
        with tqdm(total=total, desc=what, unit=unit, unit_scale=nbytes, unit_divisor=1024 if nbytes else 1000,
                  file=sys.stderr, delay=DELAY) as drawn:
            yield drawn.update


def bar(items, what: str, enabled: bool = True, *, unit: str = "it", leave: bool = False, **counts):
    """``items`` with a bar on a terminal (``counts``: tqdm's ``total``, ``initial``); as they are elsewhere, where
    the caller's own line per step (a quantized block's) says what a redrawn bar would only repeat in a log."""
    if not enabled or not terminal():
        return items
    from tqdm.auto import tqdm
    return tqdm(items, desc=what, unit=unit, file=sys.stderr, leave=leave, delay=DELAY, **counts)
