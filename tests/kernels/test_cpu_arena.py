"""The CPU kernel's weight arenas (``kernels/cpu/arena.py``): a served model's CPU states copied
at load, in load order, into huge-page chunks — the same values, laid out together."""
from __future__ import annotations

import sys
from dataclasses import fields, replace
from pathlib import Path

import pytest
import torch

from vllm_latq.format.rotation import Rotation
from vllm_latq.kernels.cpu import arena
from vllm_latq.kernels.cpu.kernel import CPUKernel
from vllm_latq.kernels.rotated import rotated_kernel
from vllm_latq.testing.weights import random_weight

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32, torch.float16, torch.bfloat16,
                                   torch.float32])
def test_place_copies_values_shape_and_dtype(dtype):
    src = (torch.randn(37, 5) * 100).to(dtype)
    out = arena.WeightArenas(chunk=1 << 20, own_from=1 << 18).place(src)
    assert out.dtype == dtype and out.shape == src.shape and out.is_contiguous()
    assert torch.equal(out, src) and out.data_ptr() != src.data_ptr()
    assert out.data_ptr() % arena.ALIGN == 0


def test_small_tensors_share_a_chunk_in_load_order_large_ones_get_their_own():
    a = arena.WeightArenas(chunk=1 << 20, own_from=1 << 18)
    first = [a.place(torch.full((1000,), i, dtype=torch.uint8)) for i in range(3)]
    assert len({_storage(t) for t in first}) == 1
    ptrs = [t.data_ptr() for t in first]
    assert ptrs == sorted(ptrs) and ptrs[1] - ptrs[0] == 1024 and ptrs[2] - ptrs[1] == 1024   # 64-byte steps
    assert first[0].data_ptr() % arena.HUGE_PAGE == 0
    big = a.place(torch.ones(1 << 18, dtype=torch.uint8))
    assert _storage(big) not in {_storage(t) for t in first} and big.data_ptr() % arena.HUGE_PAGE == 0
    after = a.place(torch.ones(10, dtype=torch.int32))   # the chunk goes on after a large tensor
    assert _storage(after) == _storage(first[0]) and after.data_ptr() == ptrs[2] + 1024
    filler = [a.place(torch.ones(200_000, dtype=torch.uint8)) for _ in range(12)]   # past one huge page: a new chunk
    assert _storage(filler[-1]) != _storage(first[0])
    assert all(int(t[0]) == i for i, t in enumerate(first))   # earlier views keep their values as the arena moves on


@pytest.mark.skipif(not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
                    reason="transparent huge pages are off here")
def test_chunks_are_on_huge_pages():
    a = arena.WeightArenas()
    t = a.place(torch.ones(1 << 20, dtype=torch.uint8))
    base = t.data_ptr()
    for line in Path("/proc/self/smaps").read_text().split("\n"):
        head = line.split(" ", 1)[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= base < hi
        elif inside and line.startswith("AnonHugePages:"):
            assert int(line.split()[1]) >= arena.HUGE_PAGE // 1024, line
            return
    pytest.fail("the arena's mapping is not in /proc/self/smaps")


@pytest.mark.parametrize("bits,rate", [(4, 0.0), (3, 0.02), (8, 0.0)])
def test_placed_cpu_state_computes_the_same(bits, rate):
    """CPUKernel.place moves every tensor of the state (weights, scales, outliers) into the
    arenas; apply's output is bit-identical."""
    w = random_weight(192, 256, bits, rate, group=64, seed=bits)
    st = CPUKernel.prepare(w)
    x = torch.randn(3, 256).to(torch.bfloat16)
    want = [CPUKernel.apply(st, x[:m]) for m in (1, 3)]
    before = {f.name: getattr(st, f.name) for f in fields(st)}
    CPUKernel.place(st)
    moved = [f.name for f in fields(st) if isinstance(before[f.name], torch.Tensor)]
    assert moved and len({_storage(getattr(st, n)) for n in moved}) == 1
    for n in moved:
        assert torch.equal(getattr(st, n), before[n]) and _storage(getattr(st, n)) != _storage(before[n])
    assert all(torch.equal(CPUKernel.apply(st, x[:m]), y) for m, y in zip((1, 3), want))


def test_rotated_state_places_its_inner_state():
    k = rotated_kernel(CPUKernel)
    st = k.prepare(replace(random_weight(64, 128, 4, 0.0, group=64, seed=3), rotation=Rotation(0).signs(128)))
    x = torch.randn(1, 128).to(torch.bfloat16)
    want, packed = k.apply(st, x), st.inner.packed
    k.place(st)
    assert _storage(st.inner.packed) != _storage(packed) and torch.equal(k.apply(st, x), want)


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux's /proc")
def test_arenas_commit_only_what_they_hold():
    """A fresh 32 MiB chunk holding 100 KB commits one huge page, a 5 MiB tensor's own buffer its
    5 MiB: the alignment slack, the chunk's untouched rest and a partial last page stay virtual."""
    small, big = torch.ones(100_000, dtype=torch.uint8), torch.ones(5 << 20, dtype=torch.uint8)
    arena.WeightArenas().place(small)   # the first call's one-time costs, outside the measurement
    a = arena.WeightArenas()
    grown = []
    for t in (small, big):
        before = _rss()
        held = a.place(t)
        grown.append(_rss() - before)
        assert torch.equal(held, t)
    assert grown[0] <= arena.HUGE_PAGE + (256 << 10), grown      # the chunk's first huge page
    assert big.numel() <= grown[1] <= big.numel() + (256 << 10), grown   # its last partial page in small ones


def test_without_a_mapping_the_tensor_stays_and_says_so(monkeypatch, caplog):
    def refuse(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")
    monkeypatch.setattr(arena.mmap, "mmap", refuse)
    t = torch.ones(1000, dtype=torch.int32)
    with caplog.at_level("WARNING", logger="vllm_latq"):
        assert arena.WeightArenas().place(t) is t
    assert "no weight arena for a 4000-byte tensor" in caplog.text and "stays where it is" in caplog.text
