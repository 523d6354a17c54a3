"""Checks a policy's `Decision` against the router's state, as a whole, before the core changes
anything: a policy that returns a plan the workers cannot execute is a bug, and it must fail
loudly (`PolicyError`) without leaving half a round applied.

A decision is executable when:
- it plans only live, open workers, at most once each, and fills only the policy's fields;
- every admitted request is waiting (queued or paused) and ready, and is admitted on one worker,
  or on exactly the members of the SP group it steps with;
- every stepped request is resident there (or admitted in the same plan), steps once per round
  (an SP group's members list the same step), shares its group's shape, and a request spread
  over an SP group steps only in that group, on every member, with its ranks;
- every export names a resident request once, and the request's other holders release it; a
  request held by several workers (each holds all of it) may be released by all but one;
- no worker ends the round holding more than its batch size;
- every discarded request is waiting (its state is on no worker, so failing it takes nothing
  from a plan in flight) and appears in no plan of the decision.
"""

from __future__ import annotations

from typing import Any, Protocol

from stepserve.policies.base import PolicyError
from stepserve.policies.types import Decision, GroupSplit, RequestSpec, RequestStatus, ShapeKey, WorkerPlan
from stepserve.routing.records import RequestRecord, WorkerRecord


class CoreState(Protocol):
    """What the check reads of the router core (`RouterCore` is one)."""

    policy: Any
    sp_available: bool

    def worker_record(self, worker_id: str) -> WorkerRecord | None: ...

    def request_record(self, request_id: str) -> RequestRecord | None: ...

    def is_open(self, worker: WorkerRecord) -> bool: ...

    def batch_key(self, spec: RequestSpec) -> ShapeKey: ...


