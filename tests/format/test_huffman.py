"""Tests for vllm_latq.format.huffman (length-limited canonical Huffman, chunked)."""

import heapq
import itertools
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_latq.format.huffman import (
    CHUNK,
    MAX_CODE_LEN,
    HuffmanCode,
    HuffmanStream,
    code_lengths,
    coded_bits,
    decode,
    encode,
)

SETTINGS = settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])

# ----------------------------------------------------------------------------
# references (slow, obviously correct)


def ref_huffman_lengths(counts):
    """Textbook unlimited Huffman with heapq; a single symbol gets length 1."""
    if len(counts) == 1:
        return [1]
    depth = [0] * len(counts)
    tie = itertools.count()
    heap = [(c, next(tie), [i]) for i, c in enumerate(counts)]
    heapq.heapify(heap)
    while len(heap) > 1:
        ca, _, a = heapq.heappop(heap)
        cb, _, b = heapq.heappop(heap)
        for s in a + b:
            depth[s] += 1
        heapq.heappush(heap, (ca + cb, next(tie), a + b))
    return depth


def brute_force_cost(counts, max_len):
    """Minimum sum(count*length) over all length vectors obeying Kraft and the limit."""
    best = None
    for ls in itertools.product(range(1, max_len + 1), repeat=len(counts)):
        if sum(2.0**-l for l in ls) <= 1:
            cost = sum(c * l for c, l in zip(counts, ls))
            best = cost if best is None else min(best, cost)
    return best


def ref_bits(z, code):
    """The stream as a '0'/'1' string, built symbol by symbol from the code table."""
    table = {
        int(s): format(int(c), f"0{int(l)}b")
        for s, c, l in zip(code.symbols, code.codes, code.lengths)
    }
    return "".join(table[int(v)] for v in np.asarray(z).reshape(-1))


def stream_bits(stream):
    return "".join(map(str, np.unpackbits(stream.data)))


def cost(counts, lengths):
    return int(np.dot(np.asarray(counts, np.int64), np.asarray(lengths, np.int64)))


# ----------------------------------------------------------------------------
# data generators

DISTS = ["uniform", "student_t", "geometric", "constant", "wide", "two"]


def make_ints(seed, shape, dist, dtype=np.int32):
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    if dist == "uniform":
        z = rng.integers(-8, 9, n)
    elif dist == "student_t":  # mostly small with a thin tail
        z = np.round(rng.standard_t(2.5, n) * 3)
    elif dist == "geometric":  # very skewed, signed
        z = rng.geometric(0.6, n) * rng.choice([-1, 1], n)
    elif dist == "constant":
        z = np.full(n, rng.choice([-7, 0, 5, -(2**31), 2**31 - 1]))
    elif dist == "wide":  # huge sparse range: exercises the non-table paths
        z = rng.choice([-(2**31), -5, 0, 3, 2**31 - 1, 2**30], n)
    else:
        z = rng.choice([-1, 1], n)
    info = np.iinfo(dtype)
    return np.clip(z, info.min, info.max).astype(dtype).reshape(shape)


shapes = st.lists(st.integers(0, 70), min_size=1, max_size=3).filter(
    lambda s: int(np.prod(s)) <= 9000
) | st.sampled_from([(1,), (CHUNK,), (CHUNK + 1,), (3, CHUNK - 1), (2, 2, CHUNK)])


# ----------------------------------------------------------------------------
# round trips


