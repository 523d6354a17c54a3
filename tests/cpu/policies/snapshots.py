"""Builders for hand-made `ClusterSnapshot`s, and the plan invariants every policy test checks.

A snapshot is written as `{worker_id: slot(cap, residents, open=..., busy=..., decoding=...)}`
(or a plain `(cap, residents)` pair) plus the queue; worker ranks follow the mapping's order.
Residents built with `req`/`video` and no workers are placed on the worker that lists them; a
video already spread over an SP group (`video(..., on=(...))`) is listed by every member and
appears once in `running`, under its first worker, as the router core lists it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from stepserve.policies.types import (
    ClusterSnapshot,
    Decision,
    RequestKind,
    RequestStatus,
    RequestView,
    ShapeKey,
    StepGroup,
    WorkerPlan,
    WorkerView,
)

SMALL = ShapeKey("sd", 64, 64)
LARGE = ShapeKey("sd", 128, 128)
CLIP = ShapeKey("wan", 480, 832, 81)  # FakeCosts' video unit: 4 s a step at degree 1


def req(rid: str, key: ShapeKey = SMALL, arrival: float = 0.0, ready: bool = True, steps: int = 10, done: int = 0,
        rows: int = 2, deadline: float = math.inf) -> RequestView:
    """A queued image (placed on a worker when a slot lists it)."""
    return RequestView(rid, RequestKind.T2I, key, rows, done, steps, arrival, deadline, ready,
                       RequestStatus.QUEUED)


def video(rid: str, key: ShapeKey = CLIP, arrival: float = 0.0, ready: bool = True, steps: int = 40, done: int = 0,
          deadline: float = math.inf, on: tuple[str, ...] = (), paused: bool = False, rows: int = 2) -> RequestView:
    """A video: running on the SP group `on`, else paused or queued."""
    status = RequestStatus.RUNNING if on else (RequestStatus.PAUSED if paused else RequestStatus.QUEUED)
    return RequestView(rid, RequestKind.T2V, key, rows, done, steps, arrival, deadline, ready, status, tuple(on))


@dataclass(frozen=True)
class Slot:
    max_batch_size: int
    residents: tuple[RequestView, ...] = ()
    open: bool = True
    busy: bool = False
    decoding: bool = False
    loras: frozenset[tuple[str, str]] = frozenset()


def slot(cap: int, residents: Sequence[RequestView] = (), *, open: bool = True, busy: bool = False,
         decoding: bool = False, loras: frozenset[tuple[str, str]] = frozenset()) -> Slot:
    return Slot(cap, tuple(residents), open, busy, decoding, loras)


def snap(workers: Mapping[str, Slot | tuple[int, Sequence[RequestView]]], queued: Sequence[RequestView] = (),
         now: float = 0.0, sp_available: bool = True,
         step_overhead_s: tuple[tuple[RequestKind, float], ...] = ()) -> ClusterSnapshot:
    running: list[RequestView] = []
    views: list[WorkerView] = []
    for rank, (wid, spec) in enumerate(workers.items()):
        s = spec if isinstance(spec, Slot) else slot(spec[0], spec[1])
        placed = []
        for r in s.residents:
            if not r.workers:
                r = replace(r, status=RequestStatus.RUNNING, workers=(wid,))
            # A builder mistake would make every assertion below it meaningless.
            assert wid in r.workers and r.status is RequestStatus.RUNNING, (wid, r)
            placed.append(r)
            if r.workers[0] == wid:
                running.append(r)
        views.append(WorkerView(wid, rank, s.max_batch_size, tuple(r.request_id for r in placed), open=s.open,
                                busy=s.busy, decoding=s.decoding, loras=s.loras))
    listed = {w.worker_id: w.running for w in views}
    for r in running:
        assert all(r.request_id in listed[w] for w in r.workers), f"{r.request_id} not listed by all of {r.workers}"
    for q in queued:
        assert q.status in (RequestStatus.QUEUED, RequestStatus.PAUSED) and not q.workers, q
    return ClusterSnapshot.of(now, tuple(queued), tuple(running), tuple(views), sp_available, step_overhead_s)


def steps(*groups: Sequence[str]) -> tuple[StepGroup, ...]:
    """Groups that run on one worker alone (no SP ranks), as a plan must list them."""
    return tuple(StepGroup(tuple(g)) for g in groups)


def only_plan(decision: Decision, worker_id: str) -> WorkerPlan:
    """The plan a per-worker policy returned for `worker_id` (an empty plan when it returned none).

    A per-worker policy answers for the worker it was asked about, at most once, and sends no
    empty plan: an empty plan would cost that worker a round trip for nothing.
    """
    assert isinstance(decision, Decision)
    assert len(decision.plans) <= 1, decision
    if not decision.plans:
        return WorkerPlan(worker_id)
    plan = decision.plans[0]
    assert plan.worker_id == worker_id
    assert not plan.is_empty
    return plan


def plan_on(decision: Decision, worker_id: str) -> WorkerPlan:
    """The decision's plan for one worker, or an empty plan if it has none."""
    found = [p for p in decision.plans if p.worker_id == worker_id]
    assert len(found) <= 1, f"{worker_id} planned {len(found)} times"
    return found[0] if found else WorkerPlan(worker_id)


