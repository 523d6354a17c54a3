"""Step-level continuous batching (InstGenIE §4.3; also SynerDiff's baseline loop).

Every round, every request resident on the worker steps once; a finished request leaves at
once (the router removes it) and ready queued requests join at the next step boundary, so
nobody waits for a whole batch to drain. Requests with different step counts mix freely:
each one owns its sampler state on the worker.

LoRA affinity (SwiftDiffusion §4.2: bringing a LoRA to a worker stalls its batch): a request is
left, for a short while, to an open worker with room that already holds its LoRAs.
"""

from __future__ import annotations

from dataclasses import dataclass

from stepserve.policies.base import batch_limit, check_batch_cap, group_by_shape, residents_of
from stepserve.policies.registry import register_policy
from stepserve.policies.types import ClusterSnapshot, Decision, RequestView, WorkerPlan, WorkerView


@dataclass(frozen=True)
class ContinuousConfig:
    # None: as many as the worker allows. A smaller cap trades throughput for step latency.
    max_batch_size: int | None = None
    # LoRA affinity (SwiftDiffusion §4.2): a worker leaves a request whose LoRAs it lacks to an
    # open worker, no more loaded, that holds them all and has room; for at most this long after
    # the request arrived, so nothing waits on affinity for long. 0: off.
    lora_affinity_s: float = 0.2

    def __post_init__(self) -> None:
        check_batch_cap("max_batch_size", self.max_batch_size)
        if not self.lora_affinity_s >= 0:
            raise ValueError(f"lora_affinity_s must be >= 0, got {self.lora_affinity_s}")


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
        wake_at: float | None = None  # when a request left for its LoRAs' holder may come here
        for request in snapshot.queued:
            if load >= limit or (ceiling is not None and load > ceiling):
                break
            # Conditioning still in flight: it cannot run yet, and ready requests behind it
            # should not idle the GPU waiting for it.
            if not request.ready:
                continue
            if request.loras and self._held_elsewhere(snapshot, request, me, load):
                expires = request.arrival_time + self.config.lora_affinity_s
                wake_at = expires if wake_at is None else min(wake_at, expires)
                continue
            admitted.append(request)
            load += 1

        groups = group_by_shape(residents_of(snapshot, worker_id) + admitted)
        if not groups:
            return Decision(wake_at=wake_at)
        return Decision((WorkerPlan(worker_id, admit=tuple(r.request_id for r in admitted), groups=groups),), wake_at)

    def _held_elsewhere(self, snapshot: ClusterSnapshot, request: RequestView, me: WorkerView, load: int) -> bool:
        """Another open worker with room, no more loaded than `me` is with `load`, holds every LoRA
        of `request` and `me` does not: leave it there (while its affinity lasts)."""
        if snapshot.now - request.arrival_time >= self.config.lora_affinity_s:
            return False
        model = request.shape_key.model
        wanted = {(model, name) for name in request.loras}
        if wanted <= me.loras:
            return False
        return any(w.worker_id != me.worker_id and len(w.running) <= load and len(w.running) < batch_limit(
            w, self.config.max_batch_size) and wanted <= w.loras for w in snapshot.open_workers())
