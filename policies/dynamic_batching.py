"""Request-level dynamic batching: SynerDiff's "Dynamic Batching" baseline (synerdiff.txt §IV-A2).

Like static batching, a batch shares one shape and one step count and runs from its first step
to its last with nothing joining. The difference: an idle worker does not start the moment one
request is ready; it collects a batch for up to a window (0.5 s in SynerDiff) measured from the
arrival of the oldest ready request of that batch's kind, and starts early only when the batch
is full. While it waits it answers with no plan and a `wake_at` at which the earliest window
closes (a `Decision` with only `wake_at`), so the router asks again then even if nothing arrives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from stepserve.policies.base import batch_limit, check_batch_cap, group_by_shape, residents_of
from stepserve.policies.registry import register_policy
from stepserve.policies.types import ClusterSnapshot, Decision, RequestView, ShapeKey, StepGroup, WorkerPlan


@dataclass(frozen=True)
class DynamicBatchingConfig:
    window_s: float = 0.5  # SynerDiff's collection window
    # None: as many as the worker allows.
    max_batch_size: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.window_s, bool) or not isinstance(self.window_s, (int, float)) \
                or not math.isfinite(self.window_s) or self.window_s < 0:
            raise ValueError(f"window_s must be a finite number >= 0, got {self.window_s!r}")
        check_batch_cap("max_batch_size", self.max_batch_size)


@register_policy("dynamic_batching", DynamicBatchingConfig)
class DynamicBatching:
    name: str  # set by register_policy
    joins_running = False

    def __init__(self, config: DynamicBatchingConfig = DynamicBatchingConfig()) -> None:
        self.config = config

    def plan(self, snapshot: ClusterSnapshot, worker_id: str) -> Decision:
        residents = residents_of(snapshot, worker_id)
        if residents:
            return Decision((WorkerPlan(worker_id, groups=group_by_shape(residents)),))

        limit = batch_limit(snapshot.worker(worker_id), self.config.max_batch_size)
        # Candidate batches by kind, in FCFS order of their oldest ready member. Requests whose
        # conditioning is still in flight cannot run, so they neither join nor open a window.
        kinds: dict[tuple[ShapeKey, int], list[RequestView]] = {}
        for request in snapshot.queued:
            if request.ready:
                batch = kinds.setdefault((request.shape_key, request.steps_total), [])
                if len(batch) < limit:
                    batch.append(request)

        earliest_close: float | None = None
        for batch in kinds.values():
            # snapshot.queued is in arrival order, so batch[0] is the oldest of its kind.
            closes = batch[0].arrival_time + self.config.window_s
            if len(batch) >= limit or snapshot.now >= closes:
                ids = tuple(r.request_id for r in batch)
                return Decision((WorkerPlan(worker_id, admit=ids, groups=(StepGroup(ids),)),))
            earliest_close = closes if earliest_close is None else min(earliest_close, closes)
        return Decision(wake_at=earliest_close)
