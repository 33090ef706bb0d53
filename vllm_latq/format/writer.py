"""Writing a checkpoint's files other than the shards' contents: shard names, index, JSON, copied files."""
from __future__ import annotations

import json
import os
from pathlib import Path

from ..bounded_io import copy_regular
from .files import AUX_PATTERNS, INDEX_FILE, check_inside
from .safetensors_file import SafetensorsFile


MAX_AUX_BYTES = 256 << 20   # a tokenizer file: the largest real ones are tens of MiB


def shard_name(i: int, n: int) -> str:
    """File name of shard ``i`` (0-based) of ``n``, as Hugging Face names them."""
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def write_json(path: Path, obj) -> None:
    """Deterministic JSON (sorted keys, 2-space indent), written atomically."""
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(part, path)


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
