"""Where a served model keeps the CPU kernel's weights: copied at load, in load order, into large
arenas on transparent huge pages. A decode step streams every layer's weights once; on 4 KiB pages
the hardware prefetcher stops at each page and each page costs a TLB walk, and layers scattered in
memory restart its streams (docs/KERNELS.md, "Streaming the weights").
"""
from __future__ import annotations

import logging
import mmap
import threading

import torch

HUGE_PAGE = 2 << 20
CHUNK = 32 << 20       # one arena's bytes: many small layers share one
OWN_FROM = CHUNK // 8  # a tensor this large gets an arena of its own (bounds a chunk's unused tail)
ALIGN = 64             # each tensor starts on a cache line

log = logging.getLogger("vllm_latq")


def _huge_buffer(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] on fresh anonymous pages, starting on a huge page, its whole huge pages
    advised as such (Linux): each first touch then faults in a whole huge page at once — memory the
    heap had already touched in small pages would be left for khugepaged to collapse while the
    model serves. The slack in front and a partial last page stay untouched: no memory."""
    private = getattr(mmap, "MAP_PRIVATE", None)   # a shared mapping would be shmem, not THP's
    mm = (mmap.mmap(-1, nbytes + HUGE_PAGE, flags=private | mmap.MAP_ANONYMOUS) if private is not None
          else mmap.mmap(-1, nbytes + HUGE_PAGE))
    raw = torch.frombuffer(mm, dtype=torch.uint8)   # holds mm: unmapped when the last view goes
    start = -raw.data_ptr() % HUGE_PAGE
    whole = nbytes // HUGE_PAGE * HUGE_PAGE
    if whole and hasattr(mmap, "MADV_HUGEPAGE"):
        mm.madvise(mmap.MADV_HUGEPAGE, start, whole)
    return raw[start:start + nbytes]


class WeightArenas:
    """Bump allocation over huge-page chunks; a placed tensor is a view that keeps its chunk."""

    def __init__(self, chunk: int = CHUNK, own_from: int = OWN_FROM):
        self.chunk, self.own_from = chunk, own_from
        self._buf: torch.Tensor | None = None
        self._used = 0
        self._lock = threading.Lock()

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of ``t`` (contiguous, same dtype and shape) in the current arena; ``t`` itself
        where no mapping can be had (the layer then streams from where it is)."""
        nbytes = t.numel() * t.element_size()
        if nbytes == 0 or t.device.type != "cpu":
            return t
        try:
            if nbytes >= self.own_from:
                buf, off = _huge_buffer(nbytes), 0
            else:
                with self._lock:
                    if self._buf is None or self._used + nbytes > self._buf.numel():
                        self._buf, self._used = _huge_buffer(self.chunk), 0
                    buf, off = self._buf, self._used
                    self._used = -(-(off + nbytes) // ALIGN) * ALIGN
        except OSError as e:   # e.g. a mapping limit: an optimization, never a failed load
            log.warning("latq: no weight arena for a %d-byte tensor (%s); it stays where it is", nbytes, e)
            return t
        out = buf[off:off + nbytes].view(t.dtype).view(t.shape)
        out.copy_(t)
        return out


_ARENAS = WeightArenas()


def place(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` moved into this process's weight arenas (None stays None)."""
    return None if t is None else _ARENAS.place(t)
