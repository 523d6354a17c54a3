"""The event heap: callbacks ordered by time, ties broken by scheduling order.

Ties are common (a round ends at the same instant another request becomes ready; many idle
workers wake at once), so the sequence number is what makes a run deterministic: two events
at the same time always run in the order they were scheduled.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from typing import Any


class EventQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0
        self.now = 0.0
        self.processed = 0

    def at(self, time: float, callback: Callable[..., None], *args: Any) -> None:
        """Run `callback(*args)` at `time` (never earlier than now)."""
        if not math.isfinite(time):
            raise ValueError(f"event time must be finite, got {time!r}")
        heapq.heappush(self._heap, (max(time, self.now), self._seq, callback, args))
        self._seq += 1

    def run(self, until: float = math.inf) -> None:
        heap = self._heap
        while heap and heap[0][0] <= until:
            time, _, callback, args = heapq.heappop(heap)
            self.now = time
            self.processed += 1
            callback(*args)

    def __len__(self) -> int:
        return len(self._heap)
