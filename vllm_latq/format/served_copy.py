"""The sealed files a server reads by path (config, tokenizer, chat template, generation defaults), written from the
bytes a check verified into a private directory named by the manifest's digest (docs/FORMAT.md, "Manifest")."""
from __future__ import annotations

import contextlib
import errno
import fnmatch
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

from ..bounded_io import OpenedDir
from ..errors import FormatError, writing
from .checkpoint import Checkpoint
from .files import AUX_PATTERNS, CONFIG_FILE
from .manifest import config_digests

SERVED_DIR = "served"   # under the latq cache
# in quantization_config: the digest of the checkpoint checked before vLLM started (the copy's config.json),
# then the one the plugin validated when vLLM built its config; the workers hold what they read to it
DIGEST_KEY = "_latq_digest"


def served_names(manifest: dict) -> list[str]:
    """``config.json`` and the sealed files of :data:`~.files.AUX_PATTERNS`."""
    aux = (n for n in manifest["files"] if any(fnmatch.fnmatchcase(n, p) for p in AUX_PATTERNS))
    return [CONFIG_FILE, *sorted(aux)]


def served_contents(ck: Checkpoint) -> dict[str, bytes]:
    """name → bytes: the sealed files as verified; config.json's verified value, :data:`DIGEST_KEY` added."""
    if not ck.checked or config_digests(ck.config) != ck.manifest[CONFIG_FILE]:
        raise ValueError("served_contents needs the checkpoint verified")
    config = {**ck.config, "quantization_config": {**ck.config["quantization_config"], DIGEST_KEY: ck.digest}}
    out = {CONFIG_FILE: (json.dumps(config, indent=2) + "\n").encode()}
    for name in served_names(ck.manifest)[1:]:
        out[name] = ck.sealed_bytes(name)
    return out


def served_copy(ck: Checkpoint, root: Path | None = None) -> Path:
    """Directory ``root/<digest>`` holding :func:`served_contents`: reused if it holds exactly them, else written
    anew and renamed into place (``root``: the cache's :data:`SERVED_DIR`, only its owner may write it)."""
    if root is None:
        from ..data.paths import cache_dir
        root = cache_dir() / SERVED_DIR
    want = served_contents(ck)
    root = _private(Path(root))
    final = root / ck.digest.removeprefix("sha256:")
    if _holds(final, want):
        return final
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        for name, data in want.items():
            with writing(tmp / name):   # a full disk or ulimit -f named with the file
                fd = os.open(tmp / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
        _publish(tmp, final, want)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _private(root: Path) -> Path:
    """``root`` (made 0700) under its folder's real path, the one :func:`_check_folders` checks and vLLM is handed."""
    holder = Path(os.path.realpath(root.parent))
    root = holder / root.name
    _check_folders(holder)   # before anything is made in it
    with contextlib.suppress(FileExistsError):
        os.mkdir(root, 0o700)
    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise FormatError("not a directory of your own: the verified files handed to vLLM are kept where only you "
                          "can write (set LATQ_CACHE to a directory of yours)", file=str(root))
    if st.st_mode & 0o077:
        os.chmod(root, 0o700)
    return root


def _check_folders(folder: Path) -> None:
    """``folder`` (a real path) and every folder above it yours or root's, writable by no one else; else ValueError."""
    # as ssh's StrictModes: whoever can write a folder on the way can rename what it holds away and plant the config
    # vLLM reads. A sticky folder (/tmp) may be writable by all while what it holds on the way down is yours or
    # root's: others can neither rename nor remove that (served/, made next, is refused unless it is yours)
    me = os.geteuid()
    child_uid = me
    while True:
        st = os.lstat(folder)
        why = None
        if st.st_uid not in (me, 0):
            why = f"owned by uid {st.st_uid}, not by you (uid {me}) or root"
        elif (st.st_mode & 0o002 or st.st_mode & 0o020 and not _own_group(st.st_gid)) and \
                not (st.st_mode & stat.S_ISVTX and child_uid in (me, 0)):
            why = f"writable by others (mode {stat.S_IMODE(st.st_mode):04o})"
        if why:
            from ..data.paths import CACHE_ENV   # lazily, as cache_dir: the plugin imports this module
            raise ValueError(f"folder {folder}: {why}: whoever can write it can replace the verified files "
                             f"latq-serve hands vLLM; set {CACHE_ENV} to a folder of yours that only you or root can "
                             "write, in folders that only you or root can write")
        if folder.parent == folder:
            return
        folder, child_uid = folder.parent, st.st_uid


def _own_group(gid: int) -> bool:
    """``gid`` is the caller's private group (a user-private-group system's umask 002 makes ~/.cache 0775):
    the caller's own group with no member but the caller, so group-writable is writable by the caller alone."""
    import grp
    import pwd
    if gid != os.getegid():
        return False
    try:
        return set(grp.getgrgid(gid).gr_mem) <= {pwd.getpwuid(os.geteuid()).pw_name}
    except KeyError:   # a group or user without an entry: no one known to share it
        return True


def _holds(d: Path, want: dict[str, bytes]) -> bool:
    """Whether ``d`` is a private directory of exactly the files ``want``, byte for byte, each yours alone."""
    try:
        st = os.lstat(d)
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        return False
    opened = OpenedDir(d, hold_all=False)
    try:
        entries = opened.entries()
        if sorted(e.name for e in entries) != sorted(want) or any(e.is_symlink() for e in entries):
            return False
        return all(_own_single(opened.file(n)) and opened.read(n, len(data)) == data for n, data in want.items())
    except (FormatError, OSError):
        return False
    finally:
        opened.close()


def _own_single(f) -> bool:
    """Whether the opened file is yours with one link (another user may change a file linked to theirs)."""
    st = os.fstat(f.fileno())
    return st.st_uid == os.geteuid() and st.st_nlink == 1


def _publish(tmp: Path, final: Path, want: dict[str, bytes]) -> None:
    """``tmp`` renamed to ``final``; one there already that is not ``want`` (edited, or half removed) replaced."""
    try:
        os.rename(tmp, final)
        return
    except OSError as e:
        if e.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
            raise
    if _holds(final, want):   # another latq-serve wrote the same copy meanwhile
        return
    stale = Path(tempfile.mkdtemp(prefix=".stale-", dir=final.parent))
    try:
        with contextlib.suppress(FileNotFoundError):   # another latq-serve's replacement may have moved it
            os.rename(final, stale / final.name)
        try:
            os.rename(tmp, final)
        except OSError:
            if not _holds(final, want):
                raise
    finally:
        shutil.rmtree(stale, ignore_errors=True)
