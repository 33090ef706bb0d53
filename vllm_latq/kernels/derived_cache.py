"""A cache of values derived from tensors, alive exactly as long as the tensors (the CPU
kernel's sparse CSR, its op scale pairs and its opt-in prefill weight)."""
from __future__ import annotations

import weakref

import torch


class DerivedCache:
    """Values derived from a layer's state tensors, built on first use and kept exactly as long
    as the source tensor lives. The state a call gets is rebuilt per custom-op call
    (``unflatten``), so the cache cannot live on it: entries are keyed by the source tensors'
    addresses and shapes, and dropped (``weakref.finalize``) when the first source tensor is
    freed — so dropping a layer frees them, and a freed address is never looked up again. An
    entry must not hold the source tensors themselves (that would keep them alive): alias them
    with ``detach()`` (a ``view`` keeps its base)."""

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
