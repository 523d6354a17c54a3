"""Which LoRAs a worker holds in its device memory, kept as the worker's `StoreLoras` keeps them:
what a request brings is used most recently; beyond `capacity`, the least recently used that no
resident request uses go first. The router core mirrors every worker with one (for LoRA-affinity
placement) and the simulator's workers keep one (to price bringing a LoRA)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class LoraResidency:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a worker holds at least one LoRA, got capacity {capacity}")
        self.capacity = capacity
        self._held: OrderedDict[tuple[str, str], None] = OrderedDict()  # (model, name), least recent first

    def bring(self, keys: Iterable[tuple[str, str]], in_use: Iterable[tuple[str, str]]) -> int:
        """Hold `keys` (now the most recently used), then drop the least recently used beyond
        capacity that are not `in_use`; returns how many of `keys` were not held."""
        missing = 0
        for key in keys:
            if key in self._held:
                self._held.move_to_end(key)
            else:
                self._held[key] = None
                missing += 1
        excess = len(self._held) - self.capacity
        if excess > 0:
            keep = set(in_use)
            for key in [k for k in self._held if k not in keep][:excess]:
                del self._held[key]
        return missing

    def held(self) -> frozenset[tuple[str, str]]:
        return frozenset(self._held)

    def clear(self) -> None:
        self._held.clear()
