"""The directory ``OUT`` a command writes a checkpoint to: what it may replace, its lock, its temporary, and a
replace a kill interrupted (docs/ARCHITECTURE.md). Nothing is deleted that latq did not make."""
from __future__ import annotations

import logging
import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from ..errors import FormatError, writing
from ..hf_model import config_dict
from .files import MANIFEST_FILE, TEMP_MARK
from .manifest import digest_of, read_manifest, unsealed_entries, verify_manifest
from .output_lock import LOCK_SUFFIX, DirLock, LockFile, holder, holder_note, lock_file, write_note  # noqa: F401
from .safetensors_file import SafetensorsFile

OLD_SUFFIX = ".old-latq"          # the checkpoint being replaced, for the instant of the swap
COMMANDS = ("latq-quantize", "latq-export")   # the commands that seal a directory and may replace it

log = logging.getLogger("vllm_latq.output")
Stage = Callable[[str], None]     # called as a replace reaches each stage (test hooks)


def _nothing(stage: str) -> None:
    pass


def absolute(out: str | os.PathLike) -> Path:
    """``out`` as an absolute path, refusing one with no name to put a temporary beside (``/``)."""
    p = Path(os.path.abspath(out))
    if not p.name:
        raise ValueError(f"{out}: not a directory latq can write (it has no name to put OUT.tmp-latq beside)")
    return p


def check_place(out: Path, sources: Iterable[Path]) -> None:
    """Refuse an ``out`` that is a link, a source, holds one or lies inside one (nothing read yet)."""
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


def check_out(out: Path, sources: Iterable[Path], overwrite: bool, made_by: str) -> None:
    """Refuse an ``out`` that command ``made_by`` must not write or replace (a link, a source, ...)."""
    check_place(out, sources)
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


def sealed_digest(d: Path, made_by: str | None = None) -> str | None:
    """The digest of ``d`` if it is a complete checkpoint ``made_by`` (None: any latq command) sealed, else None."""
    if d.is_symlink() or not d.is_dir() or not os.path.lexists(d / MANIFEST_FILE):
        return None
    try:
        maker = made_by or read_manifest(d)["made_by"]
        return digest_of(d) if maker in COMMANDS and why_not_replaceable(d, maker) is None else None
    except FormatError:
        return None


def make_temporary(tmp: Path, made_by: str) -> None:
    """``tmp`` made, or a leftover one latq made emptied in place (its lock stays valid), and marked."""
    with writing(tmp):   # a full disk names the directory, not only the errno
        if os.path.lexists(tmp):
            _check_temporary(tmp, made_by)
            clear_temporary(tmp, made_by)
        else:
            tmp.mkdir(parents=True)
        mark_temporary(tmp, made_by)


def mark_temporary(tmp: Path, made_by: str) -> None:
    write_note(tmp / TEMP_MARK, holder_note(made_by))


def unmark_temporary(tmp: Path) -> None:
    """The temporary directory is about to be sealed: the mark is not part of the checkpoint."""
    (tmp / TEMP_MARK).unlink(missing_ok=True)


def is_marked(d: Path) -> bool:
    return (d / TEMP_MARK).is_file() and not (d / TEMP_MARK).is_symlink()


def _check_temporary(tmp: Path, made_by: str) -> None:
    """Refuse, naming it, a ``tmp`` latq did not make (a link, a file, a directory without its mark)."""
    if tmp.is_symlink() or not tmp.is_dir():
        raise ValueError(f"{tmp} exists and is not a directory latq made: remove or rename it yourself")
    if not is_marked(tmp) and why_not_replaceable(tmp, made_by) is not None:
        raise ValueError(f"{tmp} exists and is not a temporary directory latq made (no {TEMP_MARK}): remove or "
                         "rename it yourself")


