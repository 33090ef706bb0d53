"""Reading files latq does not control within bounds: regular files only, sizes capped before a read,
JSON with a nesting limit and finite numbers; a directory and its files held open, read by position
(:class:`OpenedDir`). Every refusal is a :class:`FormatError` naming the file."""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import re
import stat
from pathlib import Path
from typing import BinaryIO, Iterator

import numpy as np

from .errors import FormatError, is_resource_error, limits, writing

MAX_JSON_BYTES = 64 << 20   # config, index, stats, manifest, progress: a 405B MoE's stats are ~25 MiB
MAX_JSON_DEPTH = 64         # the package's JSON nests 5 deep; a deeper file is an attack, not a model
MAX_TEXT_BYTES = 1 << 30    # a text file read whole (calibration, evaluation)
PIECE_BYTES = 16 << 20      # a file hashed or copied in pieces of this size

_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def open_regular(path: str | os.PathLike, *, name: str | None = None, dir_fd: int | None = None) -> BinaryIO:
    """``path`` (in directory ``dir_fd``) opened for binary reading if it is a regular file; else a :class:`FormatError`
    naming ``name``. Opened without blocking, so a FIFO is refused instead of waiting for a writer."""
    name = name or str(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as e:
        if is_resource_error(e):   # out of descriptors, not a bad file: the command's limits() names the limit
            raise
        why = "a symbolic link loop" if e.errno == errno.ELOOP else f"cannot be opened ({e.strerror})"
        raise FormatError(f"{why}: refused", file=name) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = next((k for test, k in _KINDS if test(mode)), "not a regular file")
        raise FormatError(f"{kind}, not a regular file: refused", file=name)
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def read_bytes(path: str | os.PathLike, limit: int, *, name: str | None = None) -> bytes:
    """The bytes of regular file ``path``, refused past ``limit`` bytes (declared or grown while read)."""
    name = name or str(path)
    with open_regular(path, name=name) as f, limits(f"reading {name}"):
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise FormatError(f"{size} bytes, more than the {limit} such a file may hold: refused", file=name)
        chunks, n, want = [], 0, size + 1   # the size it has, and a byte more to see it grow
        while n <= limit and (piece := f.read(min(want, limit + 1 - n))):
            chunks.append(piece)
            n, want = n + len(piece), PIECE_BYTES
    if n > limit:
        raise FormatError(f"grew past {limit} bytes while read: refused", file=name)
    return b"".join(chunks)


def read_head(path: str | os.PathLike, n: int, limit: int, *, name: str | None = None) -> tuple[bytes, bool]:
    """The first ``n`` bytes of regular file ``path`` (refused past ``limit`` bytes), and whether
    they are all of it: a file read only as far as it is needed."""
    name = name or str(path)
    with open_regular(path, name=name) as f, limits(f"reading {name}"):
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise FormatError(f"{size} bytes, more than the {limit} such a file may hold: refused", file=name)
        data = f.read(min(n, size + 1))
        whole = len(data) < n and not f.read(1)
    return data, whole


def read_text(path: str | os.PathLike, limit: int = MAX_TEXT_BYTES, *, name: str | None = None) -> str:
    """UTF-8 text of regular file ``path`` (≤ ``limit`` bytes); ``UnicodeDecodeError`` passes through."""
    return read_bytes(path, limit, name=name).decode("utf-8")


def read_json(path: str | os.PathLike, *, limit: int = MAX_JSON_BYTES, name: str | None = None):
    """The JSON value of regular file ``path``, bounded as :func:`parse_json` says."""
    name = name or str(path)
    return parse_json(read_bytes(path, limit, name=name), name=name)


def parse_json(raw: bytes | str, *, name: str):
    """``raw`` parsed as JSON; refused, naming ``name``, if not UTF-8, too deep or not finite."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, (bytes, bytearray)) else raw
    except UnicodeDecodeError as e:
        raise FormatError(f"not UTF-8 JSON (byte {e.start})", file=name) from None
    depth = json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise FormatError(f"JSON nested {depth} levels deep, more than {MAX_JSON_DEPTH}: refused", file=name)
    try:
        return json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except (ValueError, RecursionError) as e:
        raise FormatError(f"not valid JSON ({e})", file=name) from None


def json_depth(text: str) -> int:
    """The deepest nesting of ``[``/``{`` in JSON ``text``, brackets inside strings not counted."""
    if text.count("[") + text.count("{") <= MAX_JSON_DEPTH:
        return 0   # cannot be deeper than the limit
    b = np.frombuffer(_STRING.sub("", text).encode("utf-8", "replace"), np.uint8)
    step = (b == ord("[")).astype(np.int32) + (b == ord("{")) - (b == ord("]")) - (b == ord("}"))
    return int(np.cumsum(step).max(initial=0))


def _no_constant(token: str):
    raise ValueError(f"{token} is not a finite number")


def _finite_float(token: str) -> float:
    x = float(token)
    if not math.isfinite(x):
        raise ValueError(f"{token} is not a finite number (beyond the float range)")
    return x


def pieces(path: str | os.PathLike, *, limit: int | None = None, name: str | None = None) -> Iterator[bytes]:
    """The bytes of regular file ``path`` in pieces of :data:`PIECE_BYTES` (refused past ``limit``)."""
    name = name or str(path)
    with open_regular(path, name=name) as f:
        size = os.fstat(f.fileno()).st_size
        if limit is not None and size > limit:
            raise FormatError(f"{size} bytes, more than the {limit} such a file may hold: refused", file=name)
        n = 0
        while piece := f.read(PIECE_BYTES):
            n += len(piece)
            if limit is not None and n > limit:
                raise FormatError(f"grew past {limit} bytes while read: refused", file=name)
            yield piece


def file_sha256(path: str | os.PathLike, *, limit: int | None = None, name: str | None = None) -> str:
    """sha256 of the regular file ``path``'s bytes, read by pieces."""
    h = hashlib.sha256()
    for piece in pieces(path, limit=limit, name=name):
        h.update(piece)
    return h.hexdigest()


def copy_regular(src: Path, dst: Path, *, limit: int | None = None, name: str | None = None) -> str:
    """Copy the regular file ``src`` to ``dst`` by pieces → the sha256 of what was written."""
    h = hashlib.sha256()
    with writing(dst), open(dst, "wb") as out:
        for piece in pieces(src, limit=limit, name=name):
            h.update(piece)
            out.write(piece)
    return h.hexdigest()


def pread_into(f: BinaryIO, buf, offset: int) -> int:
    """Fill ``buf`` from byte ``offset`` of file ``f``, by position → the bytes read (fewer at its end)."""
    view, got = memoryview(buf).cast("B"), 0
    while got < len(view):
        n = os.preadv(f.fileno(), [view[got:]], offset + got)
        if not n:
            break
        got += n
    return got


def pread_pieces(f: BinaryIO, offset: int, length: int, size: int = PIECE_BYTES) -> Iterator[memoryview]:
    """``length`` bytes of ``f`` from ``offset`` in pieces, one buffer reused; ``EOFError`` if it ends first."""
    buf = memoryview(bytearray(min(size, length)))
    while length:
        want = min(size, length)
        if pread_into(f, buf[:want], offset) != want:
            raise EOFError(f"ends before byte {offset + want}")
        offset, length = offset + want, length - want
        yield buf[:want]


class OpenedDir:
    """A directory and its files, each opened once (all on opening, or on first use) and read by position:
    what is verified through it is what is read, whatever is renamed over them meanwhile."""

    def __init__(self, path: str | os.PathLike, *, hold_all: bool = True):
        self.path = Path(path)
        try:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise
        except OSError as e:
            if is_resource_error(e):   # as in open_regular
                raise
            why = "not a directory" if e.errno == errno.ENOTDIR else f"cannot be opened ({e.strerror})"
            raise FormatError(why, file=str(self.path)) from None
        self._files: dict[str, BinaryIO] = {}
        for e in self.entries() if hold_all else ():
            if e.is_file():   # a link too (a hub snapshot's): the file it names
                with contextlib.suppress(FileNotFoundError, FormatError):   # refused when read, naming it
                    self.file(e.name)

    def held(self) -> list[str]:
        """The names of the files held open."""
        return list(self._files)

    def entries(self) -> list[os.DirEntry]:
        """The directory's entries now (not those held)."""
        with os.scandir(self.fd) as it:
            return list(it)

    def file(self, name: str) -> BinaryIO:
        """File ``name``, opened on first use (``FileNotFoundError`` if absent or not a plain name)."""
        f = self._files.get(name)
        if f is None:
            if name in ("", ".", "..") or "/" in name or "\0" in name:
                raise FileNotFoundError(name)
            f = self._files[name] = open_regular(name, name=name, dir_fd=self.fd)
        return f

    def exists(self, name: str) -> bool:
        """Whether ``name`` is held or in the directory now."""
        if name in self._files:
            return True
        try:
            os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError, ValueError):
            return False
        return True

    def read(self, name: str, limit: int, *, display: str | None = None) -> bytes:
        """The whole of file ``name``, refused past ``limit`` bytes."""
        display = display or name
        f = self.file(name)
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise FormatError(f"{size} bytes, more than the {limit} such a file may hold: refused", file=display)
        buf = bytearray(size + 1)
        got = pread_into(f, buf, 0)
        if got > size:
            raise FormatError(f"grew past {size} bytes while read: refused", file=display)
        return bytes(buf[:got])

    def read_json(self, name: str, *, limit: int = MAX_JSON_BYTES, display: str | None = None):
        return parse_json(self.read(name, limit, display=display), name=display or name)

    def sha256(self, name: str) -> str:
        """sha256 of file ``name``'s bytes, read by pieces."""
        h, f = hashlib.sha256(), self.file(name)
        size = os.fstat(f.fileno()).st_size
        try:
            for piece in pread_pieces(f, 0, size):
                h.update(piece)
        except EOFError:
            raise FormatError("shrank while read", file=name) from None
        return h.hexdigest()

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self):   # the directory's own descriptor; each file closes itself once no reader holds it
        try:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1
        except Exception:  # noqa: BLE001  (at interpreter exit the modules it uses may be gone)
            pass
