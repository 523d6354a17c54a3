"""Request-level static batching: the baseline of Diffusers-based servers today.

One pipeline call runs a batch from the first step to the last; nothing joins while it runs,
so a request that arrives one step after a batch started waits for the whole batch. A batch
shares one shape and one step count, because a single pipeline call cannot mix either.
"""

from __future__ import annotations

from dataclasses import dataclass

from stepserve.policies.base import batch_limit, check_batch_cap, group_by_shape, residents_of
from stepserve.policies.registry import register_policy
from stepserve.policies.types import ClusterSnapshot, Decision, RequestView, StepGroup, WorkerPlan


@dataclass(frozen=True)
class StaticFCFSConfig:
    # None: as many as the worker allows.
    max_batch_size: int | None = None

    def __post_init__(self) -> None:
        check_batch_cap("max_batch_size", self.max_batch_size)


@register_policy("static_fcfs", StaticFCFSConfig)
class StaticFCFS:
    name: str  # set by register_policy
    joins_running = False

    def __init__(self, config: StaticFCFSConfig = StaticFCFSConfig()) -> None:
        self.config = config

    def plan(self, snapshot: ClusterSnapshot, worker_id: str) -> Decision:
        residents = residents_of(snapshot, worker_id)
        if residents:
            return Decision((WorkerPlan(worker_id, groups=group_by_shape(residents)),))

        limit = batch_limit(snapshot.worker(worker_id), self.config.max_batch_size)
        batch: list[RequestView] = []
        for request in snapshot.queued:
            if len(batch) >= limit:
                break
            if not request.ready:
                continue
            head = batch[0] if batch else request
            if request.shape_key == head.shape_key and request.steps_total == head.steps_total:
                batch.append(request)

        if not batch:
            return Decision()
        ids = tuple(r.request_id for r in batch)
        return Decision((WorkerPlan(worker_id, admit=ids, groups=(StepGroup(ids),)),))
