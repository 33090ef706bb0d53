"""A cache of values derived from tensors, alive exactly as long as the tensors (the CPU
kernel's sparse CSR, its op scale pairs and its opt-in prefill weight)."""
from __future__ import annotations

import weakref

import torch


class DerivedCache:
    """Values derived from a layer's state tensors, kept exactly as long as the source tensor lives:
    keyed by the sources' addresses and shapes (the state is rebuilt per op call) and dropped by
    ``weakref.finalize``. An entry must not hold the source itself: alias it with ``detach()``."""

    def __init__(self):
        self.entries: dict[tuple, object] = {}

    def get(self, sources: tuple[torch.Tensor, ...], build):
        key = tuple((t.data_ptr(), tuple(t.shape)) for t in sources)
        hit = self.entries.get(key)
        if hit is None:
            hit = self.entries[key] = build()
            weakref.finalize(sources[0], self.entries.pop, key, None)
        return hit

    def clear(self) -> None:
        self.entries.clear()