def clear_temporary(d: Path, made_by: str, at: Stage = _nothing, stage: str | None = None) -> None:
    """Empty latq's ``d`` but for its mark, written first (a removal cut short leaves it latq's), the seal first."""
    try:
        mark_temporary(d, made_by)
    except OSError:
        pass   # a read-only checkpoint: its files cannot be removed either, which the unlink below says
    entries = sorted(os.scandir(d), key=lambda e: (e.name != MANIFEST_FILE, e.name))
    for i, e in enumerate(x for x in entries if x.name != TEMP_MARK):
        if e.is_dir(follow_symlinks=False):
            shutil.rmtree(e.path)
        else:
            os.unlink(e.path)
        if i == 0 and stage is not None:
            at(stage)


def remove_temporary(tmp: Path, made_by: str, at: Stage = _nothing, stage: str | None = None) -> None:
    """Remove a leftover temporary ``tmp`` if latq made it; refuse anything else, naming it."""
    if not os.path.lexists(tmp):
        return
    _check_temporary(tmp, made_by)
    clear_temporary(tmp, made_by, at, stage)
    (tmp / TEMP_MARK).unlink(missing_ok=True)
    tmp.rmdir()


def _rename(src: Path, dst: Path, what: str) -> None:
    """``src`` renamed to ``dst``; a refusal of the file system names the folder and what stays where."""
    try:
        os.replace(src, dst)
    except OSError as e:
        raise ValueError(f"{dst}: cannot move {src} there ({e.strerror}): is the folder {dst.parent} writable? "
                         f"{what}") from None


def replace_with(tmp: Path, out: Path, sources: Iterable[Path], made_by: str, at: Stage = _nothing) -> None:
    """Move the sealed ``tmp`` to ``out`` if :func:`check_out` allows it now; ``at(stage)`` at each stage."""
    sources = list(sources)
    kept = f"the sealed checkpoint stays complete in {tmp}: rerun the command once the folder is writable"
    at("sealed")
    if not os.path.lexists(out):
        _rename(tmp, out, kept)
        return
    check_out(out, sources, overwrite=True, made_by=made_by)
    old = out.with_name(out.name + OLD_SUFFIX)
    remove_temporary(old, made_by)
    with DirLock(out, f"{out} is being replaced by another run"):   # the lock follows it to OUT.old-latq
        _rename(out, old, f"{out} is unchanged; " + kept)
        at("aside")
        try:
            _rename(tmp, out, f"{out} was put back; " + kept)
        except BaseException:
            os.replace(old, out)
            raise
        at("replaced")
        _discard(old, made_by, at)


def _discard(old: Path, made_by: str, at: Stage = _nothing) -> None:
    """Remove the replaced checkpoint ``old`` (latq's, known); one that cannot be removed is left, said in the log."""
    try:
        mark_temporary(old, made_by)   # another latq command's checkpoint too
        remove_temporary(old, made_by, at, "removing-old")
    except OSError as e:
        log.warning("%s: the checkpoint it replaced stays in %s, which latq could not remove (%s): remove it "
                    "yourself", old.with_name(old.name.removesuffix(OLD_SUFFIX)), old, e)


def _recover(out: Path, tmp: Path, made_by: str, journal: dict | None) -> str | None:
    """Finish or undo a replace a kill interrupted (``OUT.old-latq`` left beside OUT) → what was done."""
    old = out.with_name(out.name + OLD_SUFFIX)
    if not os.path.lexists(old):
        return None
    busy = f"{out} is being replaced by another run"
    with DirLock(old, busy), DirLock(out, busy), DirLock(tmp, busy):
        if old.is_symlink() or not old.is_dir() or not (is_marked(old) or sealed_digest(old)
                                                         or not any(os.scandir(old))):
            raise ValueError(f"{old} exists and is not a checkpoint latq moved aside: remove or rename it yourself")
        if is_marked(old):
            _discard(old, made_by)
            return f"removed what was left of {old}, the checkpoint an interrupted --overwrite replaced"
        if os.path.lexists(out):
            if not sealed_digest(out):
                raise ValueError(f"{old} holds the checkpoint an interrupted --overwrite moved aside, and {out} is not "
                                 f"a sealed latq checkpoint: nothing was changed; keep the one you want as {out} and "
                                 "remove the other")
            _discard(old, made_by)
            return (f"finished the replace an interrupted --overwrite began: {out} is the new checkpoint, and the "
                    f"one it replaced ({old}) is removed")
        new = sealed_digest(tmp, made_by)
        if new and (journal is None or journal.get("digest") == new):
            _rename(tmp, out, f"the new checkpoint stays in {tmp} and the replaced one in {old}")
            _discard(old, made_by)
            return (f"finished the replace an interrupted --overwrite began: moved its sealed checkpoint {tmp} to "
                    f"{out} and removed the one it replaced ({old})")
        _rename(old, out, f"the checkpoint an interrupted --overwrite moved aside stays in {old}")
        return (f"restored {out} from {old}, where an interrupted --overwrite had moved it aside (the new checkpoint "
                "was not complete)")