def assert_executable(snapshot: ClusterSnapshot, decision: Decision) -> None:
    """The rules of stepserve/routing/plan_check.py, written again against the snapshot alone (the checker
    reads the router core's private state, which a hand-made snapshot does not have)."""
    workers = {w.worker_id: w for w in snapshot.workers}
    waiting = {v.request_id: v for v in snapshot.queued}
    views = {v.request_id: v for v in snapshot.queued + snapshot.running}
    planned: dict[str, WorkerPlan] = {}
    for plan in decision.plans:
        w = workers.get(plan.worker_id)
        assert w is not None, f"plans unknown worker {plan.worker_id}"
        assert w.open, f"plans {plan.worker_id}, which is not open"
        assert plan.worker_id not in planned, f"plans {plan.worker_id} twice"
        assert not (plan.drop or plan.checkpoint or plan.finish or plan.plan_id), "router-filled fields set"
        assert not plan.is_empty, f"an empty plan for {plan.worker_id}"
        planned[plan.worker_id] = plan

    admitted: dict[str, list[str]] = {}
    stepped: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    exported: dict[str, str] = {}
    released: dict[str, set[str]] = {}
    for wid, plan in planned.items():
        resident = set(workers[wid].running)
        assert len(set(plan.admit)) == len(plan.admit), f"{wid} admits twice: {plan.admit}"
        for rid in plan.admit:
            assert rid in waiting, f"{wid} admits {rid}, which is not waiting"
            assert waiting[rid].ready, f"{wid} admits {rid}, which is not ready"
            admitted.setdefault(rid, []).append(wid)
        in_plan: set[str] = set()
        for group in plan.groups:
            assert group.request_ids, f"{wid}: an empty group"
            for rid in group.request_ids:
                assert rid not in in_plan, f"{wid} steps {rid} twice"
                in_plan.add(rid)
                assert rid in resident or rid in plan.admit, f"{wid} steps {rid}, which is not resident"
                assert views[rid].steps_left >= 1, f"{wid} steps {rid}, which has no step left"
                stepped.setdefault(rid, []).append((wid, group.ranks))
            assert len({views[rid].shape_key for rid in group.request_ids}) == 1, f"{wid}: a group mixes shapes"
            if group.ranks:
                assert snapshot.sp_available, f"{wid}: an SP group while SP is unavailable"
                assert len(group.request_ids) == 1, f"{wid}: an SP group holds one request"
                assert len(group.ranks) >= 2 and list(group.ranks) == sorted(set(group.ranks)), group
        for rid in plan.export:
            assert rid in resident or rid in plan.admit, f"{wid} exports {rid}, which is not resident"
            assert rid not in exported, f"{rid} exported twice"
            exported[rid] = wid
        for rid in plan.release:
            assert rid in resident, f"{wid} releases {rid}, which is not resident"
            released.setdefault(rid, set()).add(wid)
        leaving = set(plan.export) | set(plan.release)
        after = len(resident - leaving) + len([r for r in plan.admit if r not in leaving])
        assert after <= workers[wid].max_batch_size, f"{wid} would hold {after} > {workers[wid].max_batch_size}"

    rank = {wid: w.rank for wid, w in workers.items()}
    for rid, where in stepped.items():
        holders = set(views[rid].workers) | set(admitted.get(rid, ()))
        on = {w for w, _ in where}
        ranks = {r for _, r in where}
        assert len(ranks) == 1, f"{rid} steps in different groups"
        sp = ranks.pop()
        if sp:
            assert tuple(sorted(rank[w] for w in on)) == sp and holders == on, f"{rid}: SP group {sp} vs {on}"
        else:
            assert len(on) == 1 and holders == on, f"{rid} steps on {on}, held by {holders}"
    for rid, wids in admitted.items():
        assert len(wids) == 1 or rid in stepped, f"{rid} admitted on {wids} without an SP step"
    for rid, wid in exported.items():
        others = (set(views[rid].workers) | set(admitted.get(rid, ()))) - {wid}
        assert released.get(rid, set()) == others, f"{rid} exported from {wid}; its other holders must release it"
    for rid in released:
        assert rid in exported, f"{rid} released without an export"
    planned_ids = set(admitted) | set(stepped) | set(exported) | set(released)
    for failure in decision.discard:
        assert failure.request_id in waiting, f"discards {failure.request_id}, which is not waiting"
        assert failure.request_id not in planned_ids, f"discards {failure.request_id} and plans it"
