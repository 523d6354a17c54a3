"""The one scheduler interface, the per-worker adapter, and small pieces several policies share.

Every policy is a `Scheduler`: one call per scheduling round, from a frozen `ClusterSnapshot`
of the whole pool to a `Decision` (a plan for each open worker it wants to use). Policies that
decide one worker at a time (the batching baselines and step-level continuous batching) are
written as a `WorkerPolicy` and wrapped in `PerWorker`, which asks them worker by worker and
shows each the snapshot as the earlier answers of the same round left it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Protocol, runtime_checkable

from stepserve.policies.types import (
    ClusterSnapshot,
    Decision,
    RequestStatus,
    SnapshotIndex,
    RequestView,
    ShapeKey,
    StepGroup,
    WorkerPlan,
    WorkerView,
)


class PolicyError(Exception):
    """A policy returned a plan the router cannot execute."""


@runtime_checkable
class Scheduler(Protocol):
    """Decides one round for the pool: plans only for open workers, at most one each.

    `steady`: the plan it gives a worker stays the same until a request arrives, finishes, is
    cancelled or a worker changes; the router may then run it for several steps in one plan.
    A policy whose choice moves with the clock (deadlines, slack) is not steady.

    `joins_running`: it may add a waiting request to a batch already running on a worker
    (step-level batching). The router then keeps such a worker's plans short while a request
    waits, and cuts a plan of several steps short when one becomes ready; a policy that only
    starts batches on idle workers (request-level batching) leaves running plans alone.

    `splits_cfg`: it may split a CFG request's two rows over two workers (latent parallelism),
    so the workers need their world of process groups even where no model is sequence-parallel.
    """

    name: str
    steady: bool
    joins_running: bool
    splits_cfg: bool

    def schedule(self, snapshot: ClusterSnapshot) -> Decision: ...


@runtime_checkable
class WorkerPolicy(Protocol):
    """Decides one round for one worker, seeing the rest of the pool as it is now: a `Decision`
    with at most that worker's plan (and a `wake_at` if it holds work back on purpose).
    `joins_running` as in `Scheduler`."""

    joins_running: bool

    def plan(self, snapshot: ClusterSnapshot, worker_id: str) -> Decision: ...


class PerWorker:
    """A `Scheduler` made of a `WorkerPolicy`.

    Open workers are asked least loaded first (idle ones first), so a burst spreads before
    anyone batches up; after each answer the snapshot moves the admitted
    requests from the queue onto that worker. An idle worker is asked only while something
    ready waits: every per-worker policy answers it with an empty plan otherwise, and on a large
    pool asking every idle worker in every round would make a round cost O(workers).
    """

    # A worker's plan is a function of its residents and the queue, not of the clock (a batching
    # window only holds back admissions, which end a multi-step plan anyway).
    steady = True
    splits_cfg = False  # a worker's plan is its own

    def __init__(self, policy: WorkerPolicy) -> None:
        self.policy = policy
        self.name = getattr(policy, "name", type(policy).__name__)
        self.joins_running = policy.joins_running

    def schedule(self, snapshot: ClusterSnapshot) -> Decision:
        busy = sorted(snapshot.open_workers(idle=False), key=lambda w: len(w.running))
        ready = any(r.ready for r in snapshot.queued)
        by_id = snapshot.index.workers_by_id
        idle = [by_id[w] for w in snapshot.index.open_idle_ids] if ready else []
        plans: list[WorkerPlan] = []
        wake_at: float | None = None
        current = snapshot
        for worker in idle + busy:
            if not worker.running and not ready:
                continue
            answer = self.policy.plan(current, worker.worker_id)
            if answer.wake_at is not None:
                wake_at = answer.wake_at if wake_at is None else min(wake_at, answer.wake_at)
            for plan in answer.plans:
                if plan.worker_id != worker.worker_id:
                    raise PolicyError(f"asked for worker {worker.worker_id!r}, the policy planned {plan.worker_id!r}")
                plans.append(plan)
                if plan.admit:
                    current = _after_admission(current, worker.worker_id, plan.admit)
                    ready = any(r.ready for r in current.queued)
        return Decision(tuple(plans), wake_at)


def _after_admission(snapshot: ClusterSnapshot, worker_id: str, admitted: tuple[str, ...]) -> ClusterSnapshot:
    """The snapshot as the next worker of the same round must see it (its index updated in
    place of a rebuild: a round must not walk the pool)."""
    taken = set(admitted)
    moved = tuple(replace(v, status=RequestStatus.RUNNING, workers=(worker_id,))
                  for v in snapshot.queued if v.request_id in taken)
    old = snapshot.worker(worker_id)
    new = replace(old, running=old.running + admitted)
    index = snapshot.index
    # Copies of the lent tables: this snapshot outlives the round's (the next worker reads it).
    workers_by_id = dict(index.workers_by_id)
    workers_by_id[worker_id] = new
    running_by_worker = dict(index.running_by_worker)
    running_by_worker[worker_id] = running_by_worker.get(worker_id, ()) + moved
    counts = dict(index.load_counts)
    before, after = (old.max_batch_size, len(old.running)), (new.max_batch_size, len(new.running))
    counts[before] -= 1
    counts[after] = counts.get(after, 0) + 1
    open_ids, open_idle_ids = index.open_ids, index.open_idle_ids
    if worker_id in open_idle_ids:  # it holds requests now
        open_idle_ids = tuple(w for w in open_idle_ids if w != worker_id)
        open_ids = tuple(w for w in workers_by_id if w in set(open_ids) | {worker_id})
    return ClusterSnapshot(snapshot.now, tuple(v for v in snapshot.queued if v.request_id not in taken),
                           SnapshotIndex(workers_by_id, running_by_worker, open_ids, open_idle_ids, counts),
                           snapshot.sp_available, snapshot.step_overhead_s)


def without(snapshot: ClusterSnapshot, workers: Iterable[str], requests: Iterable[str]) -> ClusterSnapshot:
    """The snapshot as a policy sees it once `workers` and the waiting `requests` are spoken for
    (a policy that plans some of the pool itself and hands the rest to another). O(workers), in
    dict copies."""
    gone, taken = set(workers), set(requests)
    index = snapshot.lookups()
    # Copies less what is gone: a dict copy is one C call, where a comprehension over the pool
    # (512 workers) runs Python per worker, every round of a policy that hands work on.
    by_id, running, counts = dict(index.workers_by_id), dict(index.running_by_worker), dict(index.load_counts)
    for w in gone:
        view = by_id.pop(w, None)
        if view is None:
            continue
        running.pop(w, None)
        key = (view.max_batch_size, len(view.running))
        if counts.get(key, 0) > 1:
            counts[key] -= 1
        else:
            counts.pop(key, None)
    return ClusterSnapshot(
        snapshot.now, tuple(v for v in snapshot.queued if v.request_id not in taken) if taken else snapshot.queued,
        SnapshotIndex(by_id, running, tuple(w for w in index.open_ids if w not in gone),
                      tuple(w for w in index.open_idle_ids if w not in gone), counts, index.current),
        snapshot.sp_available, snapshot.step_overhead_s)


# ---- helpers the per-worker policies share ----------------------------------------------------


def check_batch_cap(field: str, value: object) -> None:
    """Config validation for an optional batch-size cap; the message names the field."""
    # bool is an int subclass; `True` as a batch size is a typo, not a cap of 1.
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{field} must be a positive int or None, got {value!r}")


def batch_limit(worker: WorkerView, cap: int | None) -> int:
    """A policy may batch less than the worker allows, never more."""
    return worker.max_batch_size if cap is None else min(cap, worker.max_batch_size)


def residents_of(snapshot: ClusterSnapshot, worker_id: str) -> list[RequestView]:
    """The worker's resident requests in admission order."""
    by_id = {view.request_id: view for view in snapshot.running_on(worker_id)}
    return [by_id[rid] for rid in snapshot.worker(worker_id).running]


def group_by_shape(views: Iterable[RequestView]) -> tuple[StepGroup, ...]:
    """One group per shape key, members in the given order, oldest group first.

    Ordering groups by their oldest member keeps the order stable from round to round and
    runs the longest-waiting work first when a worker executes groups one after another.
    """
    groups: dict[ShapeKey, list[RequestView]] = {}
    for view in views:
        groups.setdefault(view.shape_key, []).append(view)
    # sorted() is stable, so equal arrival times keep first-seen order.
    ordered = sorted(groups.values(), key=lambda group: min(v.arrival_time for v in group))
    return tuple(StepGroup(tuple(v.request_id for v in group)) for group in ordered)
