"""Edits of a safetensors file's JSON header, its tensor bytes untouched, and of a tensor's bytes,
its header untouched: what the fuzzers and the integrity tests do to a checkpoint's shards."""
from __future__ import annotations

import json


def read_header(raw: bytes) -> tuple[dict, int]:
    """(the parsed header, its length in bytes) of a safetensors file's ``raw`` bytes."""
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), n


def with_header(raw: bytes, n: int, header: dict) -> bytes:
    """``raw`` (whose header is ``n`` bytes long) with ``header`` in its place."""
    new = json.dumps(header, separators=(",", ":")).encode()
    return len(new).to_bytes(8, "little") + new + raw[8 + n:]


def edit_entry(header: dict, name: str, field: str, *, dtype=None, dims=None, delta: int = 0) -> None:
    """One edit of tensor ``name``'s header entry: dtype, shape, end, shift, drop or rename."""
    e = header[name]
    if field == "dtype":
        e["dtype"] = dtype
    elif field == "shape":
        e["shape"] = dims
    elif field == "end":
        e["data_offsets"] = [e["data_offsets"][0], e["data_offsets"][1] + delta]
    elif field == "shift":
        b, f = e["data_offsets"]
        e["data_offsets"] = [max(0, b + delta), max(0, f + delta)]
    elif field == "drop":
        del header[name]
    elif field == "rename":
        header[name + "x"] = header.pop(name)
    else:
        raise ValueError(f"unknown header edit {field!r}")


def edit_bytes_in_place(path, name: str, fn) -> None:
    """Overwrite tensor ``name``'s bytes in ``path`` with ``fn(tensor)``'s; the header and checksums stay."""
    import torch

    from ..format.safetensors_file import SafetensorsFile
    f = SafetensorsFile(path)
    old = f.get(name)
    new = fn(old.clone()).contiguous()
    if new.dtype != old.dtype or new.shape != old.shape:
        raise ValueError(f"{name}: an in-place edit keeps dtype and shape ({old.dtype} {tuple(old.shape)})")
    with open(path, "r+b") as fh:
        fh.seek(f.data_start + f.entries[name].begin)
        fh.write(new.reshape(-1).view(torch.uint8).numpy().tobytes())
