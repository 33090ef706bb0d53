"""Length-limited canonical Huffman coding of integer matrices (HPTQ's kind; docs/FORMAT.md), cut
into chunks of ``CHUNK`` symbols that decode independently."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

MAX_CODE_LEN = 16  # decoders peek 16 bits and use a 2^16-entry lookup table
CHUNK = 2048  # symbols per chunk; 2048 * 16 bits = 32768 fits a uint16
_TABLE_SIZE = 1 << MAX_CODE_LEN
_BLOCK = 1 << 20  # symbols per vectorised encode/histogram block (multiple of CHUNK)
_LUT_SPAN = 1 << 22  # widest symbol range mapped by a direct-indexed lookup table
_LANES = 2048  # chunks decoded together (one vector lane each)
_I32 = np.iinfo(np.int32)


# ----------------------------------------------------------------------------
# code lengths


def code_lengths(counts, max_len: int = MAX_CODE_LEN) -> np.ndarray:
    """Optimal prefix-code lengths (uint8, each ≤ ``max_len``) for positive ``counts``: package-merge."""
    w = np.asarray(counts)
    if w.ndim != 1:
        raise ValueError(f"counts must be 1-D, got shape {w.shape}")
    n = w.size
    if n and (w.dtype.kind not in "iu" or w.min() <= 0):
        raise ValueError("counts must be positive integers")
    if not 1 <= max_len <= MAX_CODE_LEN:
        raise ValueError(f"max_len must be in [1, {MAX_CODE_LEN}], got {max_len}")
    if n > 1 << max_len:
        raise ValueError(f"{n} distinct symbols exceed 2^{max_len} codes of length <= {max_len}")
    if n <= 2:
        return np.ones(n, np.uint8)
    order = np.argsort(w, kind="stable")
    leaves = w[order].astype(np.int64)
    # Level lists from deepest up; keep only which positions are leaves, since
    # the leaves in every list appear in sorted order (a prefix gets selected).
    is_leaf = [np.ones(n, bool)]
    cur = leaves
    for _ in range(max_len - 1):
        pk = cur[0 : cur.size - 1 : 2] + cur[1 : cur.size : 2]  # pair adjacent items
        # Linear merge by rank; leaves go before equal-weight packages.
        leaf_pos = np.arange(n) + np.searchsorted(pk, leaves, side="left")
        pk_pos = np.arange(pk.size) + np.searchsorted(leaves, pk, side="right")
        cur = np.empty(n + pk.size, np.int64)
        cur[leaf_pos], cur[pk_pos] = leaves, pk
        flags = np.zeros(cur.size, bool)
        flags[leaf_pos] = True
        is_leaf.append(flags)
    # Take the 2n-2 cheapest items of the top list; each selected package pulls
    # in two items of the list below. A leaf's length = levels selecting it.
    depth = np.zeros(n, np.int64)
    m = 2 * n - 2
    for flags in reversed(is_leaf):
        k = int(np.count_nonzero(flags[:m]))
        depth[:k] += 1
        m = 2 * (m - k)
    assert m == 0
    out = np.empty(n, np.uint8)
    out[order] = depth
    return out


def _histogram(flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sorted distinct symbols int32, counts int64) of a flat int32 array."""
    if flat.size == 0:
        return np.empty(0, np.int32), np.empty(0, np.int64)
    lo, hi = int(flat.min()), int(flat.max())
    span = hi - lo + 1
    if span > _LUT_SPAN:  # very wide range: sort instead of a huge count array
        sym, cnt = np.unique(flat, return_counts=True)
        return sym.astype(np.int32), cnt.astype(np.int64)
    cnt = np.zeros(span, np.int64)
    for s in range(0, flat.size, _BLOCK):  # blocks bound bincount's intp temporaries
        cnt += np.bincount(flat[s : s + _BLOCK] - np.int32(lo), minlength=span)
    present = np.flatnonzero(cnt)
    return (present + lo).astype(np.int32), cnt[present]


def _flat_ints(z) -> np.ndarray:
    """Flatten ``z`` (ndarray or torch tensor) row-major to int32, checking range."""
    if hasattr(z, "detach"):  # torch tensor, without importing torch
        z = z.detach().cpu().numpy()
    a = np.asarray(z)
    if a.dtype.kind not in "iu":
        raise TypeError(f"expected an integer array, got dtype {a.dtype}")
    flat = a.reshape(-1)
    if flat.size and a.dtype.itemsize >= 4 and a.dtype != np.int32:
        lo, hi = int(flat.min()), int(flat.max())
        if lo < _I32.min or hi > _I32.max:
            bad = lo if lo < _I32.min else hi
            raise ValueError(f"symbol {bad} does not fit in int32")
    return flat.astype(np.int32, copy=False)


