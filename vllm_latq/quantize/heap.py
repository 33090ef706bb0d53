"""glibc's heap during a run: large tensors mapped on their own and free pages returned after each
block, so the peak RSS does not creep up from block to block. No effect without glibc."""
from __future__ import annotations

import ctypes
import functools

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def return_freed_memory() -> None:
    """Serve every allocation of 32 MiB or more by its own mmap (glibc's threshold would adapt upwards).
    Smaller ones (a sequence's activations) stay on the heap: a fresh mapping would fault in every forward."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, 1 << 25)


def trim() -> None:
    """Return the heap's free pages to the OS once a block is done (the freed weights fragment it)."""
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
