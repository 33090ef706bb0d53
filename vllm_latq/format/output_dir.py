"""The directory ``OUT`` a command writes a checkpoint to: what it may replace, its lock, its temporary.

Nothing is deleted that latq did not make; every refusal names OUT and why (exit code 2)."""
from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable

from ..bounded_io import read_json
from ..errors import FormatError, writing
from ..hf_model import config_dict
from .files import MANIFEST_FILE, TEMP_MARK
from .manifest import read_manifest, unsealed_entries, verify_manifest
from .safetensors_file import SafetensorsFile

LOCK_SUFFIX = ".latq-lock"        # beside OUT while a run writes it: who holds it
OLD_SUFFIX = ".old-latq"          # the checkpoint being replaced, for the instant of the swap


def absolute(out: str | os.PathLike) -> Path:
    """``out`` as an absolute path, refusing one with no name to put a temporary beside (``/``)."""
    p = Path(os.path.abspath(out))
    if not p.name:
        raise ValueError(f"{out}: not a directory latq can write (it has no name to put OUT.tmp-latq beside)")
    return p


def check_out(out: Path, sources: Iterable[Path], overwrite: bool, made_by: str) -> None:
    """Refuse an ``out`` that command ``made_by`` must not write or replace (a link, a source, ...)."""
    if out.is_symlink():
        raise ValueError(f"{out} is a symbolic link: latq writes and replaces only a directory of its own")
    here = out.resolve()
    for src in sources:
        s = Path(src).resolve()
        if here == s or s.is_relative_to(here):
            raise ValueError(f"{out} is the source ({src}) or holds it: choose another OUT")
        if here.is_relative_to(s):
            raise ValueError(f"{out} is inside the source ({src}): a checkpoint is written beside its source, not "
                             "into it; choose another OUT")
    if not os.path.lexists(out):
        return
    if not overwrite:
        raise FileExistsError(f"{out} exists (pass --overwrite to replace a checkpoint {made_by} wrote)")
    if not out.is_dir():
        raise ValueError(f"{out} is not a directory: --overwrite replaces only a checkpoint {made_by} wrote")
    why = why_not_replaceable(out, made_by)
    if why:
        raise ValueError(f"{out}: {why}; --overwrite replaces only an empty directory or a complete checkpoint "
                         f"{made_by} wrote, nothing was deleted (remove it yourself if you mean to)")


def why_not_replaceable(d: Path, made_by: str) -> str | None:
    """None if ``d`` is empty or a complete checkpoint ``made_by`` sealed, else why not."""
    if not any(os.scandir(d)):
        return None
    if not os.path.lexists(d / MANIFEST_FILE):
        return f"it has no {MANIFEST_FILE}, so it is not a checkpoint {made_by} wrote"
    try:
        m = read_manifest(d)
        if m["made_by"] != made_by:
            return f"it was written by {m['made_by']}, not {made_by}"
        loose = unsealed_entries(d, m)
        if loose:
            return f"it holds {loose[0]}, which its {MANIFEST_FILE} does not list"
        verify_manifest(d, config_dict(d), {n: SafetensorsFile(d / n) for n in m["shards"]})
    except FormatError as e:
        return f"its seal does not verify ({e})"
    return None


def make_temporary(tmp: Path, made_by: str) -> None:
    """Create the temporary directory ``tmp``, marked as ``made_by``'s (a leftover one removed first)."""
    remove_temporary(tmp, made_by)
    with writing(tmp):   # a full disk names the directory, not only the errno
        tmp.mkdir(parents=True)
        mark_temporary(tmp, made_by)


def mark_temporary(tmp: Path, made_by: str) -> None:
    (tmp / TEMP_MARK).write_text(json.dumps({"made_by": made_by, "pid": os.getpid()}))


def unmark_temporary(tmp: Path) -> None:
    """The temporary directory is about to be sealed: the mark is not part of the checkpoint."""
    (tmp / TEMP_MARK).unlink(missing_ok=True)


def remove_temporary(tmp: Path, made_by: str) -> None:
    """Remove a leftover temporary ``tmp`` if latq made it; refuse anything else, naming it."""
    if not os.path.lexists(tmp):
        return
    if tmp.is_symlink() or not tmp.is_dir():
        raise ValueError(f"{tmp} exists and is not a directory latq made: remove or rename it yourself")
    if not (tmp / TEMP_MARK).is_file() and why_not_replaceable(tmp, made_by) is not None:
        raise ValueError(f"{tmp} exists and is not a temporary directory latq made (no {TEMP_MARK}): remove or "
                         "rename it yourself")
    shutil.rmtree(tmp)


def replace_with(tmp: Path, out: Path, sources: Iterable[Path], made_by: str) -> None:
    """Move the sealed ``tmp`` to ``out`` if :func:`check_out` allows it now (hours may have passed)."""
    sources = list(sources)
    if not os.path.lexists(out):
        os.replace(tmp, out)
        return
    check_out(out, sources, overwrite=True, made_by=made_by)
    old = out.with_name(out.name + OLD_SUFFIX)
    remove_temporary(old, made_by)
    os.replace(out, old)
    try:
        os.replace(tmp, out)
    except BaseException:
        os.replace(old, out)
        raise
    shutil.rmtree(old)


@contextmanager
def exclusive(out: Path, command: str):
    """Hold ``OUT.latq-lock`` for the body: a second run on ``out`` fails at once, naming the holder."""
    path = out.with_name(out.name + LOCK_SUFFIX)
    fd = _acquire(path, out, command)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"command": command, "pid": os.getpid(), "host": socket.gethostname(),
                                 "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode())
        yield
    finally:
        try:
            os.unlink(path)   # while held: a run waiting on it retries on the new file
        finally:
            os.close(fd)


def _acquire(path: Path, out: Path, command: str) -> int:
    while True:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise ValueError(f"{out}: cannot create its lock {path} ({e.strerror}): is the folder holding OUT "
                             "writable?") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise ValueError(f"{out}: cannot lock {path} ({e.strerror})") from None
            raise FileExistsError(f"{out} is being written by another run ({_holder(path)}; lock {path}): wait for "
                                  "it to finish or choose another OUT") from None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)   # the holder finished and removed it between our open and our lock: again


def _holder(path: Path) -> str:
    try:
        h = read_json(path, limit=4096, name=str(path))
        return f"{h['command']}, pid {h['pid']} on {h['host']}, started {h['started']}"
    except (OSError, FormatError, KeyError, TypeError):
        return "holder unknown"
