"""glibc's heap during a quantization run: large tensors mapped and unmapped on their own, and
the heap's free pages returned after each block, so the peak RSS follows what a block holds
and does not creep up from block to block. Elsewhere (no glibc) nothing changes."""
from __future__ import annotations

import ctypes
import functools

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def return_freed_memory() -> None:
    """Have glibc serve every allocation of 32 MiB or more by its own mmap, returned to the OS
    when freed (its default threshold adapts upwards after the first such free). Smaller
    allocations (a sequence's activations and their temporaries) stay on the heap: a fresh
    mapping each would be page-faulted in at every forward."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, 1 << 25)


def trim() -> None:
    """Return the heap's free pages to the OS once a block is done: a small model's weights
    come from the heap too, and without it the freed ones fragment and the peak RSS creeps up
    from block to block (``tests/test_bench_memory.py``)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


@functools.cache
def _glibc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None
