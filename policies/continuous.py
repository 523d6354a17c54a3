"""Step-level continuous batching (InstGenIE §4.3; also SynerDiff's baseline loop).

Every round, every request resident on the worker steps once; a finished request leaves at
once (the router removes it) and ready queued requests join at the next step boundary, so
nobody waits for a whole batch to drain. Requests with different step counts mix freely:
each one owns its sampler state on the worker.
"""

from __future__ import annotations

from dataclasses import dataclass

from stepserve.policies.base import batch_limit, check_batch_cap, group_by_shape, residents_of
from stepserve.policies.registry import register_policy
from stepserve.policies.types import ClusterSnapshot, Decision, RequestView, WorkerPlan


@dataclass(frozen=True)
class ContinuousConfig:
    # None: as many as the worker allows. A smaller cap trades throughput for step latency.
    max_batch_size: int | None = None

    def __post_init__(self) -> None:
        check_batch_cap("max_batch_size", self.max_batch_size)


@register_policy("continuous", ContinuousConfig)
class ContinuousBatching:
    name: str  # set by register_policy
    joins_running = True

    def __init__(self, config: ContinuousConfig = ContinuousConfig()) -> None:
        self.config = config

    def plan(self, snapshot: ClusterSnapshot, worker_id: str) -> Decision:
        cap = self.config.max_batch_size
        me = snapshot.worker(worker_id)
        limit = batch_limit(me, cap)
        # Join-shortest-queue: the worker asking first must not swallow a burst that
        # idle peers could start on right away, so it stops once it is more loaded than
        # the least-loaded peer that could still take work. A peer whose pipeline is full
        # counts too: it takes work at its next boundary, a step away at most.
        ceiling = snapshot.least_load_with_room(cap, excluding=worker_id)

        load = len(me.running)
        admitted: list[RequestView] = []
        for request in snapshot.queued:
            if load >= limit or (ceiling is not None and load > ceiling):
                break
            # Conditioning still in flight: it cannot run yet, and ready requests behind it
            # should not idle the GPU waiting for it.
            if not request.ready:
                continue
            admitted.append(request)
            load += 1

        groups = group_by_shape(residents_of(snapshot, worker_id) + admitted)
        if not groups:
            return Decision()
        return Decision((WorkerPlan(worker_id, admit=tuple(r.request_id for r in admitted), groups=groups),))