@SETTINGS
@given(
    seed=st.integers(0, 2**32 - 1),
    shape=shapes,
    dist=st.sampled_from(DISTS),
    dtype=st.sampled_from([np.int8, np.int16, np.int32, np.int64, np.uint8]),
)
def test_roundtrip_and_coded_bits(seed, shape, dist, dtype):
    z = make_ints(seed, shape, dist, dtype)
    s = encode(z)
    out = decode(s)
    assert out.dtype == np.int32 and out.shape == (z.size,)
    np.testing.assert_array_equal(out, z.reshape(-1).astype(np.int64))
    assert coded_bits(z) == s.total_bits
    # bit-exact layout against a symbol-by-symbol reference encoder
    if z.size <= 3000:
        ref = ref_bits(z, s.code)
        bits = stream_bits(s)
        assert bits[: len(ref)] == ref and set(bits[len(ref) :]) <= {"0"}
        assert len(bits) == 8 * -(-len(ref) // 8)


def test_bit_accounting_formula():
    z = make_ints(1, (3, CHUNK + 5), "student_t")
    s = encode(z)
    sym, cnt = np.unique(z, return_counts=True)
    payload = cost(cnt, code_lengths(cnt))
    assert s.payload_bits == payload == s.code.payload_bits(
        cnt[np.searchsorted(sym, s.code.symbols)]
    )
    nchunks = -(-z.size // CHUNK)
    assert s.chunk_bits.dtype == np.uint16 and s.chunk_bits.size == nchunks
    assert s.code.codebook_bits == 40 * sym.size
    expected = 8 * -(-payload // 8) + 40 * sym.size + 16 * nchunks
    assert s.total_bits == expected == coded_bits(z)


def test_empty():
    s = encode(np.zeros((0, 4), np.int32))
    assert s.numel == 0 and s.data.size == 0 and s.chunk_bits.size == 0
    assert decode(s).size == 0 and s.total_bits == coded_bits(np.zeros(0, np.int64)) == 0


def test_golden_bits():
    code = HuffmanCode(np.array([7, -3, 5]), np.array([2, 1, 2]))
    # canonical: -3 -> 0, 5 -> 10, 7 -> 11
    assert code.symbols.tolist() == [-3, 5, 7] and code.codes.tolist() == [0, 2, 3]
    s = encode(np.array([-3, 5, 7, 7, -3]), code)
    assert stream_bits(s) == "01011110" and s.chunk_bits.tolist() == [8]
    assert decode(s).tolist() == [-3, 5, 7, 7, -3]


def test_torch_input():
    torch = pytest.importorskip("torch")
    z = torch.randint(-20, 20, (37, 101), dtype=torch.int64)
    np.testing.assert_array_equal(decode(encode(z)), z.numpy().reshape(-1))
    assert coded_bits(z) == encode(z).total_bits


def test_rejects_non_integer_and_out_of_range():
    with pytest.raises(TypeError):
        encode(np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="int32"):
        encode(np.array([2**31], np.int64))


def test_given_code_and_missing_symbol():
    code = HuffmanCode.fit(np.arange(-10, 11))
    z = make_ints(3, (50, 40), "uniform")
    np.testing.assert_array_equal(decode(encode(z, code)), z.reshape(-1))
    z[7, 3] = 11
    with pytest.raises(ValueError, match="symbol 11 "):
        encode(z, code)
    with pytest.raises(ValueError, match="symbol -123 "):
        encode(np.array([0, -123]), HuffmanCode(np.array([0, 2**31 - 1]), np.array([1, 1])))


# ----------------------------------------------------------------------------
# code lengths


counts_st = st.lists(st.integers(1, 10**6), min_size=1, max_size=300)


@SETTINGS
@given(counts=counts_st)
def test_code_lengths_valid_and_optimal(counts):
    ls = code_lengths(np.array(counts))
    assert ls.dtype == np.uint8 and ls.shape == (len(counts),)
    assert ls.min() >= 1 and ls.max() <= MAX_CODE_LEN
    kraft = sum(2.0 ** -int(l) for l in ls)
    assert kraft <= 1 and (len(counts) == 1 or kraft == 1)  # complete code
    ref = ref_huffman_lengths(counts)
    if max(ref) <= MAX_CODE_LEN:  # limit not binding: must match unlimited Huffman
        assert cost(counts, ls) == cost(counts, ref)


@SETTINGS
@given(
    counts=st.lists(st.integers(1, 1000), min_size=1, max_size=6),
    max_len=st.integers(1, 4),
)
def test_code_lengths_limited_optimal_bruteforce(counts, max_len):
    if len(counts) > 2**max_len:
        with pytest.raises(ValueError):
            code_lengths(np.array(counts), max_len)
        return
    ls = code_lengths(np.array(counts), max_len)
    assert ls.max() <= max_len and sum(2.0 ** -int(l) for l in ls) <= 1
    assert cost(counts, ls) == brute_force_cost(counts, max_len)


def fib_counts(n):
    f = [1, 1]
    while len(f) < n:
        f.append(f[-1] + f[-2])
    return np.array(f)


@pytest.mark.parametrize("n", [18, 25, 40, 300])
def test_code_lengths_limit_binding(n):
    counts = np.concatenate([fib_counts(min(n, 40)), np.ones(max(0, n - 40), np.int64)])
    ref = ref_huffman_lengths(counts.tolist())
    assert max(ref) > MAX_CODE_LEN  # the limit really binds here
    ls = code_lengths(counts)
    assert ls.max() == MAX_CODE_LEN
    assert sum(2.0 ** -int(l) for l in ls) == 1
    assert cost(counts, ls) >= cost(counts, ref)


def test_skewed_geometric_stream_is_limited():
    # P(|z| = k) = 2^-k: the unlimited code would need ~20-bit codes.
    rng = np.random.default_rng(5)
    z = rng.geometric(0.5, 1 << 20) * rng.choice([-1, 1], 1 << 20)
    s = encode(z)
    sym, cnt = np.unique(z, return_counts=True)
    assert max(ref_huffman_lengths(cnt.tolist())) > MAX_CODE_LEN
    assert s.code.lengths.max() == MAX_CODE_LEN
    np.testing.assert_array_equal(decode(s), z)
    assert coded_bits(z) == s.total_bits


def test_code_lengths_edge_cases():
    assert code_lengths(np.array([5])).tolist() == [1]
    assert code_lengths(np.array([1, 100])).tolist() == [1, 1]
    assert code_lengths(np.array([], np.int64)).size == 0
    assert (code_lengths(np.ones(1 << MAX_CODE_LEN, np.int64)) == MAX_CODE_LEN).all()
    with pytest.raises(ValueError, match="exceed"):
        code_lengths(np.ones((1 << MAX_CODE_LEN) + 1, np.int64))
    for bad in ([3, 0, 1], [2, -1], [1.5, 2.0]):
        with pytest.raises(ValueError):
            code_lengths(np.array(bad))


# ----------------------------------------------------------------------------
# canonical codes


@SETTINGS
@given(counts=counts_st, seed=st.integers(0, 2**31))
def test_canonical_property(counts, seed):
    syms = np.random.default_rng(seed).choice(np.arange(-5000, 5000), len(counts), replace=False)
    code = HuffmanCode.from_counts(syms, np.array(counts))
    l = code.lengths.astype(np.int64)
    c = code.codes.astype(np.int64)
    order = np.lexsort((code.symbols, code.lengths))
    assert (order == np.arange(len(order))).all()  # stored in (length, symbol) order
    assert c[0] == 0 and (c < (1 << l)).all()
    assert (c[1:] == (c[:-1] + 1) << (l[1:] - l[:-1])).all()  # canonical recurrence
    # prefix-free: left-aligned codes cover disjoint 16-bit intervals
    lo = c << (MAX_CODE_LEN - l)
    assert (lo[1:] >= lo[:-1] + (1 << (MAX_CODE_LEN - l[:-1]))).all()
    # the code only depends on the (symbol, length) pairs, not their input order
    perm = np.random.default_rng(seed).permutation(len(counts))
    assert HuffmanCode(code.symbols[perm], code.lengths[perm]) == code


def test_code_validation():
    with pytest.raises(ValueError, match="Kraft"):
        HuffmanCode(np.array([1, 2, 3]), np.array([1, 1, 2]))
    with pytest.raises(ValueError, match="distinct"):
        HuffmanCode(np.array([1, 1]), np.array([1, 1]))
    for bad_len in (0, MAX_CODE_LEN + 1):
        with pytest.raises(ValueError, match="lengths"):
            HuffmanCode(np.array([1, 2]), np.array([1, bad_len]))
    code = HuffmanCode(np.array([1, 2]), np.array([1, 1]))
    with pytest.raises(ValueError):
        code.symbols[0] = 5  # frozen arrays


# ----------------------------------------------------------------------------
# chunks


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("delta", [-1, 0, 1])
def test_chunk_boundaries(k, delta):
    n = k * CHUNK + delta
    z = make_ints(k * 10 + delta, (n,), "student_t")
    s = encode(z)
    assert s.numel == n and s.chunk_bits.size == -(-n // CHUNK)
    lens = dict(zip(s.code.symbols.tolist(), s.code.lengths.tolist()))
    per_symbol = np.array([lens[v] for v in z.tolist()])
    sums = [per_symbol[i : i + CHUNK].sum() for i in range(0, n, CHUNK)]
    assert s.chunk_bits.tolist() == sums
    off = s.chunk_offsets()
    assert off.dtype == np.int64
    assert off.tolist() == np.concatenate([[0], np.cumsum(sums)[:-1]]).tolist()
    np.testing.assert_array_equal(decode(s), z)
    # each chunk starts at its offset: the bits there are exactly its symbols' codes
    bits = stream_bits(s)
    for i, o in enumerate(off):
        part = z[i * CHUNK : (i + 1) * CHUNK]
        assert bits[o : o + sums[i]] == ref_bits(part, s.code)


# ----------------------------------------------------------------------------
# corruption


def sample_stream(seed=0, n=3 * CHUNK + 17, dist="student_t"):
    return encode(make_ints(seed, (n,), dist))


@SETTINGS
@given(seed=st.integers(0, 1000), bit=st.integers(0, 10**9), dist=st.sampled_from(DISTS))
def test_flipped_bit_never_silently_same(seed, bit, dist):
    # Without a checksum a flip may parse validly, but then the output must differ.
    s = sample_stream(seed, n=CHUNK + 300, dist=dist)
    z = decode(s)
    data = s.data.copy()
    i = bit % (8 * data.size)
    data[i // 8] ^= np.uint8(0x80 >> (i % 8))
    try:
        out = decode(replace(s, data=data))
    except ValueError:
        return
    assert not np.array_equal(out, z)


@pytest.mark.parametrize("i", [0, 1, 4000, -1])
def test_flipped_bit_single_symbol_detected(i):
    s = encode(np.full(CHUNK + 5, -4))  # code "0": any 1 bit is an invalid code word
    data = s.data.copy()
    bit = i % s.payload_bits
    data[bit // 8] ^= np.uint8(0x80 >> (bit % 8))
    with pytest.raises(ValueError):
        decode(replace(s, data=data))


def test_flipped_padding_bit_detected():
    s = sample_stream()
    if s.payload_bits % 8 == 0:
        s = sample_stream(n=3 * CHUNK + 18)
    assert s.payload_bits % 8
    data = s.data.copy()
    data[-1] ^= np.uint8(1)
    with pytest.raises(ValueError, match="padding"):
        decode(replace(s, data=data))


@pytest.mark.parametrize("cut", [1, 2, 100])
def test_truncated_or_extended_data(cut):
    s = sample_stream()
    with pytest.raises(ValueError, match="bytes"):
        decode(replace(s, data=s.data[:-cut]))
    with pytest.raises(ValueError, match="bytes"):
        decode(replace(s, data=np.concatenate([s.data, np.zeros(cut, np.uint8)])))


@SETTINGS
@given(chunk=st.integers(0, 3), delta=st.integers(-200, 200).filter(bool), seed=st.integers(0, 50))
def test_wrong_chunk_bits(chunk, delta, seed):
    s = sample_stream(seed)
    cb = s.chunk_bits.astype(np.int64)
    # keep the total unchanged, so only the per-chunk decode check can catch it
    cb[chunk] += delta
    cb[(chunk + 1) % cb.size] -= delta
    if cb.min() < 0:
        return
    with pytest.raises(ValueError, match=f"chunk {min(chunk, (chunk + 1) % cb.size)} decodes"):
        decode(replace(s, chunk_bits=cb.astype(np.uint16)))


def test_wrong_chunk_count_and_numel():
    s = sample_stream()
    with pytest.raises(ValueError, match="chunk"):
        decode(replace(s, chunk_bits=s.chunk_bits[:-1]))
    with pytest.raises(ValueError):
        decode(replace(s, chunk_bits=np.concatenate([s.chunk_bits, [0]]).astype(np.uint16)))
    for d in (-1, 1, -17, CHUNK, -CHUNK):
        with pytest.raises(ValueError):
            decode(replace(s, numel=s.numel + d))


def test_wrong_code_detected():
    s = sample_stream()
    other = HuffmanCode.fit(make_ints(9, (5000,), "uniform"))
    with pytest.raises(ValueError):
        decode(replace(s, code=other))
    with pytest.raises(ValueError):
        decode(replace(s, data=s.data.astype(np.int16)))


# ----------------------------------------------------------------------------
def test_roundtrip_4m_heavy_tailed():
    """A layer-sized, heavy-tailed (Student-t) integer matrix: 4M symbols decode exactly, and the
    cost model (coded_bits) agrees with the stream's length."""
    rng = np.random.default_rng(0)
    z = np.round(rng.standard_t(3, (2000, 2000)) * 2).astype(np.int32)
    s = encode(z)
    np.testing.assert_array_equal(decode(s), z.reshape(-1))
    assert coded_bits(z) == s.total_bits