def _readonly(a: np.ndarray) -> np.ndarray:
    a = np.array(a)  # private copy, so freezing cannot affect the caller's array
    a.flags.writeable = False
    return a


def _payload(counts: np.ndarray, lengths: np.ndarray) -> int:
    return int(np.dot(np.asarray(counts, np.int64), lengths.astype(np.int64)))


def stored_bits(payload_bits: int, nsym: int, numel: int) -> int:
    """Stored size in bits: padded payload + codebook + chunk table."""
    return 8 * (-(-payload_bits // 8)) + 40 * nsym + 16 * (-(-numel // CHUNK))


# ----------------------------------------------------------------------------
# the code


@dataclass(frozen=True, eq=False)
class HuffmanCode:
    """A canonical prefix code: ``symbols[i]`` has code length ``lengths[i]``.
    Construction validates lengths, distinct symbols and Kraft, so codebooks read from disk are checked."""

    symbols: np.ndarray  # int32
    lengths: np.ndarray  # uint8

    def __post_init__(self):
        sym, ln = np.asarray(self.symbols), np.asarray(self.lengths)
        if sym.ndim != 1 or ln.shape != sym.shape:
            raise ValueError(f"symbols {sym.shape} and lengths {ln.shape} must be equal 1-D")
        if sym.size and (sym.dtype.kind not in "iu" or ln.dtype.kind not in "iu"):
            raise ValueError("symbols and lengths must be integers")
        if sym.size > _TABLE_SIZE:
            raise ValueError(f"{sym.size} symbols exceed 2^{MAX_CODE_LEN}")
        if sym.size and (sym.min() < _I32.min or sym.max() > _I32.max):
            raise ValueError("symbols must fit in int32")
        if sym.size and (ln.min() < 1 or ln.max() > MAX_CODE_LEN):
            raise ValueError(f"code lengths must be in [1, {MAX_CODE_LEN}]")
        sym, ln = sym.astype(np.int32), ln.astype(np.uint8)
        order = np.lexsort((sym, ln))
        sym, ln = sym[order], ln[order]
        if np.unique(sym).size != sym.size:
            raise ValueError("symbols must be distinct")
        kraft = int(np.sum(np.left_shift(1, MAX_CODE_LEN - ln.astype(np.int64))))
        if kraft > _TABLE_SIZE:
            raise ValueError(f"code lengths violate Kraft: sum 2^-l = {kraft / _TABLE_SIZE} > 1")
        object.__setattr__(self, "symbols", _readonly(sym))
        object.__setattr__(self, "lengths", _readonly(ln))

    def __eq__(self, other):
        if not isinstance(other, HuffmanCode):
            return NotImplemented
        return np.array_equal(self.symbols, other.symbols) and np.array_equal(
            self.lengths, other.lengths
        )

    __hash__ = None  # mutable-looking numpy fields; equality is by value

    @classmethod
    def from_counts(cls, symbols, counts) -> "HuffmanCode":
        """Optimal length-limited code for ``symbols`` occurring ``counts`` times."""
        return cls(np.asarray(symbols), code_lengths(np.asarray(counts)))

    @classmethod
    def fit(cls, z) -> "HuffmanCode":
        """Optimal length-limited code for the histogram of integer array ``z``."""
        return cls.from_counts(*_histogram(_flat_ints(z)))

    @property
    def nsym(self) -> int:
        return int(self.symbols.size)

    @functools.cached_property
    def _starts(self) -> np.ndarray:
        """Each code left-aligned to MAX_CODE_LEN bits = exclusive Kraft cumsum (int64)."""
        span = np.left_shift(1, MAX_CODE_LEN - self.lengths.astype(np.int64))
        return np.cumsum(span) - span

    @functools.cached_property
    def codes(self) -> np.ndarray:
        """Canonical code values (uint32), the low ``lengths[i]`` bits are the code."""
        return _readonly(
            (self._starts >> (MAX_CODE_LEN - self.lengths.astype(np.int64))).astype(np.uint32)
        )

    @functools.cached_property
    def decode_table(self) -> tuple[np.ndarray, np.ndarray]:
        """(symbol index int32, length uint8) for every 16-bit window; -1/0 if invalid."""
        span = np.left_shift(1, MAX_CODE_LEN - self.lengths.astype(np.int64))
        idx = np.full(_TABLE_SIZE, -1, np.int32)
        fill = int(span.sum())
        idx[:fill] = np.repeat(np.arange(self.nsym, dtype=np.int32), span)
        ln = np.zeros(_TABLE_SIZE, np.uint8)
        ln[:fill] = self.lengths[idx[:fill]]
        return _readonly(idx), _readonly(ln)

    def payload_bits(self, counts) -> int:
        """Exact payload bits for ``counts[i]`` occurrences of ``symbols[i]``."""
        counts = np.asarray(counts)
        if counts.shape != self.symbols.shape:
            raise ValueError(f"counts shape {counts.shape} != symbols shape {self.symbols.shape}")
        return _payload(counts, self.lengths)

    @property
    def codebook_bits(self) -> int:
        """Bits to store the codebook: int32 symbol + uint8 length per symbol."""
        return self.nsym * (32 + 8)

    def index_of(self, flat: np.ndarray) -> np.ndarray:
        """Canonical index of every symbol in ``flat``; ValueError naming the first one not in the code."""
        if flat.size == 0:
            return np.empty(0, np.int32)
        if self.nsym == 0:
            raise ValueError(f"symbol {int(flat[0])} is not in the code (empty code)")
        lo, hi = int(self.symbols.min()), int(self.symbols.max())
        if hi - lo < _LUT_SPAN:  # direct-indexed lookup table; -1 marks gaps
            lut = np.full(hi - lo + 1, -1, np.int32)
            lut[self.symbols.astype(np.int64) - lo] = np.arange(self.nsym, dtype=np.int32)
            off = flat.astype(np.int64) - lo
            ok = (off >= 0) & (off <= hi - lo)
            idx = np.where(ok, lut[np.where(ok, off, 0)], -1)
        else:  # very wide symbol range: binary search
            srt = np.argsort(self.symbols)
            pos = np.minimum(np.searchsorted(self.symbols[srt], flat), self.nsym - 1)
            idx = np.where(self.symbols[srt][pos] == flat, srt[pos], -1).astype(np.int32)
        if idx.min() < 0:
            bad = int(flat[np.argmax(idx < 0)])
            raise ValueError(f"symbol {bad} is not in the code")
        return idx


def coded_bits(z) -> int:
    """``encode(z).total_bits`` from the histogram alone (no bit stream is built)."""
    flat = _flat_ints(z)
    sym, cnt = _histogram(flat)
    return stored_bits(_payload(cnt, code_lengths(cnt)), sym.size, flat.size)


# ----------------------------------------------------------------------------
# the stream


@dataclass(eq=False)
class HuffmanStream:
    """A Huffman-coded flat symbol sequence, decodable chunk by chunk."""

    code: HuffmanCode
    data: np.ndarray  # uint8, MSB-first bit stream, zero-padded to a whole byte
    chunk_bits: np.ndarray  # uint16, bit length of each chunk of CHUNK symbols
    numel: int

    def chunk_offsets(self) -> np.ndarray:
        """Start bit of every chunk (int64, exclusive cumsum of ``chunk_bits``)."""
        cb = np.asarray(self.chunk_bits, np.int64)
        return np.cumsum(cb) - cb

    @property
    def payload_bits(self) -> int:
        """Exact payload bits (without the byte padding)."""
        return int(np.sum(self.chunk_bits, dtype=np.int64))

    @property
    def total_bits(self) -> int:
        """Stored bits: padded payload + codebook + one uint16 per chunk."""
        return 8 * int(np.asarray(self.data).size) + self.code.codebook_bits + 16 * int(
            np.asarray(self.chunk_bits).size
        )


def encode(z, code: HuffmanCode | None = None) -> HuffmanStream:
    """Huffman-code integer array ``z`` (any shape, row-major) with ``code`` or a fitted one."""
    flat = _flat_ints(z)
    if code is None:
        code = HuffmanCode.fit(flat)
    n = flat.size
    lengths = code.lengths.astype(np.int64)
    codes = code.codes.astype(np.uint64)
    chunk_bits = np.empty(-(-n // CHUNK), np.int64)
    parts, start = [], 0  # per block: (first word, its 32-bit words)
    for b in range(0, n, _BLOCK):
        idx = code.index_of(flat[b : b + _BLOCK])
        ln, cv = lengths[idx], codes[idx]
        end = np.cumsum(ln)
        pos = start + end - ln
        chunk_bits[b // CHUNK : -(-(b + idx.size) // CHUNK)] = np.add.reduceat(
            ln, np.arange(0, idx.size, CHUNK)
        )
        # Left-align each code in a 64-bit window starting at its 32-bit word:
        # the high half lands in word w, the low half spills into w+1. Codes
        # occupy disjoint bits, so OR-ing them into words is an exact sum.
        w, r = pos >> 5, (pos & 31).astype(np.uint64)
        win = cv << (np.uint64(64) - r - ln.astype(np.uint64))
        rel = w - w[0]
        nw = int(rel[-1]) + 2
        acc = np.bincount(rel, weights=win >> np.uint64(32), minlength=nw)
        acc += np.bincount(rel + 1, weights=win & np.uint64(0xFFFFFFFF), minlength=nw)
        parts.append((int(w[0]), acc.astype(np.uint64)))  # < 2^32: exact in float64
        start += int(end[-1])
    words = np.zeros(start // 32 + 2, np.uint64)
    for w0, acc in parts:
        words[w0 : w0 + acc.size] += acc  # blocks share at most a boundary word
    data = words.astype(">u4").view(np.uint8)[: -(-start // 8)].copy()
    return HuffmanStream(code, data, chunk_bits.astype(np.uint16), n)


def _decode_lanes(tables, pos: np.ndarray, tail: int) -> np.ndarray:
    """Decode CHUNK symbols in every lane from bit offsets ``pos`` (advanced in place); -1 if invalid."""
    win, tab_idx, tab_len = tables
    last_byte = win.size - 1  # clamp so corrupt lanes that run past the end stay in bounds
    out = np.empty((CHUNK, pos.size), np.int32)
    for t in range(CHUNK):
        lanes = pos.size if t < tail else pos.size - 1
        if lanes == 0:
            break
        p = pos[:lanes]
        peek = (win[np.minimum(p >> 3, last_byte)] >> (8 - (p & 7))) & 0xFFFF
        out[t, :lanes] = tab_idx[peek]
        p += tab_len[peek]
    return out.T


def decode(stream: HuffmanStream) -> np.ndarray:
    """Decode ``stream`` to a flat int32 array; ValueError if corrupt.
    Chunks decode together as vector lanes through a 2^16-entry table, so corrupt input cannot hang."""
    code, n = stream.code, int(stream.numel)
    data = np.asarray(stream.data)
    cb = np.asarray(stream.chunk_bits)
    if data.dtype != np.uint8 or data.ndim != 1:
        raise ValueError(f"data must be 1-D uint8, got {data.dtype} {data.shape}")
    if cb.dtype.kind not in "iu" or cb.ndim != 1 or (cb.size and cb.min() < 0):
        raise ValueError(f"chunk_bits must be 1-D non-negative integers, got {cb.dtype} {cb.shape}")
    nchunks = -(-n // CHUNK)
    if n < 0 or cb.size != nchunks:
        raise ValueError(f"{cb.size} chunk lengths but numel {n} needs {nchunks}")
    offsets = np.asarray(stream.chunk_offsets(), np.int64)
    nbits = int(cb.sum(dtype=np.int64))
    if data.size != -(-nbits // 8):  # also catches truncation
        raise ValueError(f"chunk lengths sum to {nbits} bits but the stream has {data.size} bytes")
    if nbits % 8 and data[-1] & ((1 << (8 - nbits % 8)) - 1):
        raise ValueError("nonzero padding bits after the payload")
    if n == 0:
        return np.empty(0, np.int32)
    if code.nsym == 0:
        raise ValueError(f"numel {n} but the code has no symbols")
    tab_idx, tab_len = code.decode_table
    # win[i] = bytes i..i+2 as a 24-bit value: any 16-bit window starting in byte i.
    d = np.concatenate([data, np.zeros(3, np.uint8)]).astype(np.int32)
    win = (d[:-2] << 16) | (d[1:-1] << 8) | d[2:]
    tables = (win, tab_idx, tab_len.astype(np.int64))
    idx = np.empty(nchunks * CHUNK, np.int32)
    pos = offsets.copy()
    # Lane groups keep the per-step working set cache-sized.
    for g in range(0, nchunks, _LANES):
        stop = min(g + _LANES, nchunks)
        tail = n - (nchunks - 1) * CHUNK if stop == nchunks else CHUNK
        lanes = _decode_lanes(tables, pos[g:stop], tail)  # advances pos in place
        idx[g * CHUNK : stop * CHUNK].reshape(-1, CHUNK)[:] = lanes
    ends = offsets + cb
    bad = np.flatnonzero(pos != ends)
    if bad.size:
        k = int(bad[0])
        raise ValueError(
            f"chunk {k} decodes to {int(pos[k] - offsets[k])} bits, chunk_bits says {int(cb[k])}"
        )
    idx = idx[:n]
    if idx.min() < 0:  # belt and braces: a stalled lane already fails the check above
        k = int(np.argmax(idx < 0))
        raise ValueError(f"invalid code word at symbol {k} (chunk {k // CHUNK})")
    return code.symbols[idx]
