"""The locks that keep a second run off ``OUT``: ``flock`` on descriptors held open for the run, on
``OUT.latq-lock`` (who holds OUT, what it sealed) and on the run directory itself (docs/ARCHITECTURE.md)."""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path

from ..bounded_io import parse_json, read_json
from ..errors import FormatError

LOCK_SUFFIX = ".latq-lock"        # beside OUT while a run holds it: who holds it, what it sealed
NOTE_BYTES = 1 << 16


def holder_note(command: str) -> dict:
    return {"command": command, "pid": os.getpid(), "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}


def write_note(path: Path, note: dict) -> None:
    path.write_text(json.dumps(note))


def holder(path: Path) -> str:
    """Who holds a lock, from the note at ``path`` (the lock file or a run directory's mark)."""
    try:
        h = read_json(path, limit=NOTE_BYTES, name=str(path))
        return f"{h['command']}, pid {h['pid']} on {h['host']}, started {h['started']}"
    except (OSError, FormatError, KeyError, TypeError):
        return "holder unknown"


def _flock(fd: int) -> bool:
    """Whether this process now holds ``fd``'s exclusive lock (False: another one does)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise


class DirLock:
    """``flock`` on directory ``path`` if it exists (it follows renames); held elsewhere → ``FileExistsError``."""

    def __init__(self, path: Path, busy: str):
        self.path, self.busy, self.fd = path, busy, None

    def take(self) -> "DirLock":
        try:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            return self
        except OSError as e:
            if e.errno == errno.ELOOP:   # a link: the caller's rules refuse it by name
                return self
            raise ValueError(f"{self.path}: cannot open it to lock it ({e.strerror})") from None
        if not _flock(self.fd):
            self.release()
            raise FileExistsError(self.busy)
        return self

    def same(self) -> bool:
        """Whether ``path`` still names the directory locked."""
        try:
            return self.fd is not None and os.stat(self.path, follow_symlinks=False).st_ino == os.fstat(self.fd).st_ino
        except FileNotFoundError:
            return False

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> "DirLock":
        return self.take()

    def __exit__(self, *exc) -> None:
        self.release()


class LockFile:
    """``OUT.latq-lock`` held: its note says who holds it; ``journal`` is what a holder that died had sealed."""

    def __init__(self, path: Path, fd: int, note: dict, journal: dict | None):
        self.path, self.fd, self.holder, self.journal = path, fd, note, journal
        self.keep = False   # left in place when it records a sealed checkpoint not yet moved into place
        self.note(journal)   # carried until this run decides: a kill before then loses nothing

    def note(self, sealed: dict | None = None) -> None:
        """Who holds the lock, and the sealed checkpoint not yet moved into place (kept if the run stops)."""
        self.keep = sealed is not None
        data = json.dumps({**self.holder, **({"sealed": sealed} if sealed else {})}).encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)


def _journal(fd: int, path: Path) -> dict | None:
    """The sealed checkpoint the lock file's last holder recorded, if any ({"digest", "fingerprint"})."""
    try:
        note = parse_json(os.pread(fd, NOTE_BYTES, 0), name=str(path))
    except (OSError, FormatError):
        return None
    sealed = note.get("sealed") if isinstance(note, dict) else None
    if isinstance(sealed, dict) and all(isinstance(sealed.get(k), str) for k in ("digest", "fingerprint")):
        return sealed
    return None


@contextmanager
def lock_file(out: Path, command: str):
    """Hold ``OUT.latq-lock`` for the body → :class:`LockFile` (held elsewhere → ``FileExistsError`` naming it)."""
    path = out.with_name(out.name + LOCK_SUFFIX)
    fd, journal = _acquire(path, out)
    lock = None
    try:
        lock = LockFile(path, fd, holder_note(command), journal)
        yield lock
    finally:
        try:
            if lock is None or not lock.keep:
                os.unlink(path)   # while held: a run waiting on it retries on the new file
        except OSError:
            pass   # a folder made read-only meanwhile: a lock file left behind locks nothing
        finally:
            os.close(fd)


def _acquire(path: Path, out: Path) -> tuple[int, dict | None]:
    while True:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            raise ValueError(f"{out}: cannot create its lock {path} ({e.strerror}): is the folder holding OUT "
                             "writable?") from None
        try:
            held = _flock(fd)
        except OSError as e:
            os.close(fd)
            raise ValueError(f"{out}: cannot lock {path} ({e.strerror})") from None
        if not held:
            os.close(fd)
            raise FileExistsError(f"{out} is being written by another run ({holder(path)}; lock {path}): wait for "
                                  "it to finish or choose another OUT")
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd, _journal(fd, path)
        os.close(fd)   # the holder finished and removed it between our open and our lock: again
