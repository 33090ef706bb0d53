"""The output directory ``OUT``: what a run may replace, and one run at a time on it.

A run deletes only what latq wrote: ``--overwrite`` replaces an empty directory or a latq
checkpoint, never the source model, a directory holding it, a symbolic link or anything else.
A lock beside ``OUT`` keeps a second run off an ``OUT`` that one is writing, so neither takes
the other's partial output for a stale one."""
from __future__ import annotations

import json
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path

LOCK_SUFFIX = ".latq-lock"
OWNER_FILE = "latq_owner.json"   # in the run directory: who holds the lock, for the refusal's message


def is_latq_checkpoint(d: Path) -> bool:
    """Whether ``d`` holds a latq checkpoint: a config.json whose quantization_config is latq's."""
    try:
        qc = json.loads((d / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(qc, dict) and qc.get("quant_method") == "latq"


def check_output(out: Path, source: Path, overwrite: bool) -> None:
    """Refuse an ``out`` that a run must not write or replace (``FileExistsError`` where it only
    exists, ``ValueError`` where replacing it would delete what latq did not write)."""
    if out.is_symlink():
        raise ValueError(f"{out} is a symbolic link: latq writes and replaces only a directory of its own")
    here, src = out.resolve(), source.resolve()
    if here == src or here in src.parents:
        raise ValueError(f"{out} is the source model's directory or holds it ({source}): choose another OUT")
    if not out.exists():
        return
    if not overwrite:
        raise FileExistsError(f"{out} exists (pass --overwrite to replace a latq checkpoint)")
    if not out.is_dir():
        raise ValueError(f"{out} is not a directory: --overwrite replaces only a latq checkpoint")
    if any(out.iterdir()) and not is_latq_checkpoint(out):
        raise ValueError(f"{out} is not a latq checkpoint (no config.json with quant_method 'latq'): --overwrite "
                         "replaces only a latq checkpoint or an empty directory; remove it yourself if you mean to")


@contextmanager
def exclusive(out: Path, run_dir: Path):
    """Hold ``out``'s lock for the body; a second run on the same ``out`` fails at once naming the
    holder (recorded in ``run_dir`` once the body made it)."""
    from filelock import FileLock, Timeout

    out.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(out) + LOCK_SUFFIX, timeout=0)
    try:
        lock.acquire()
    except Timeout:
        try:
            holder = json.loads((run_dir / OWNER_FILE).read_text())
            who = f"pid {holder['pid']} on {holder['host']}, started {holder['started']}"
        except (OSError, ValueError, KeyError):
            who = "holder unknown"
        raise FileExistsError(f"{out} is being written by another latq-quantize run ({who}; lock "
                              f"{out}{LOCK_SUFFIX}): wait for it to finish or choose another OUT") from None
    try:
        yield
    finally:
        lock.release()


def record_owner(run_dir: Path) -> None:
    """Write who holds the lock into the run directory, for a refused second run to name."""
    (run_dir / OWNER_FILE).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                                  "started": time.strftime("%Y-%m-%d %H:%M:%S")}))
