"""Our strict reader (a :class:`~vllm_latq.format.FormatError` naming file and tensor, never a panic)
and deterministic writer of ``.safetensors`` files, with a per-tensor sha256 table."""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator

import torch

from ..bounded_io import open_regular, parse_json, pread_into, pread_pieces
from ..errors import FormatError, limits, writing

CHECKSUM_KEY = "latq_sha256"
# each tensor's dtype and shape as written, so an edit of the header alone (the bytes untouched,
# their meaning changed) is refused like an edit of the bytes; absent in files written before it
LAYOUT_KEY = "latq_layouts"
MAX_HEADER = 100 << 20  # a safetensors header larger than this is corrupt

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
_ITEMSIZE = {k: torch.empty(0, dtype=v).element_size() for k, v in _DTYPES.items()}


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes safetensors stores for ``t``: a view, not a copy."""
    t = t.detach().cpu().contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


PIECE_BYTES = 16 << 20  # a stored tensor is copied in pieces of this size


@dataclass(frozen=True)
class StoredTensor:
    """Tensor ``name`` of a safetensors ``file``, copied by pieces (read, not mapped: RSS stays flat), with ``sha256``
    if the bytes copied must have it."""
    file: "SafetensorsFile"
    name: str
    sha256: str | None = None

    def pieces(self, size: int = PIECE_BYTES) -> Iterator[memoryview]:
        return self.file.pieces(self.name, size)


def write_safetensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor | StoredTensor],
                      metadata: dict[str, str] | None = None) -> str:
    """Write a safetensors file with a ``latq_sha256`` table, atomically → the whole file's sha256.
    Our own serializer: the library orders metadata keys by a randomized hash map."""
    path = Path(path)
    values = {k: v if isinstance(v, StoredTensor) else v.detach().cpu().contiguous() for k, v in sorted(tensors.items())}
    meta = {"format": "pt", **(metadata or {})}
    header: dict = {}
    sums = {}
    off = 0
    for k, v in values.items():
        dtype, shape = _layout(k, v)
        h, n = hashlib.sha256(), 0
        for b in _pieces(v):
            h.update(b)
            n += len(b)
        if isinstance(v, StoredTensor) and v.sha256 is not None and h.hexdigest() != v.sha256:
            raise FormatError("sha256 mismatch: the bytes read are not those written (edited or corrupted)",
                              file=v.file.name, tensor=v.name)
        header[k] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + n]}
        sums[k] = h.hexdigest()
        off += n
    meta[CHECKSUM_KEY] = json.dumps(sums, sort_keys=True, separators=(",", ":"))
    meta[LAYOUT_KEY] = json.dumps({k: _layout_text(e["dtype"], e["shape"]) for k, e in header.items()},
                                  sort_keys=True, separators=(",", ":"))
    header = {"__metadata__": dict(sorted(meta.items())), **header}
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    part = path.with_name(path.name + ".part")
    whole = hashlib.sha256()

    def put(b) -> int:
        whole.update(b)
        return f.write(b)
    try:
        with writing(path), part.open("wb") as f:
            put(struct.pack("<Q", len(raw)))
            put(raw)
            for k, v in values.items():
                h, n = hashlib.sha256(), 0
                for b in _pieces(v):
                    h.update(b)
                    n += put(b)
                begin, end = header[k]["data_offsets"]
                if n != end - begin or h.hexdigest() != sums[k]:
                    where = {"file": v.file.name, "tensor": v.name} if isinstance(v, StoredTensor) else {"tensor": k}
                    raise FormatError("changed between its two reads (hashed, then copied): edited while read", **where)
        with writing(path):
            os.replace(part, path)
    except BaseException:
        part.unlink(missing_ok=True)   # a full disk gets its space back
        raise
    return whole.hexdigest()


def _layout_text(dtype: str, shape) -> str:
    return f"{dtype}{list(shape)}".replace(" ", "")


def _layout(name: str, v: torch.Tensor | StoredTensor) -> tuple[str, list[int]]:
    if isinstance(v, StoredTensor):
        return _DTYPE_NAMES[v.file.dtype(v.name)], list(v.file.shape(v.name))
    if v.dtype not in _DTYPE_NAMES:
        raise TypeError(f"{name}: dtype {v.dtype} cannot be stored")
    return _DTYPE_NAMES[v.dtype], list(v.shape)


def _pieces(v: torch.Tensor | StoredTensor):
    return v.pieces() if isinstance(v, StoredTensor) else (tensor_bytes(v),)


@dataclass(frozen=True)
class _Entry:
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


class SafetensorsFile:
    """A strict reader of one ``.safetensors`` file: header checked on open, tensors read on demand, all
    from one descriptor (opened once, or ``file``), by position: what it verifies is what it reads."""

    def __init__(self, path: str | os.PathLike, display: str | None = None, *, file: BinaryIO | None = None):
        self.path = Path(path)
        self.name = display or self.path.name
        self._file = file if file is not None else open_regular(self.path, name=self.name)
        try:
            size = os.fstat(self._file.fileno()).st_size
            head = bytearray(8)
            if pread_into(self._file, head, 0) < 8:
                raise self._err(f"truncated: {size} bytes, too short for a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > min(MAX_HEADER, size - 8):
                raise self._err(f"header length {n} exceeds the file ({size} bytes): truncated or corrupt")
            raw = bytearray(n)
            if pread_into(self._file, raw, 8) < n:
                raise self._err("truncated while reading its header")
        except OSError as e:
            raise self._err(f"cannot read: {e}") from None
        try:
            header = parse_json(bytes(raw), name=self.name)
        except FormatError as e:
            why = str(e).removeprefix(f"file {self.name}: ")
            raise self._err(f"header is {why}" if why.startswith("not ") else f"header: {why}") from None
        if not isinstance(header, dict):
            raise self._err("header is not a JSON object")
        self.header_sha256 = hashlib.sha256(bytes(head) + bytes(raw)).hexdigest()   # what latq_manifest.json records
        self.data_start = 8 + n
        self.data_len = size - self.data_start
        meta = header.pop("__metadata__", {})
        if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
            raise self._err("__metadata__ must map strings to strings")
        self.metadata: dict[str, str] = meta
        self.entries: dict[str, _Entry] = {}
        for name, e in header.items():
            self.entries[name] = self._entry(name, e)
        spans = sorted((e.begin, e.end, k) for k, e in self.entries.items() if e.end > e.begin)
        for (b0, e0, k0), (b1, e1, k1) in zip(spans, spans[1:]):
            if b1 < e0:
                raise self._err(f"data of tensors {k0} and {k1} overlap", k1)
        covered = spans[-1][1] if spans else 0
        if covered != self.data_len:   # size must be 8 + header + data, as the safetensors library requires
            raise self._err(f"{self.data_len - covered} bytes after the tensors' data, which ends with this one's "
                            f"(the file is {size} bytes, 8 + {n} of header + {covered} of data)",
                            spans[-1][2] if spans else None)
        self._checksums: dict[str, str] | None = None

    def close(self) -> None:
        self._file.close()

    def _err(self, what: str, tensor: str | None = None) -> FormatError:
        return FormatError(what, file=self.name, tensor=tensor)

    def _entry(self, name: str, e) -> _Entry:
        if not isinstance(e, dict):
            raise self._err("header entry is not an object", name)
        dtype, shape, offs = e.get("dtype"), e.get("shape"), e.get("data_offsets")
        if dtype not in _DTYPES:
            raise self._err(f"unsupported dtype {dtype!r}", name)
        if (not isinstance(shape, list) or len(shape) > 8
                or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**40 for d in shape)):
            raise self._err(f"invalid shape {shape!r}", name)
        if (not isinstance(offs, list) or len(offs) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)):
            raise self._err(f"invalid data_offsets {offs!r}", name)
        begin, end = offs
        nbytes = math.prod(shape) * _ITEMSIZE[dtype]
        if not 0 <= begin <= end:
            raise self._err(f"invalid data_offsets {offs!r}", name)
        if end - begin != nbytes:
            raise self._err(f"shape {tuple(shape)} {dtype} needs {nbytes} bytes, data_offsets span {end - begin}",
                            name)
        if end > self.data_len:
            raise self._err(f"truncated: data ends at byte {end}, the file holds {self.data_len} data bytes", name)
        return _Entry(dtype, tuple(shape), begin, end)

    # ---------------------------------------------------------------- access

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def names(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name].shape

    def dtype(self, name: str) -> torch.dtype:
        return _DTYPES[self.entries[name].dtype]

    def raw(self, name: str) -> bytes:
        e = self._entry_of(name)
        return bytes(self._read(name, e.begin, e.end - e.begin).numpy())

    def get(self, name: str, verify: bool = False) -> torch.Tensor:
        """The tensor (a fresh CPU tensor that owns its memory); with ``verify``, :meth:`verify`'s checks on these bytes."""
        e = self._entry_of(name)
        buf = self._read(name, e.begin, e.end - e.begin)
        if verify:
            want = self._checksum_of(name)
            self.check_layout(name)
            if hashlib.sha256(buf.numpy()).hexdigest() != want:
                raise self._err("sha256 mismatch: the bytes read are not those written (edited or corrupted)", name)
        return buf.view(_DTYPES[e.dtype]).reshape(e.shape)

    def stored(self, name: str, verify: bool = False) -> StoredTensor:
        """The tensor as a :class:`StoredTensor`, its bytes checked as copied with ``verify``."""
        self._entry_of(name)
        if verify:
            self.check_layout(name)
        return StoredTensor(self, name, self._checksum_of(name) if verify else None)

    def pieces(self, name: str, size: int = PIECE_BYTES) -> Iterator[memoryview]:
        """The tensor's bytes in pieces of at most ``size`` bytes, one buffer reused."""
        e = self._entry_of(name)
        try:
            yield from pread_pieces(self._file, self.data_start + e.begin, e.end - e.begin, size)
        except EOFError:
            raise self._err("truncated while reading", name) from None
        except OSError as err:
            raise self._err(f"cannot read: {err}", name) from None

    def get_rows(self, name: str, index: int, rows: slice) -> torch.Tensor:
        """``tensor[index, rows]`` of a 3-D tensor (one expert's rows), read alone."""
        e = self._entry_of(name)
        if len(e.shape) != 3 or not 0 <= index < e.shape[0] or not 0 <= rows.start <= rows.stop <= e.shape[1]:
            raise self._err(f"no rows [{index}, {rows.start}:{rows.stop}] in a tensor of shape {tuple(e.shape)}", name)
        dtype = _DTYPES[e.dtype]
        row = e.shape[2] * dtype.itemsize
        start = e.begin + (index * e.shape[1] + rows.start) * row
        return self._read(name, start, (rows.stop - rows.start) * row).view(dtype).reshape(
            rows.stop - rows.start, e.shape[2])

    def _entry_of(self, name: str) -> _Entry:
        if name not in self.entries:
            raise self._err("missing", name)
        return self.entries[name]

    def _read(self, name: str, begin: int, nbytes: int) -> torch.Tensor:
        with limits(f"reading tensor {name} ({nbytes} bytes) of {self.path}"):
            buf = torch.empty(nbytes, dtype=torch.uint8, device="cpu")  # read straight into it: one copy
        try:
            got = pread_into(self._file, buf.numpy(), self.data_start + begin)
        except OSError as err:
            raise self._err(f"cannot read: {err}", name) from None
        if got != nbytes:
            raise self._err("truncated while reading", name)
        return buf

    @property
    def checksums(self) -> dict[str, str] | None:
        """{tensor: sha256} from the metadata, or None when the file has none."""
        if self._checksums is None and CHECKSUM_KEY in self.metadata:
            try:
                c = parse_json(self.metadata[CHECKSUM_KEY], name=self.name)
            except FormatError:
                c = None
            if not isinstance(c, dict) or not all(isinstance(v, str) for v in c.values()):
                raise self._err(f"metadata {CHECKSUM_KEY} is not a JSON object of hex digests")
            self._checksums = c
        return self._checksums

    def verify(self, name: str, value_limit: float | None = None) -> None:
        """Raise unless the tensor's layout and bytes are as written (with ``value_limit``: its values bounded).
        A file without a checksum table is refused: nothing would catch an edit of it."""
        want = self._checksum_of(name)
        self.check_layout(name)
        h = hashlib.sha256()
        largest = self._scan(name, h, value_limit is not None)
        if h.hexdigest() != want:
            raise self._err("sha256 mismatch: the tensor's bytes are corrupted", name)
        self._bound(name, largest, value_limit)

    def _checksum_of(self, name: str) -> str:
        sums = self.checksums
        if sums is None:
            raise self._err(f"no {CHECKSUM_KEY} checksum table in the metadata: not written by latq, or "
                            "edited (--no-verify reads it unchecked)")
        if name not in sums:
            raise self._err(f"no checksum recorded in {CHECKSUM_KEY}", name)
        return sums[name]

    def check_values(self, name: str, limit: float) -> None:
        """Raise unless every value of the floating-point tensor is finite and within ``±limit``, by pieces."""
        self._bound(name, self._scan(name, None, True), limit)

    def _scan(self, name: str, h, values: bool) -> float | None:
        """One pass over the tensor's bytes into ``h``; with ``values`` → its largest magnitude (NaN if any)."""
        dtype = self.dtype(name)
        largest = 0.0 if values and dtype.is_floating_point else None
        for piece in self.pieces(name):
            if h is not None:
                h.update(piece)
            if largest is not None and len(piece) and not math.isnan(largest):
                m = torch.frombuffer(piece, dtype=dtype).abs().amax().item()
                largest = m if math.isnan(m) else max(largest, m)
        return largest

    def _bound(self, name: str, largest: float | None, limit: float | None) -> None:
        if limit is None or largest is None:
            return
        if not math.isfinite(largest):
            raise self._err("has NaN/Inf values", name)
        if largest > limit:
            raise self._err(f"has values up to {largest:g}, beyond ±{limit:g} (fp16's range: a model may be served "
                            "in fp16)", name)

    def check_layout(self, name: str) -> None:
        """Raise unless the tensor's dtype and shape are those :data:`LAYOUT_KEY` records (if recorded)."""
        written = self.layouts.get(name) if self.layouts is not None else None
        e = self._entry_of(name)
        if written is not None and written != _layout_text(e.dtype, e.shape):
            raise self._err(f"header says {_layout_text(e.dtype, e.shape)}, the tensor was written as {written}: "
                            "the header was edited", name)

    @functools.cached_property
    def layouts(self) -> dict[str, str] | None:
        """{tensor: "DTYPE[shape]"} as written (:data:`LAYOUT_KEY`), or None in older files; parsed once."""
        if LAYOUT_KEY not in self.metadata:
            return None
        try:
            v = parse_json(self.metadata[LAYOUT_KEY], name=self.name)
        except FormatError:
            v = None
        if not isinstance(v, dict):
            raise self._err(f"metadata {LAYOUT_KEY} is not a JSON object")
        return v
