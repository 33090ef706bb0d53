"""Test hook: a checkpoint replaced right after a reader verified it (``LATQ_SWAP_AFTER_VERIFY``); off unless set."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from .. import env

SWAP_ENV = "LATQ_SWAP_AFTER_VERIFY"


def swap_if_asked(path: str | os.PathLike) -> None:
    """Once a reader verified ``path``: the directory ``$LATQ_SWAP_AFTER_VERIFY`` names, if there, replaces it
    as ``--overwrite`` does (renamed in, the old one removed)."""
    other = env.path(SWAP_ENV)
    if other is None or not os.path.isdir(other):
        return
    path = Path(path)
    old = path.with_name(path.name + ".swapped-latq")
    os.rename(path, old)
    os.rename(other, path)
    shutil.rmtree(old)
