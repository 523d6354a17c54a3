"""RouterCore: the Ray-free router state machine, driven by a pure-Python fake worker."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from stepserve.actors.router_core import (
    DuplicateRequestError,
    QueueFullError,
    RouterCore,
    WorkerSlot,
)
from stepserve.policies import (
    PolicyError,
    RequestProgress,
    RequestSpec,
    RequestStatus,
    ShapeKey,
    StepReport,
    WorkerPlan,
    make_policy,
)

S = RequestStatus


def spec(rid, steps=10, height=64, width=64, model="sd"):
    return RequestSpec(
        request_id=rid,
        model=model,
        prompt="a cat",
        width=width,
        height=height,
        num_inference_steps=steps,
        guidance_scale=7.5,
        seed=0,
    )


def core(policy="continuous", workers=(("w0", 4),), max_queue_len=100):
    return RouterCore(
        make_policy(policy) if isinstance(policy, str) else policy,
        [WorkerSlot(wid, cap) for wid, cap in workers],
        max_queue_len,
    )


@dataclass
class FakeWorker:
    """Test double for a denoiser worker: holds (done, total) per request, one step per plan."""

    worker_id: str
    max_batch_size: int
    steps_of: dict  # request_id -> total steps, as the real worker would read from the spec
    residents: dict = field(default_factory=dict)
    steps_run: dict = field(default_factory=dict)  # request_id -> steps executed, ever

    def execute(self, plan: WorkerPlan) -> StepReport:
        assert plan.worker_id == self.worker_id
        for rid in plan.drop:
            assert rid in self.residents, f"drop of non-resident {rid}"
            del self.residents[rid]
        for rid in plan.admit:
            assert rid not in self.residents
            self.residents[rid] = [0, self.steps_of[rid]]
        assert len(self.residents) <= self.max_batch_size
        stepping = plan.stepping
        assert len(set(stepping)) == len(stepping)
        for rid in stepping:
            assert rid in self.residents, f"step of non-resident {rid}"
            self.residents[rid][0] += 1
            self.steps_run[rid] = self.steps_run.get(rid, 0) + 1
        touched = list(dict.fromkeys(list(plan.admit) + list(stepping)))
        progress = tuple(RequestProgress(rid, *self.residents[rid]) for rid in touched)
        finished = tuple(rid for rid in stepping if self.residents[rid][0] >= self.residents[rid][1])
        for rid in finished:
            del self.residents[rid]
        return StepReport(self.worker_id, progress, finished, batch_size=len(stepping))


class FixedPolicy:
    """Test double: returns whatever plan it was given."""

    name = "fixed"

    def __init__(self, plan):
        self.next = plan

    def plan(self, snapshot, worker_id):
        return self.next


# ---- submit / state ----


def test_submit_queues_with_initial_state():
    c = core()
    c.submit(spec("a", steps=25), now=1.5)
    st = c.state("a")
    assert (st.status, st.steps_done, st.steps_total, st.worker_id) == (S.QUEUED, 0, 25, None)
    assert st.arrival_time == 1.5 and st.admit_time is None and st.finish_time is None
    assert c.queue_length == 1 and c.num_running == 0
    (view,) = c.snapshot(2.0).queued
    assert view.ready is False and view.shape_key == ShapeKey("sd", 64, 64) and view.uses_cfg


def test_queue_full_and_duplicates():
    c = core(max_queue_len=2)
    c.submit(spec("a"), 0)
    with pytest.raises(DuplicateRequestError):
        c.submit(spec("a"), 0)
    c.submit(spec("b"), 0)
    with pytest.raises(QueueFullError):
        c.submit(spec("c"), 0)
    assert c.queue_length == 2


def test_running_id_is_still_a_duplicate_but_terminal_id_can_return():
    c = core()
    c.submit(spec("a"), 0)
    c.mark_ready("a")
    c.next_plan("w0", 0)
    with pytest.raises(DuplicateRequestError):
        c.submit(spec("a"), 1)
    assert c.cancel("a", 1)
    c.submit(spec("a", steps=5), 2)
    assert c.state("a").status is S.QUEUED and c.state("a").steps_total == 5


def test_unready_requests_are_not_admitted_and_not_work():
    c = core()
    c.submit(spec("a"), 0)
    assert not c.has_work("w0")
    assert c.next_plan("w0", 0).is_empty
    c.mark_ready("a")
    c.mark_ready("unknown")  # ignored
    assert c.has_work("w0")
    plan = c.next_plan("w0", 3.0)
    assert plan.admit == ("a",) and plan.groups == (("a",),)
    st = c.state("a")
    assert (st.status, st.worker_id, st.admit_time) == (S.RUNNING, "w0", 3.0)
    assert c.queue_length == 0 and c.num_running == 1


def test_apply_takes_totals_from_worker_and_finishes():
    c = core()
    c.submit(spec("a", steps=10), 0)
    c.mark_ready("a")
    c.next_plan("w0", 0)
    # The worker decided the request needs 4 steps (e.g. img2img strength).
    assert c.apply(StepReport("w0", (RequestProgress("a", 3, 4),), ()), 1) == []
    assert (c.state("a").steps_done, c.state("a").steps_total) == (3, 4)
    assert c.apply(StepReport("w0", (RequestProgress("a", 4, 4),), ("a",)), 2) == ["a"]
    st = c.state("a")
    assert (st.status, st.steps_done, st.finish_time) == (S.FINISHED, 4, 2)
    assert c.num_running == 0 and not c.has_work("w0")
    assert c.snapshot(2).worker("w0").running == ()


def test_apply_failed_records_message():
    c = core()
    for rid in "ab":
        c.submit(spec(rid), 0)
        c.mark_ready(rid)
    c.next_plan("w0", 0)
    out = c.apply(StepReport("w0", (), ("a",), failed=(("b", "NaN latents"),)), 1)
    assert out == ["a", "b"]
    assert c.state("b").status is S.FAILED and c.state("b").error == "NaN latents"
    # Reporting the same ids again is stale, not a second ending.
    assert c.apply(StepReport("w0", (), ("a",), failed=(("b", "again"),)), 2) == []
    assert c.state("b").error == "NaN latents"


def test_report_naming_another_workers_request_is_rejected_without_change():
    c = core(workers=(("w0", 4), ("w1", 4)))
    for rid in "ab":
        c.submit(spec(rid), 0)
        c.mark_ready(rid)
    c.next_plan("w0", 0)  # takes a (join-shortest-queue leaves b for w1)
    c.next_plan("w1", 0)
    bad = StepReport("w1", (RequestProgress("b", 1, 10),), ("a",))
    with pytest.raises(ValueError, match="'a'"):
        c.apply(bad, 1)
    assert c.state("b").steps_done == 0 and c.state("a").status is S.RUNNING


# ---- cancel / failure / forget ----


def test_cancel_queued_is_immediate():
    c = core()
    c.submit(spec("a"), 0)
    c.mark_ready("a")
    assert c.cancel("a", 1.0)
    assert c.state("a").status is S.CANCELLED and c.state("a").finish_time == 1.0
    assert c.queue_length == 0 and c.snapshot(1).queued == ()
    assert not c.has_work("w0")
    assert not c.cancel("a", 2.0)
    assert not c.cancel("nobody", 2.0)


def test_cancel_running_is_dropped_at_next_plan():
    c = core()
    for rid in "ab":
        c.submit(spec(rid), 0)
        c.mark_ready(rid)
    c.next_plan("w0", 0)
    assert c.cancel("a", 0.5)
    assert c.state("a").status is S.CANCELLED
    snap = c.snapshot(0.5)
    assert [r.request_id for r in snap.running] == ["b"] and snap.worker("w0").running == ("b",)
    # Progress for the cancelled request, from the round already in flight, is ignored.
    c.apply(StepReport("w0", (RequestProgress("a", 1, 10), RequestProgress("b", 1, 10)), ()), 1)
    assert c.state("a").steps_done == 0 and c.state("b").steps_done == 1
    assert c.has_work("w0")
    plan = c.next_plan("w0", 1)
    assert plan.drop == ("a",) and plan.groups == (("b",),)
    assert c.next_plan("w0", 2).drop == ()  # dropped once


def test_cancelled_request_that_finished_anyway_is_not_dropped():
    c = core()
    c.submit(spec("a", steps=1), 0)
    c.mark_ready("a")
    c.next_plan("w0", 0)
    c.cancel("a", 0.5)
    assert c.apply(StepReport("w0", (RequestProgress("a", 1, 1),), ("a",)), 1) == []
    assert c.state("a").status is S.CANCELLED
    assert not c.has_work("w0")
    assert c.next_plan("w0", 1).drop == ()


def test_worker_failed_fails_residents_only():
    c = core(workers=(("w0", 2), ("w1", 2)))
    for rid in "abc":
        c.submit(spec(rid), 0)
        c.mark_ready(rid)
    c.next_plan("w0", 0)
    c.next_plan("w1", 0)
    on_w0 = list(c.snapshot(0).worker("w0").running)
    assert c.worker_failed("w0", "CUDA error", 1.0) == on_w0
    for rid in on_w0:
        st = c.state(rid)
        assert (st.status, st.error, st.finish_time) == (S.FAILED, "CUDA error", 1.0)
    assert c.snapshot(1).worker("w0").running == ()
    assert c.snapshot(1).worker("w1").running != ()
    assert c.worker_failed("w0", "again", 2.0) == []
    # Stale reports from the dead worker are ignored.
    assert c.apply(StepReport("w0", (), tuple(on_w0)), 2.0) == []


def test_forget_only_terminal():
    c = core()
    c.submit(spec("a"), 0)
    with pytest.raises(ValueError):
        c.forget("a")
    c.cancel("a", 1)
    c.forget("a")
    c.forget("a")  # idempotent
    with pytest.raises(KeyError):
        c.state("a")


def test_snapshot_orders_follow_submission_and_admission():
    c = core(workers=(("w0", 8),))
    ids = ["z", "m", "a", "q"]
    for rid in ids:
        c.submit(spec(rid), 0)
    for rid in reversed(ids):
        c.mark_ready(rid)
    assert [r.request_id for r in c.snapshot(0).queued] == ids
    c.next_plan("w0", 0)
    assert c.snapshot(0).worker("w0").running == tuple(ids)
    assert [r.request_id for r in c.snapshot(0).running] == ids


def test_constructor_validation():
    with pytest.raises(ValueError):
        core(workers=())
    with pytest.raises(ValueError):
        core(workers=(("w0", 1), ("w0", 2)))
    with pytest.raises(ValueError):
        core(workers=(("w0", 0),))
    with pytest.raises(ValueError):
        core(max_queue_len=0)
    with pytest.raises(KeyError):
        core().next_plan("nope", 0)


# ---- plan validation ----


def _bad_plan_fixture():
    """a, b running on w0 (cap 3); b cancelled; c queued+ready; d queued, not ready; e on w1."""
    policy = FixedPolicy(None)
    c = core(policy, workers=(("w0", 3), ("w1", 3)))
    for rid, h in [("a", 64), ("b", 64), ("c", 64), ("d", 64), ("e", 128), ("f", 128), ("g", 64)]:
        c.submit(spec(rid, height=h), 0)
    for rid in "abcefg":
        c.mark_ready(rid)
    policy.next = WorkerPlan("w0", admit=("a", "b"), groups=(("a", "b"),))
    c.next_plan("w0", 0)
    policy.next = WorkerPlan("w1", admit=("e",), groups=(("e",),))
    c.next_plan("w1", 0)
    c.cancel("b", 0)
    return c, policy


BAD_PLANS = {
    "admit unknown": (WorkerPlan("w0", admit=("zz",)), "not queued"),
    "admit not ready": (WorkerPlan("w0", admit=("d",)), "not ready"),
    "admit running": (WorkerPlan("w0", admit=("e",)), "not queued"),
    "admit cancelled": (WorkerPlan("w0", admit=("b",)), "not queued"),
    "admit twice": (WorkerPlan("w0", admit=("c", "c")), "twice"),
    "over capacity": (WorkerPlan("w0", admit=("c", "f", "g")), "max_batch_size"),
    "step non-resident": (WorkerPlan("w0", groups=(("a", "c"),)), "not resident"),
    "step other worker's": (WorkerPlan("w0", groups=(("e",),)), "not resident"),
    "step cancelled": (WorkerPlan("w0", groups=(("a", "b"),)), "cancelled"),
    "mixed shapes": (WorkerPlan("w0", admit=("f",), groups=(("a", "f"),)), "mixes shape"),
    "stepped twice": (WorkerPlan("w0", groups=(("a",), ("a",))), "twice"),
    "empty group": (WorkerPlan("w0", groups=((),)), "empty"),
    "policy sets drop": (WorkerPlan("w0", drop=("a",)), "drop"),
    "wrong worker": (WorkerPlan("w1"), "addressed"),
    "not a plan": ("admit everything", "WorkerPlan"),
}


@pytest.mark.parametrize("case", sorted(BAD_PLANS))
def test_bad_plans_raise_policy_error_and_change_nothing(case):
    c, policy = _bad_plan_fixture()
    before = [c.state(rid) for rid in "abcdefg"]
    snap_before = c.snapshot(1)
    policy.next, fragment = BAD_PLANS[case]
    with pytest.raises(PolicyError, match=fragment):
        c.next_plan("w0", 1)
    assert [c.state(rid) for rid in "abcdefg"] == before
    assert c.snapshot(1) == snap_before
    # The pending drop of b survives the rejected plan.
    policy.next = WorkerPlan("w0", groups=(("a",),))
    assert c.next_plan("w0", 2).drop == ("b",)


def test_good_plan_passes_the_same_fixture():
    c, policy = _bad_plan_fixture()
    policy.next = WorkerPlan("w0", admit=("c", "g"), groups=(("a", "c", "g"),))
    plan = c.next_plan("w0", 1)
    assert plan.drop == ("b",) and plan.admit == ("c", "g")


# ---- driving the core with a fake cluster ----


@dataclass
class Arrival:
    time: int
    spec: RequestSpec
    ready_delay: int = 0


@dataclass
class SimResult:
    core: RouterCore
    ended: dict  # request_id -> how it ended, recorded once
    plans: list  # (time, worker_id, plan)
    workers: dict


def simulate(policy_name, arrivals, workers, cancels=(), failures=(), options=None,
             check=None, max_rounds=5000):
    """One round = one time unit: each worker with work runs one step, then reports.

    cancels: [(time, request_id)], failures: [(time, worker_id)], applied at the round start.
    check(core, worker_id, snapshot_before, plan) runs after every plan.
    """
    c = RouterCore(make_policy(policy_name, options),
                   [WorkerSlot(w, cap) for w, cap in workers], max_queue_len=10_000)
    steps_of = {a.spec.request_id: a.spec.num_inference_steps for a in arrivals}
    fakes = {w: FakeWorker(w, cap, steps_of) for w, cap in workers}
    ended: dict[str, RequestStatus] = {}
    plans = []

    def end(rid, how):
        assert rid not in ended, f"{rid} ended twice ({ended[rid]}, then {how})"
        ended[rid] = how

    pending = sorted(arrivals, key=lambda a: a.time)
    t = 0
    while len(ended) < len(arrivals):
        assert t < max_rounds, "simulation did not drain"
        for a in pending:
            if a.time == t:
                c.submit(a.spec, t)
            if a.time + a.ready_delay == t:
                c.mark_ready(a.spec.request_id)
        for when, rid in cancels:
            if when == t and c.cancel(rid, t):
                end(rid, S.CANCELLED)
        for when, wid in failures:
            if when == t:
                for rid in c.worker_failed(wid, "boom", t):
                    end(rid, S.FAILED)
                fakes[wid].residents.clear()
        for wid, _ in workers:
            if not c.has_work(wid):
                continue
            before = c.snapshot(t)
            plan = c.next_plan(wid, t)
            plans.append((t, wid, plan))
            if check is not None:
                check(c, wid, before, plan)
            report = fakes[wid].execute(plan)
            for rid in c.apply(report, t + 1):
                end(rid, c.state(rid).status)
        t += 1
    return SimResult(c, ended, plans, fakes)


def random_workload(rng, n, keys, steps=(3, 5, 8, 12), horizon=40):
    return [
        Arrival(
            rng.randint(0, horizon),
            spec(f"r{i:03d}", rng.choice(steps), height=rng.choice(keys)),
            rng.choice([0, 0, 1, 3]),
        )
        for i in range(n)
    ]


def check_continuous(c, wid, before, plan):
    me = before.worker(wid)
    ready = [r.request_id for r in before.queued if r.ready]
    # FCFS over all ready requests, and everyone resident steps.
    assert list(plan.admit) == ready[: len(plan.admit)]
    assert sorted(plan.stepping) == sorted(list(me.running) + list(plan.admit))
    # Join-shortest-queue: never more than one ahead of the least-loaded peer with room.
    peers = [len(w.running) for w in before.workers
             if w.worker_id != wid and len(w.running) < w.max_batch_size]
    load_after = len(me.running) + len(plan.admit)
    if plan.admit and peers:
        assert load_after <= min(peers) + 1
    # It stops early only for a reason: full, out of ready work, or ahead of a peer.
    if len(plan.admit) < len(ready) and load_after < me.max_batch_size:
        assert peers and load_after > min(peers)


def check_static(c, wid, before, plan):
    me = before.worker(wid)
    if me.running:
        assert plan.admit == ()
        assert sorted(plan.stepping) == sorted(me.running)
        return
    ready = [r for r in before.queued if r.ready]
    if not ready:
        assert plan.admit == ()
        return
    head = ready[0]
    same = [r.request_id for r in ready
            if (r.shape_key, r.steps_total) == (head.shape_key, head.steps_total)]
    assert list(plan.admit) == same[: me.max_batch_size]
    assert plan.groups == (plan.admit,)


CHECKS = {"continuous": check_continuous, "static_fcfs": check_static}


@pytest.mark.parametrize("policy_name", sorted(CHECKS))
@pytest.mark.parametrize("seed", range(25))
def test_random_workloads_keep_invariants(policy_name, seed):
    rng = random.Random(seed)
    workers = [(f"w{i}", rng.randint(1, 4)) for i in range(rng.randint(1, 3))]
    arrivals = random_workload(rng, rng.randint(5, 40), keys=[64, 128])
    ids = [a.spec.request_id for a in arrivals]
    cancels = [(rng.randint(0, 60), rid) for rid in rng.sample(ids, k=len(ids) // 6)]
    failures = [(rng.randint(5, 60), workers[0][0])] if rng.random() < 0.3 else []

    result = simulate(policy_name, arrivals, workers, cancels, failures,
                      check=CHECKS[policy_name])

    assert sorted(result.ended) == sorted(ids)  # every request ended, exactly once (see end())
    c = result.core
    for rid, how in result.ended.items():
        st = c.state(rid)
        assert st.status is how
        ran = sum(f.steps_run.get(rid, 0) for f in result.workers.values())
        if how is S.FINISHED:
            assert st.steps_done == st.steps_total == ran
            assert st.admit_time is not None and st.finish_time > st.admit_time >= st.arrival_time
        else:
            assert ran <= st.steps_total
    assert c.queue_length == 0 and c.num_running == 0
    assert all(not f.residents for f in result.workers.values())
    for rid, how in result.ended.items():
        if how is S.FAILED:
            assert c.state(rid).error == "boom" and c.state(rid).worker_id == workers[0][0]


@pytest.mark.parametrize("seed", range(10))
def test_fcfs_among_equal_keys_over_whole_run(seed):
    """Among requests ready at the same time with equal keys, admission follows arrival."""
    rng = random.Random(100 + seed)
    arrivals = random_workload(rng, 30, keys=[64, 128], steps=(4, 4, 9))
    for policy_name in CHECKS:
        result = simulate(policy_name, arrivals, [("w0", 3), ("w1", 2)])
        c = result.core
        by_key: dict = {}
        for a in sorted(arrivals, key=lambda a: (a.time, a.spec.request_id)):
            key = (a.spec.shape_key, a.spec.num_inference_steps)
            by_key.setdefault(key, []).append(a)
        for group in by_key.values():
            for x in group:
                for y in group:
                    # x submitted before y and ready no later than y: x is admitted no later.
                    x_first = (x.time, x.spec.request_id) < (y.time, y.spec.request_id)
                    if x_first and x.time + x.ready_delay <= y.time + y.ready_delay:
                        ax = c.state(x.spec.request_id).admit_time
                        ay = c.state(y.spec.request_id).admit_time
                        assert ax <= ay, (policy_name, x.spec.request_id, y.spec.request_id)


def test_new_request_joins_running_worker_only_under_continuous():
    arrivals = [Arrival(0, spec("long", 10)), Arrival(3, spec("late", 2))]
    cont = simulate("continuous", arrivals, [("w0", 4)]).core
    assert cont.state("late").admit_time == 3  # next step boundary after arrival
    assert cont.state("late").finish_time == 5
    assert cont.state("long").finish_time == 10

    static = simulate("static_fcfs", arrivals, [("w0", 4)]).core
    assert static.state("late").admit_time == 10  # waits for the whole batch
    assert static.state("late").finish_time == 12


def test_join_shortest_queue_balances_two_workers():
    arrivals = [Arrival(0, spec(f"r{i}", 20)) for i in range(6)]
    result = simulate("continuous", arrivals, [("w0", 4), ("w1", 4)])
    # Round 0: w0 takes 1, w1 (seeing w0 at 1) takes 2; round 1 tops both up to 3.
    first = [(t, w, plan.admit) for t, w, plan in result.plans if plan.admit]
    assert first == [
        (0, "w0", ("r0",)),
        (0, "w1", ("r1", "r2")),
        (1, "w0", ("r3", "r4")),
        (1, "w1", ("r5",)),
    ]
    placed = {w: [rid for rid in (f"r{i}" for i in range(6))
                  if result.core.state(rid).worker_id == w] for w in ("w0", "w1")}
    assert len(placed["w0"]) == len(placed["w1"]) == 3


def test_cancel_and_worker_failure_in_a_run():
    arrivals = [Arrival(0, spec(f"r{i}", 6)) for i in range(5)]
    result = simulate(
        "continuous", arrivals, [("w0", 2), ("w1", 2)],
        cancels=[(0, "r4"), (2, "r0")],  # r4 still queued, r0 running
        failures=[(3, "w1")],
    )
    c = result.core
    assert result.ended["r4"] is S.CANCELLED and c.state("r4").admit_time is None
    assert result.ended["r0"] is S.CANCELLED and result.workers["w0"].steps_run["r0"] == 2
    failed = sorted(rid for rid, how in result.ended.items() if how is S.FAILED)
    assert failed and all(c.state(rid).worker_id == "w1" for rid in failed)
    assert all(c.state(rid).error == "boom" for rid in failed)
    drops = [plan.drop for _, _, plan in result.plans if plan.drop]
    assert drops == [("r0",)]
    finished = [rid for rid, how in result.ended.items() if how is S.FINISHED]
    assert finished and all(c.state(rid).steps_done == 6 for rid in finished)


def mean_completion(result):
    c = result.core
    times = [c.state(rid).finish_time - c.state(rid).arrival_time for rid in result.ended]
    return sum(times) / len(times)


@pytest.mark.parametrize("seed", range(5))
def test_continuous_beats_static_on_mixed_step_counts(seed):
    rng = random.Random(seed)
    arrivals = [
        Arrival(rng.randint(0, 150), spec(f"r{i:02d}", rng.choice([10, 20, 30, 50])))
        for i in range(40)
    ]
    workers = [("w0", 4), ("w1", 4)]
    cont = simulate("continuous", arrivals, workers)
    static = simulate("static_fcfs", arrivals, workers)
    assert all(how is S.FINISHED for how in cont.ended.values())
    assert all(how is S.FINISHED for how in static.ended.values())
    assert mean_completion(cont) < mean_completion(static)


def test_fail_ends_queued_and_running_requests_with_a_message():
    core = RouterCore(make_policy("continuous"), [WorkerSlot("w0", 4)], max_queue_len=8)
    core.submit(_spec_for_fail("q"), 0.0)
    core.submit(_spec_for_fail("r"), 0.0)
    core.mark_ready("r")
    assert core.next_plan("w0", 1.0).admit == ("r",)
    assert core.fail("q", "encoder down", 2.0) and core.fail("r", "encoder down", 2.0)
    assert core.state("q").status is RequestStatus.FAILED and core.state("q").error == "encoder down"
    assert core.next_plan("w0", 3.0).drop == ("r",)  # the worker still held r
    assert not core.fail("q", "again", 4.0)  # terminal stays terminal
    assert core.queue_length == 0 and core.num_running == 0


def _spec_for_fail(rid):
    return RequestSpec(request_id=rid, model="m", prompt="p", width=64, height=64, num_inference_steps=3,
                       guidance_scale=1.0, seed=0)