@dataclass
class Claim:
    """``out`` held by this run (:func:`exclusive`), with its run directory ``tmp``."""
    out: Path
    tmp: Path
    made_by: str
    lock: LockFile
    run_dir: DirLock

    @property
    def journal(self) -> dict | None:
        """The checkpoint a run killed on OUT had sealed: {"digest", "fingerprint"} (None: nothing noted)."""
        return self.lock.journal

    def noted(self, where: Path, fingerprint: str) -> bool:
        """Whether ``where`` (``tmp`` or ``out``) holds the checkpoint a killed run of ``fingerprint`` sealed."""
        j = self.journal
        return j is not None and j["fingerprint"] == fingerprint and sealed_digest(where, self.made_by) == j["digest"]

    def note_sealed(self, digest: str, fingerprint: str) -> None:
        """The run directory is sealed: recorded in the lock file until it is moved into place."""
        self.lock.note({"digest": digest, "fingerprint": fingerprint})

    def forget_journal(self) -> None:
        """The run directory is made anew: what a killed run had sealed there is gone."""
        self.lock.note()

    def replace(self, sources: Iterable[Path], at: Stage = _nothing) -> None:
        """The sealed run directory moved to OUT (:func:`replace_with`)."""
        replace_with(self.tmp, self.out, sources, self.made_by, at)
        self.lock.note()


def _hold_run_dir(tmp: Path, out: Path, made_by: str) -> DirLock:
    """``tmp`` locked for the run, made (and marked) if missing; held by another run → refused naming it."""
    while True:
        made = not os.path.lexists(tmp)
        if made:
            try:
                tmp.mkdir()
            except FileExistsError:
                continue
            mark_temporary(tmp, made_by)
        elif tmp.is_symlink() or not tmp.is_dir():
            _check_temporary(tmp, made_by)
        lock = DirLock(tmp, f"{out} is being written by another run ({holder(tmp / TEMP_MARK)}; its run directory "
                            f"{tmp} is locked): wait for it to finish or choose another OUT").take()
        if lock.same():
            return lock
        lock.release()   # removed or replaced between our look and our lock: again


def _drop_unused(lock: DirLock) -> None:
    """Remove the run directory if it still holds nothing but its mark (a run that stopped before writing)."""
    try:
        if lock.same() and {e.name for e in os.scandir(lock.path)} <= {TEMP_MARK}:
            (lock.path / TEMP_MARK).unlink(missing_ok=True)
            lock.path.rmdir()
    except OSError:
        pass   # a folder made read-only meanwhile: an empty directory latq marked, removed by the next run


@contextmanager
def exclusive(out: Path, command: str, tmp: Path, sources: Iterable[Path] = (), overwrite: bool = True):
    """Hold ``out`` for the body → :class:`Claim` (``OUT.latq-lock`` and the run directory ``tmp`` locked); a
    replace a kill interrupted is finished or undone first, said in the log; then :func:`check_out`."""
    sources = list(sources)
    check_place(out, sources)
    with lock_file(out, command) as lock:
        recovered = _recover(out, tmp, command, lock.journal)
        if recovered:
            log.warning("%s: %s", out, recovered)
        check_out(out, sources, overwrite, command)
        run_dir = _hold_run_dir(tmp, out, command)
        try:
            yield Claim(out, tmp, command, lock, run_dir)
        finally:
            _drop_unused(run_dir)
            run_dir.release()
