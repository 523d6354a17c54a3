"""The interface every scheduling policy implements, and small pieces several policies share."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

from stepserve.policies.types import ClusterSnapshot, RequestView, ShapeKey, WorkerPlan, WorkerView


class PolicyError(Exception):
    """A policy returned a plan the router cannot execute."""


@runtime_checkable
class SchedulingPolicy(Protocol):
    """Decides one round for one worker.

    The router calls `plan` whenever that worker can take a round (it finished a step, or it is
    idle and work arrived); workers loop independently, so a policy sees the others' residents
    as they are now and must not assume they are planned in lockstep.
    """

    name: str

    def plan(self, snapshot: ClusterSnapshot, worker_id: str) -> WorkerPlan: ...


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


def group_by_shape(views: Iterable[RequestView]) -> tuple[tuple[str, ...], ...]:
    """One group per shape key, members in the given order, oldest group first.

    Ordering groups by their oldest member keeps the order stable from round to round and
    runs the longest-waiting work first when a worker executes groups one after another.
    """
    groups: dict[ShapeKey, list[RequestView]] = {}
    for view in views:
        groups.setdefault(view.shape_key, []).append(view)
    # sorted() is stable, so equal arrival times keep first-seen order.
    ordered = sorted(groups.values(), key=lambda group: min(v.arrival_time for v in group))
    return tuple(tuple(v.request_id for v in group) for group in ordered)
