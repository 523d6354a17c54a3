"""How many denoiser workers the pool should have, from the router's own load signal.

No Ray and no clock (`now` is an argument), like `RouterCore`: the router asks it once a second
and starts or drains workers to meet its answer; the simulator asks it the same way, with a
worker's start-up delay of its own, so a benchmark sees the decisions the live router makes.

The signal (`RouterCore.pool_load`) is the demand (requests running or waiting, ready or not),
what of it waits for a worker, and the waiting requests predicted to miss their deadline unless
they start now. The pool grows at once, to one worker per `target_requests` of demand (as Ray
Serve's `target_ongoing_requests`: the batch a worker should run, which for a big model at a
tight SLO is well below its batch cap), and by one more while requests are predicted late. It
shrinks one worker at a time, each only once the demand has wanted fewer for
`scale_down_delay_s` with nothing waiting and nothing late: a worker costs a model load (and a
node) to bring back, so only a lull that lasts lets one go.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ScalingSpec:
    """`workers.autoscaling`: the pool's bounds and pace (the router starts `workers.num_workers`)."""

    min_workers: int
    max_workers: int
    target_requests: float = 4.0  # requests running or waiting per worker the pool sizes itself for
    scale_down_delay_s: float = 30.0  # how long the demand stays below the pool before one worker drains

    def __post_init__(self) -> None:
        if not 1 <= self.min_workers <= self.max_workers:
            raise ValueError(f"need 1 <= min_workers <= max_workers, got {self.min_workers}, {self.max_workers}")
        if not self.target_requests > 0:
            raise ValueError(f"target_requests must be > 0, got {self.target_requests}")
        if self.scale_down_delay_s < 0:
            raise ValueError(f"scale_down_delay_s must be >= 0, got {self.scale_down_delay_s}")

    def clamp(self, workers: int) -> int:
        return max(self.min_workers, min(self.max_workers, workers))


@dataclass(frozen=True)
class PoolLoad:
    """What the pool holds and faces now (`RouterCore.pool_load`)."""

    demand: int  # requests running or waiting for a worker
    waiting: int  # of which waiting for a worker (queued or paused)
    late: int  # waiting requests that miss their deadline unless they start now


class PoolScaler:
    def __init__(self, spec: ScalingSpec) -> None:
        self.spec = spec
        self._low_since: float | None = None  # since when the demand has wanted fewer workers

    def wanted(self, load: PoolLoad, size: int) -> int:
        """Workers the load asks for, within the bounds, ignoring the shrink delay."""
        need = math.ceil(load.demand / self.spec.target_requests)
        if load.late:
            need = max(need, size + 1)
        return self.spec.clamp(need)

    def target(self, load: PoolLoad, size: int, now: float) -> int:
        """The pool's size from now on. `size`: the workers it has or is starting, less those
        draining."""
        wanted = self.wanted(load, size)
        if wanted >= size or load.waiting:
            self._low_since = None
            return max(wanted, self.spec.clamp(size))
        if self._low_since is None:
            self._low_since = now
        if now - self._low_since < self.spec.scale_down_delay_s:
            return size
        self._low_since = now  # the next one waits a whole delay again
        return size - 1
