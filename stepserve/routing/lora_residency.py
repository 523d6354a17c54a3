"""Which LoRAs a worker holds in its device memory: what a request brings is used most recently;
beyond `capacity`, the least recently used that no resident request uses go first. The worker's
`StoreLoras` keeps its LoRAs by it, the router core mirrors every worker with one (for LoRA-
affinity placement) and the simulator's workers keep one (to price bringing a LoRA)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class LoraResidency:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a worker holds at least one LoRA, got capacity {capacity}")
        self.capacity = capacity
        self._held: OrderedDict[tuple[str, str], None] = OrderedDict()  # (model, name), least recent first
        self._frozen: frozenset[tuple[str, str]] | None = frozenset()  # `held()`, until the next change

    def __contains__(self, key: tuple[str, str]) -> bool:
        return key in self._held

    def use(self, key: tuple[str, str]) -> bool:
        """Hold `key`, now the most recently used; whether it was held already."""
        held = key in self._held
        if held:
            self._held.move_to_end(key)
        else:
            self._held[key] = None
            self._frozen = None
        return held

    def trim(self, in_use: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
        """Drop the least recently used beyond capacity that are not `in_use`; returns them."""
        excess = len(self._held) - self.capacity
        if excess <= 0:
            return []
        keep = set(in_use)
        dropped = [k for k in self._held if k not in keep][:excess]
        for key in dropped:
            del self._held[key]
        self._frozen = None
        return dropped

    def bring(self, keys: Iterable[tuple[str, str]], in_use: Iterable[tuple[str, str]]) -> int:
        """`use` each of `keys`, then `trim`; returns how many of `keys` were not held."""
        missing = sum(not self.use(key) for key in keys)
        self.trim(in_use)
        return missing

    def held(self) -> frozenset[tuple[str, str]]:
        if self._frozen is None:
            self._frozen = frozenset(self._held)
        return self._frozen

    def clear(self) -> None:
        self._held.clear()
        self._frozen = frozenset()
