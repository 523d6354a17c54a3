"""The router's state machine: the queue, every request's state, and plan validation.

No Ray, no asyncio, no clock: the router actor wraps it with I/O and the discrete-event
simulator drives it directly, so both make the same decisions from the same inputs. Policies
only see frozen snapshots; everything mutable lives here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from stepserve.policies.base import PolicyError, SchedulingPolicy
from stepserve.policies.types import (
    ClusterSnapshot,
    RequestSpec,
    RequestStatus,
    RequestView,
    StepReport,
    WorkerPlan,
    WorkerView,
)


class QueueFullError(Exception):
    """The queue is at `max_queue_len`; the caller should shed the request (HTTP 429/503)."""


class DuplicateRequestError(Exception):
    """A request with this id is still queued or running."""


@dataclass(frozen=True)
class WorkerSlot:
    worker_id: str
    max_batch_size: int


@dataclass(frozen=True)
class RequestState:
    request_id: str
    status: RequestStatus
    steps_done: int
    steps_total: int
    worker_id: str | None  # where it runs or last ran
    arrival_time: float
    admit_time: float | None
    finish_time: float | None  # when it became terminal, whatever the outcome
    error: str | None


@dataclass
class _Record:
    spec: RequestSpec
    arrival_time: float
    steps_total: int
    status: RequestStatus = RequestStatus.QUEUED
    steps_done: int = 0
    ready: bool = False
    worker_id: str | None = None
    admit_time: float | None = None
    finish_time: float | None = None
    error: str | None = None
    view: RequestView | None = None  # cached; cleared whenever a field the view shows changes


@dataclass
class _Worker:
    slot: WorkerSlot
    # Dicts used as ordered sets: admission order must survive removals.
    residents: dict[str, None] = field(default_factory=dict)
    # Cancelled while resident: the worker still holds their latents until its next plan.
    drops: dict[str, None] = field(default_factory=dict)
    # (resident views, worker view), cached between changes: the simulator asks for a
    # snapshot hundreds of thousands of times, and most of a snapshot has not changed.
    views: tuple[tuple[RequestView, ...], WorkerView] | None = None


class RouterCore:
    def __init__(
        self, policy: SchedulingPolicy, workers: Sequence[WorkerSlot], max_queue_len: int
    ) -> None:
        if not workers:
            raise ValueError("RouterCore needs at least one worker")
        if max_queue_len < 1:
            raise ValueError(f"max_queue_len must be >= 1, got {max_queue_len}")
        self.policy = policy
        self.max_queue_len = max_queue_len
        self._workers: dict[str, _Worker] = {}
        for slot in workers:
            if slot.worker_id in self._workers:
                raise ValueError(f"duplicate worker id {slot.worker_id!r}")
            if slot.max_batch_size < 1:
                raise ValueError(
                    f"worker {slot.worker_id!r}: max_batch_size must be >= 1, "
                    f"got {slot.max_batch_size}"
                )
            self._workers[slot.worker_id] = _Worker(slot)
        self._records: dict[str, _Record] = {}  # submission order
        self._queue: dict[str, None] = {}  # queued ids, submission order
        self._queued_views: tuple[RequestView, ...] | None = None  # cached, like _Worker.views

    # ---- requests in ----

    def submit(self, spec: RequestSpec, now: float) -> None:
        old = self._records.get(spec.request_id)
        if old is not None and not old.status.is_terminal:
            raise DuplicateRequestError(f"request {spec.request_id!r} is already {old.status.value}")
        if len(self._queue) >= self.max_queue_len:
            raise QueueFullError(f"queue full ({self.max_queue_len} requests waiting)")
        if spec.num_inference_steps < 1:
            raise ValueError(f"request {spec.request_id!r}: num_inference_steps must be >= 1")
        # A finished id submitted again is a new request: it goes to the back, not its old slot.
        self._records.pop(spec.request_id, None)
        self._records[spec.request_id] = _Record(
            spec=spec, arrival_time=now, steps_total=spec.num_inference_steps
        )
        self._queue[spec.request_id] = None
        self._queued_views = None

    def mark_ready(self, request_id: str) -> None:
        record = self._records.get(request_id)
        # Embeddings can arrive after a cancel; that is not an error.
        if record is not None and not record.status.is_terminal:
            record.ready = True
            self._changed(record)

    # ---- rounds ----

    def next_plan(self, worker_id: str, now: float) -> WorkerPlan:
        worker = self._worker(worker_id)
        plan = self.policy.plan(self.snapshot(now), worker_id)
        self._validate(plan, worker)

        for rid in plan.admit:
            record = self._records[rid]
            del self._queue[rid]
            self._changed(record)
            record.status = RequestStatus.RUNNING
            record.worker_id = worker_id
            record.admit_time = now
            worker.residents[rid] = None
        if plan.admit:
            worker.views = None
        drops = tuple(worker.drops)
        worker.drops.clear()
        return WorkerPlan(worker_id=worker_id, admit=plan.admit, groups=plan.groups, drop=drops,
                          wake_at=plan.wake_at)

    def apply(self, report: StepReport, now: float) -> list[str]:
        """Fold a worker's report in; returns the ids that became terminal, in report order."""
        worker = self._worker(report.worker_id)
        outcomes = [(rid, RequestStatus.FINISHED, None) for rid in report.finished]
        outcomes += [(rid, RequestStatus.FAILED, message) for rid, message in report.failed]
        # Check the whole report before changing anything, so a bad one leaves no half-update.
        live = {
            rid: self._live_resident(rid, worker)
            for rid in [p.request_id for p in report.progress] + [rid for rid, _, _ in outcomes]
        }

        for progress in report.progress:
            record = live[progress.request_id]
            if record is not None:
                record.steps_done = progress.steps_done
                record.steps_total = progress.steps_total
                self._changed(record)

        became_terminal: list[str] = []
        for rid, status, message in outcomes:
            record = live[rid]
            # Whatever the router thinks, the worker no longer holds it: never drop it later.
            worker.residents.pop(rid, None)
            worker.views = None
            worker.drops.pop(rid, None)
            # A report naming an id twice (finished and failed) must not end it twice.
            if record is None or record.status.is_terminal:
                continue
            record.status = status
            record.finish_time = now
            record.error = message
            if status is RequestStatus.FINISHED:
                record.steps_done = record.steps_total
            became_terminal.append(rid)
        return became_terminal

    def cancel(self, request_id: str, now: float) -> bool:
        return self._end_early(request_id, RequestStatus.CANCELLED, None, now)

    def fail(self, request_id: str, message: str, now: float) -> bool:
        """End a live request as FAILED from outside its worker (e.g. its text encoding failed)."""
        return self._end_early(request_id, RequestStatus.FAILED, message, now)

    def _end_early(self, request_id: str, status: RequestStatus, message: str | None, now: float) -> bool:
        record = self._records.get(request_id)
        if record is None or record.status.is_terminal:
            return False
        if record.status is RequestStatus.QUEUED:
            del self._queue[request_id]
            self._queued_views = None
        else:
            worker = self._workers[record.worker_id]
            del worker.residents[request_id]
            worker.views = None
            worker.drops[request_id] = None
        record.status = status
        record.finish_time = now
        record.error = message
        return True

    def worker_failed(self, worker_id: str, message: str, now: float) -> list[str]:
        """Fail every request resident on the worker; the slot stays for a restarted worker."""
        worker = self._worker(worker_id)
        failed = list(worker.residents)
        for rid in failed:
            record = self._records[rid]
            record.status = RequestStatus.FAILED
            record.finish_time = now
            record.error = message
        worker.residents.clear()
        worker.views = None
        # A dead worker holds nothing to drop; a restarted one never saw these ids.
        worker.drops.clear()
        return failed

    # ---- reading state ----

    def state(self, request_id: str) -> RequestState:
        record = self._records[request_id]
        return RequestState(
            request_id=request_id,
            status=record.status,
            steps_done=record.steps_done,
            steps_total=record.steps_total,
            worker_id=record.worker_id,
            arrival_time=record.arrival_time,
            admit_time=record.admit_time,
            finish_time=record.finish_time,
            error=record.error,
        )

    def forget(self, request_id: str) -> None:
        """Drop a terminal request's record once its result is delivered; unknown ids are a no-op."""
        record = self._records.get(request_id)
        if record is None:
            return
        if not record.status.is_terminal:
            raise ValueError(f"request {request_id!r} is {record.status.value}; cancel it first")
        del self._records[request_id]

    def has_work(self, worker_id: str) -> bool:
        worker = self._worker(worker_id)
        if worker.residents or worker.drops:
            return True
        return any(self._records[rid].ready for rid in self._queue)

    @property
    def queue_length(self) -> int:
        return len(self._queue)

    @property
    def num_running(self) -> int:
        return sum(len(w.residents) for w in self._workers.values())

    @property
    def worker_ids(self) -> tuple[str, ...]:
        return tuple(self._workers)

    def snapshot(self, now: float) -> ClusterSnapshot:
        # Running views go worker by worker in admission order, so `running_on` agrees with
        # `WorkerView.running`. Cancelled requests are in neither queue nor residents.
        if self._queued_views is None:
            self._queued_views = tuple(self._view(rid) for rid in self._queue)
        running: list[RequestView] = []
        workers: list[WorkerView] = []
        for w in self._workers.values():
            if w.views is None:
                w.views = (
                    tuple(self._view(rid) for rid in w.residents),
                    WorkerView(w.slot.worker_id, w.slot.max_batch_size, tuple(w.residents)),
                )
            running.extend(w.views[0])
            workers.append(w.views[1])
        return ClusterSnapshot(now=now, queued=self._queued_views, running=tuple(running), workers=tuple(workers))

    # ---- internals ----

    def _worker(self, worker_id: str) -> _Worker:
        try:
            return self._workers[worker_id]
        except KeyError:
            raise KeyError(f"unknown worker {worker_id!r}") from None

    def _changed(self, record: _Record) -> None:
        """Drop cached views that show this record; call before moving it between queue and
        worker, and after changing any field its view shows."""
        record.view = None
        if record.status is RequestStatus.QUEUED:
            self._queued_views = None
        elif record.worker_id is not None and record.spec.request_id in self._workers[record.worker_id].residents:
            self._workers[record.worker_id].views = None

    def _view(self, request_id: str) -> RequestView:
        record = self._records[request_id]
        if record.view is None:
            record.view = self._build_view(request_id, record)
        return record.view

    @staticmethod
    def _build_view(request_id: str, record: _Record) -> RequestView:
        return RequestView(
            request_id=request_id,
            shape_key=record.spec.shape_key,
            uses_cfg=record.spec.uses_cfg,
            steps_done=record.steps_done,
            steps_total=record.steps_total,
            arrival_time=record.arrival_time,
            ready=record.ready,
            worker_id=record.worker_id if record.status is RequestStatus.RUNNING else None,
        )

    def _live_resident(self, request_id: str, worker: _Worker) -> _Record | None:
        """The record a report may update, or None when the report is stale (cancel, failure)."""
        record = self._records.get(request_id)
        if record is None or record.status.is_terminal:
            return None
        if request_id not in worker.residents:
            raise ValueError(
                f"worker {worker.slot.worker_id!r} reported request {request_id!r}, "
                f"which is {record.status.value} on worker {record.worker_id!r}"
            )
        return record

    def _validate(self, plan: WorkerPlan, worker: _Worker) -> None:
        name = getattr(self.policy, "name", type(self.policy).__name__)
        worker_id = worker.slot.worker_id

        def fail(problem: str) -> PolicyError:
            return PolicyError(f"policy {name!r}, plan for worker {worker_id!r}: {problem}")

        if not isinstance(plan, WorkerPlan):
            raise fail(f"expected a WorkerPlan, got {type(plan).__name__}")
        if plan.worker_id != worker_id:
            raise fail(f"plan is addressed to worker {plan.worker_id!r}")
        if plan.drop:
            raise fail(f"drop is router-filled, but the policy set {list(plan.drop)}")

        seen: set[str] = set()
        for rid in plan.admit:
            if rid in seen:
                raise fail(f"admits {rid!r} twice")
            seen.add(rid)
            record = self._records.get(rid)
            if rid not in self._queue or record is None:
                status = "unknown" if record is None else record.status.value
                raise fail(f"admits {rid!r}, which is not queued ({status})")
            if not record.ready:
                raise fail(f"admits {rid!r}, which is not ready (conditioning still in flight)")

        resident_after = len(worker.residents) + len(plan.admit)
        if resident_after > worker.slot.max_batch_size:
            raise fail(
                f"{resident_after} resident requests after admission exceed "
                f"max_batch_size {worker.slot.max_batch_size}"
            )

        stepping: set[str] = set()
        for index, group in enumerate(plan.groups):
            if not group:
                raise fail(f"group {index} is empty")
            for rid in group:
                if rid in stepping:
                    raise fail(f"{rid!r} appears twice in groups")
                stepping.add(rid)
                if rid in worker.drops:
                    raise fail(f"steps {rid!r}, which was cancelled")
                if rid not in worker.residents and rid not in seen:
                    raise fail(f"steps {rid!r}, which is not resident on this worker")
            keys = {self._records[rid].spec.shape_key for rid in group}
            if len(keys) > 1:
                raise fail(f"group {index} mixes shape keys {sorted(keys)}")