class PlanChecker:
    def __init__(self, core: CoreState) -> None:
        self.core = core

    def decision(self, decision: Decision) -> None:
        core = self.core
        name = getattr(core.policy, "name", type(core.policy).__name__)

        def fail(problem: str) -> PolicyError:
            return PolicyError(f"policy {name!r}: {problem}")

        def request(request_id: str) -> RequestRecord:
            """A request the checks below already found known (stepped, exported or released)."""
            record = core.request_record(request_id)
            if record is None:
                raise fail(f"{request_id!r} is unknown")
            return record

        if not isinstance(decision, Decision):
            raise fail(f"expected a Decision, got {type(decision).__name__}")
        planned: dict[str, WorkerPlan] = {}
        held: dict[str, WorkerRecord] = {}  # the planned workers' records
        for plan in decision.plans:
            if not isinstance(plan, WorkerPlan):
                raise fail(f"expected WorkerPlans, got {type(plan).__name__}")
            worker = core.worker_record(plan.worker_id)
            if worker is None or not worker.alive:
                raise fail(f"plans worker {plan.worker_id!r}, which is unknown or dead")
            if not core.is_open(worker):
                raise fail(f"plans worker {plan.worker_id!r}, which is not open (pipeline full)")
            if plan.worker_id in planned:
                raise fail(f"plans worker {plan.worker_id!r} twice")
            if plan.drop or plan.checkpoint or plan.finish or plan.plan_id or plan.steps != 1:
                raise fail(f"plan for {plan.worker_id!r} sets router-filled fields")
            planned[plan.worker_id] = plan
            held[plan.worker_id] = worker

        admitted: dict[str, list[str]] = {}
        stepped: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
        exported: dict[str, str] = {}
        released: dict[str, set[str]] = {}
        for wid, plan in planned.items():
            where = f"plan for {wid!r}"
            resident = held[wid].residents
            for rid in plan.admit:
                record = core.request_record(rid)
                if record is None or record.status not in (RequestStatus.QUEUED, RequestStatus.PAUSED):
                    status = "unknown" if record is None else record.status.value
                    raise fail(f"{where} admits {rid!r}, which is not waiting ({status})")
                if not record.ready:
                    raise fail(f"{where} admits {rid!r}, which is not ready (conditioning still in flight)")
                if record.status is RequestStatus.PAUSED and record.host_state is None:
                    raise fail(f"{where} admits paused {rid!r}, which has no state to resume from")
                if wid in admitted.get(rid, ()):
                    raise fail(f"{where} admits {rid!r} twice")
                admitted.setdefault(rid, []).append(wid)
            in_plan: set[str] = set()
            for index, group in enumerate(plan.groups):
                if not group.request_ids:
                    raise fail(f"{where}: group {index} is empty")
                keys = set()
                for rid in group.request_ids:
                    if rid in in_plan:
                        raise fail(f"{where} steps {rid!r} twice")
                    in_plan.add(rid)
                    record = core.request_record(rid)
                    if record is None or record.status.is_terminal:
                        raise fail(f"{where} steps {rid!r}, which is not live")
                    if rid not in resident and rid not in plan.admit:
                        raise fail(f"{where} steps {rid!r}, which is not resident on it")
                    if rid in held[wid].drops and rid not in plan.admit:
                        raise fail(f"{where} steps {rid!r}, which was dropped (cancelled or lost)")
                    if not record.needs_steps:
                        raise fail(f"{where} steps {rid!r}, whose last step is already planned")
                    keys.add(core.batch_key(record.spec))
                    stepped.setdefault(rid, []).append((wid, group.ranks))
                if len(keys) > 1:
                    raise fail(f"{where}: group {index} mixes shapes {sorted(keys)}")
                if group.ranks:
                    if not core.sp_available:
                        raise fail(f"{where}: an SP group while the workers' world is down")
                    if len(group.request_ids) != 1 or len(group.ranks) < 2 or list(group.ranks) != sorted(
                            set(group.ranks)):
                        raise fail(f"{where}: an SP group holds one request and two or more sorted ranks")
                    if group.split is GroupSplit.CFG and (len(group.ranks) != 2 or record.spec.rows != 2):
                        raise fail(f"{where}: a CFG split runs one CFG request's two rows on two ranks")
            for rid in plan.export:
                if rid not in resident and rid not in plan.admit:
                    raise fail(f"{where} exports {rid!r}, which is not resident on it")
                if rid in exported:
                    raise fail(f"{rid!r} is exported twice")
                exported[rid] = wid
            for rid in plan.release:
                if rid not in resident:
                    raise fail(f"{where} releases {rid!r}, which is not resident on it")
                released.setdefault(rid, set()).add(wid)
            leaving = set(plan.export) | set(plan.release)
            after = len([r for r in resident if r not in leaving]) + len([r for r in plan.admit if r not in leaving])
            if after > held[wid].slot.max_batch_size:
                raise fail(f"{where}: {after} resident requests exceed max_batch_size "
                           f"{held[wid].slot.max_batch_size}")

        def rank(worker_id: str) -> int:
            return held[worker_id].slot.rank

        for rid, steps in stepped.items():
            record = request(rid)
            workers = tuple(sorted({w for w, _ in steps}, key=rank))
            holders = (set(record.workers) | set(admitted.get(rid, ()))) - released.get(rid, set())
            group_ranks = {r for _, r in steps}
            if len(group_ranks) != 1:
                raise fail(f"{rid!r} steps in different groups on {workers}")
            sp = group_ranks.pop()
            if sp:
                if tuple(sorted(rank(w) for w in workers)) != sp or holders != set(workers):
                    raise fail(f"{rid!r}: SP group {sp} does not match the workers holding and stepping it {workers}")
            elif len(workers) != 1 or holders != set(workers):
                raise fail(f"{rid!r} steps on {workers} but is held by {sorted(holders)}")
        for rid, wids in admitted.items():
            if len(wids) > 1 and rid not in stepped:
                raise fail(f"{rid!r} is admitted on {wids} without an SP step")
        for rid, wid in exported.items():
            others = set(request(rid).workers) | set(admitted.get(rid, ()))
            others.discard(wid)
            if released.get(rid, set()) != others:
                raise fail(f"{rid!r} is exported from {wid!r} but its other holders {sorted(others)} do not release it")
        for rid, wids in released.items():
            # Every holder of a split request holds all of it: all but one may let it go.
            if rid not in exported and not set(request(rid).workers) - wids:
                raise fail(f"{rid!r} is released on {sorted(wids)} by every holder, without an export")
        planned_ids = set(admitted) | set(stepped) | set(exported) | set(released)
        for failure in decision.discard:
            rid = failure.request_id
            record = core.request_record(rid)
            if record is None or record.status not in (RequestStatus.QUEUED, RequestStatus.PAUSED):
                status = "unknown" if record is None else record.status.value
                raise fail(f"discards {rid!r}, which is not waiting ({status})")
            if rid in planned_ids:
                raise fail(f"discards {rid!r} and plans it in the same decision")
