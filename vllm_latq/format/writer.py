"""Writing a checkpoint's files other than the shards' contents: shard names, index, JSON, copied files."""
from __future__ import annotations

import json
import os
from pathlib import Path

from ..bounded_io import copy_regular
from ..errors import reason, writing
from .files import AUX_PATTERNS, INDEX_FILE, check_inside
from .safetensors_file import SafetensorsFile


MAX_AUX_BYTES = 256 << 20   # a tokenizer file: the largest real ones are tens of MiB
PROBE_BYTES = 4096          # written where an output will go, before the work: a full disk refuses it


def shard_name(i: int, n: int) -> str:
    """File name of shard ``i`` (0-based) of ``n``, as Hugging Face names them."""
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def write_json(path: Path, obj) -> None:
    """Deterministic JSON (sorted keys, 2-space indent), written atomically."""
    write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_text(path: str | os.PathLike, text: str) -> None:
    """``text`` as UTF-8 at ``path``, atomically: a failed write leaves no part and names ``path``."""
    path = Path(path)
    part = path.with_name(path.name + ".part")
    try:
        with writing(path):
            part.write_text(text, encoding="utf-8")
            os.replace(part, path)
    except BaseException:
        part.unlink(missing_ok=True)
        raise


def check_writable(path: str | os.PathLike, what: str) -> None:
    """Refuse, before any work, a file ``path`` that could not be written: a device, its folder missing,
    read-only or full (a probe of a few KiB is written there and removed)."""
    path = Path(path)
    folder = path.parent
    if path.is_dir():
        raise ValueError(f"{what} {path} is a directory: name a file")
    if path.exists() and not path.is_file():   # the atomic rename would replace a device (/dev/null) itself
        raise ValueError(f"{what} {path} is not a regular file (a device, pipe or socket): name a file")
    if not folder.is_dir():
        raise ValueError(f"{what} {path}: its folder {folder} " + ("is not a directory" if folder.exists()
                                                                   else "does not exist"))
    probe = folder / f".{path.name}.latq-probe-{os.getpid()}"
    try:
        try:
            with open(probe, "wb") as f:
                f.write(bytes(PROBE_BYTES))
                f.flush()
                os.fsync(f.fileno())
        finally:
            probe.unlink(missing_ok=True)
    except OSError as e:
        raise ValueError(f"{what} {path} cannot be written: {reason(e, path)}") from None


def write_index(out: Path, shards: list[str]) -> None:
    """``model.safetensors.index.json`` from the shard files' headers."""
    wm, total = {}, 0
    for s in shards:
        f = SafetensorsFile(out / s)
        for n in f.names():
            wm[n] = s
            e = f.entries[n]
            total += e.end - e.begin
    write_json(out / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": dict(sorted(wm.items()))})


def aux_files(src: Path) -> list[str]:
    """The tokenizer, chat-template and generation files of ``src`` a checkpoint carries; links out refused."""
    names = sorted({p.name for pat in AUX_PATTERNS for p in src.glob(pat) if p.is_symlink() or not p.is_dir()})
    for n in names:
        check_inside(src, src / n, "the source model's directory", name=str(src / n))
    return names


def copy_aux_files(src: Path, out: Path) -> list[str]:
    """Copy :func:`aux_files` of ``src`` into ``out``, regular files of bounded size only → their names."""
    names = aux_files(src)
    for n in names:
        copy_regular(src / n, out / n, limit=MAX_AUX_BYTES, name=str(src / n))
    return names
