"""The errors a user can cause, each one line: :class:`FormatError` (a bad checkpoint, naming the file
and tensor) and :class:`ResourceLimit` (the machine's memory, disk or file-size limit reached,
naming what was being read or written and the limit), so a caller can tell them from a bug."""
from __future__ import annotations

import errno
import os
import re
import resource
import shutil
from contextlib import contextmanager
from pathlib import Path

from .cpu_features import address_space_left, available_memory


class FormatError(ValueError):
    """A checkpoint does not follow the format. The message names the file and tensor."""

    def __init__(self, what: str, *, file: str | None = None, tensor: str | None = None):
        what = " ".join(line.strip() for line in str(what).splitlines())  # always one line
        where = ", ".join(x for x in (f"file {file}" if file else "", f"tensor {tensor}" if tensor else "") if x)
        super().__init__(f"{where}: {what}" if where else what)


class ResourceLimit(OSError):
    """A limit of the machine was reached (memory, disk space, a quota or file-size limit) while
    reading or writing what the message names: the input is not at fault."""

    def __init__(self, message: str, err: int = errno.ENOMEM):
        super().__init__(err, " ".join(message.split()))

    def __str__(self) -> str:
        return self.strerror


# the memory a command's first steps take beyond what is loaded (a model's modules imported, its
# config and headers read): with less, native code may crash in them rather than raise
COMMAND_HEADROOM = 256 << 20
_DISK_FULL = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "the disk quota is exceeded",
              errno.EFBIG: "the file is too large"}
# the descriptor limits: a process under ``ulimit -n`` meets them in any open, an import included
_NO_DESCRIPTOR = {errno.EMFILE: "too many open files", errno.ENFILE: "too many open files in the system"}
# torch's CPU allocator and CUDA's out-of-memory error: RuntimeErrors, not MemoryError
_ALLOCATION_FAILED = re.compile(r"can't allocate memory|out of memory", re.I)


def is_resource_error(e: BaseException) -> bool:
    """Whether ``e`` says a limit of the machine was reached, not that the input is bad."""
    return (isinstance(e, (MemoryError, ResourceLimit))
            or (isinstance(e, OSError) and e.errno in (*_DISK_FULL, *_NO_DESCRIPTOR, errno.ENOMEM))
            or (isinstance(e, RuntimeError) and bool(_ALLOCATION_FAILED.search(str(e)))))


def resource_limit(e: BaseException, doing: str, path: str | os.PathLike | None = None) -> ResourceLimit | None:
    """``e`` as a :class:`ResourceLimit` saying what was being done and which limit was reached;
    None where ``e`` is no resource error."""
    if isinstance(e, ResourceLimit) or not is_resource_error(e):
        return e if isinstance(e, ResourceLimit) else None
    try:   # with the memory gone, saying which limit may itself fail: then it is left unsaid
        if isinstance(e, OSError) and e.errno in _DISK_FULL:
            return ResourceLimit(f"{_DISK_FULL[e.errno]} while {doing} ({disk_limit(e.errno, path)})", e.errno)
        if isinstance(e, OSError) and e.errno in _NO_DESCRIPTOR:
            return ResourceLimit(f"{_NO_DESCRIPTOR[e.errno]} while {doing} ({files_limit(e.errno)})", e.errno)
        return ResourceLimit(f"out of memory while {doing} ({memory_limit()})")
    except MemoryError:
        return ResourceLimit(f"out of memory while {doing}", getattr(e, "errno", None) or errno.ENOMEM)


def reason(e: OSError, path: str | os.PathLike | None = None) -> str:
    """Why ``e`` failed, in words; a disk limit with the limit (writing ``path``)."""
    if e.errno in _DISK_FULL:
        return f"{_DISK_FULL[e.errno]} ({disk_limit(e.errno, path)})"
    if e.errno in _NO_DESCRIPTOR:
        return f"{_NO_DESCRIPTOR[e.errno]} ({files_limit(e.errno)})"
    return e.strerror or str(e)


@contextmanager
def limits(doing: str, path: str | os.PathLike | None = None, *, need: int = 0):
    """A limit of the machine reached in the body (or ``need`` bytes not available before it) is one
    :class:`ResourceLimit` saying ``doing`` (the innermost such context names it)."""
    try:
        if need:
            check_headroom(need, doing)
        yield
    except Exception as e:   # noqa: BLE001  (only resource errors are converted; the rest pass)
        r = resource_limit(e, doing, path)
        if r is None or r is e:
            raise
        raise r from None


@contextmanager
def writing(path: str | os.PathLike):
    """Writes of ``path`` in the body: a limit reached is a :class:`ResourceLimit`, any other
    ``OSError`` that names no file (a failed ``write``) is raised again naming ``path``."""
    try:
        with limits(f"writing {path}", path):
            yield
    except OSError as e:
        if isinstance(e, ResourceLimit) or e.filename is not None:
            raise
        raise OSError(e.errno, e.strerror, str(path)) from None


def check_headroom(need: int, doing: str) -> None:
    """Refuse, as a :class:`ResourceLimit`, a step needing more than the memory available (or than
    ``ulimit -v`` leaves): native code that aborts on a failed allocation is never entered without room."""
    room, left = address_space_left(), available_memory()
    if need > left:
        limited = room is not None and room <= left
        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        limit = f"the address-space limit, ulimit -v {in_units(soft)}, leaves" if limited else "this machine has"
        raise ResourceLimit(f"out of memory before {doing}: it takes about {in_units(need)}, and {limit} "
                            f"{in_units(left)}" + ("" if limited else " available"))


def memory_limit() -> str:
    """The memory limit this process runs under, in words."""
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    if soft != resource.RLIM_INFINITY:
        return f"the address-space limit, ulimit -v, is {in_units(soft)}"
    return f"{in_units(available_memory())} of memory available now"


def files_limit(err: int) -> str:
    """The descriptor limit ``err`` (EMFILE, ENFILE) names, in words."""
    if err == errno.EMFILE:
        return f"the open-file limit, ulimit -n, is {resource.getrlimit(resource.RLIMIT_NOFILE)[0]}"
    return "the system's table of open files is full"


def disk_limit(err: int, path: str | os.PathLike | None) -> str:
    """The disk limit ``err`` (ENOSPC, EDQUOT, EFBIG) met writing ``path``, in words."""
    if err == errno.EFBIG:
        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        return (f"the file-size limit, ulimit -f, is {in_units(soft)}" if soft != resource.RLIM_INFINITY
                else "larger than its file system allows")
    if err == errno.EDQUOT or path is None:
        return "free some space or write elsewhere"
    folder = Path(path).parent
    try:
        return f"{in_units(shutil.disk_usage(folder).free)} free in {folder}"
    except OSError:
        return f"its folder {folder}"


def in_units(n: int) -> str:
    """``n`` bytes in GiB, MiB, KiB or bytes, for a message."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.2f} {unit}"
    return f"{n} bytes"
