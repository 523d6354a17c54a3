"""`PerWorker`: a per-worker policy asked worker by worker within one round of the pool.

The policies here are real `WorkerPolicy`s: the three registered ones, a recorder around one of
them, and small test-local policies whose answers are written out by hand.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from stepserve.policies import Decision, PerWorker, PolicyError, RequestStatus, WorkerPlan, make_policy
from stepserve.policies.continuous import ContinuousBatching, ContinuousConfig
from stepserve.policies.dynamic_batching import DynamicBatching, DynamicBatchingConfig
from stepserve.policies.static_fcfs import StaticFCFS, StaticFCFSConfig

from tests.cpu.policies.snapshots import LARGE, SMALL, assert_executable, plan_on, req, slot, snap, steps


@dataclass
class Recording:
    """Asks `inner` and remembers who was asked, in order, with the snapshot each one saw."""

    inner: object
    asked: list = field(default_factory=list)
    joins_running: bool = True

    def plan(self, snapshot, worker_id):
        self.asked.append((worker_id, snapshot))
        return self.inner.plan(snapshot, worker_id)


@dataclass
class Scripted:
    """Answers each worker with a fixed Decision (default: none)."""

    answers: dict
    asked: list = field(default_factory=list)
    joins_running: bool = True

    def plan(self, snapshot, worker_id):
        self.asked.append(worker_id)
        return self.answers.get(worker_id, Decision())


def admitted_by(decision):
    return {p.worker_id: p.admit for p in decision.plans}


def test_asks_open_workers_least_loaded_first_ties_in_rank_order():
    workers = {
        "w0": (8, [req("a"), req("b")]),
        "w1": (8, []),
        "w2": (8, [req("c")]),
        "w3": (8, []),
        "w4": (8, [req("d"), req("e"), req("f")]),
    }
    policy = Scripted({})
    PerWorker(policy).schedule(snap(workers, [req("q")]))
    assert policy.asked == ["w1", "w3", "w2", "w0", "w4"]


def test_a_burst_spreads_over_idle_workers_under_continuous():
    queued = [req(f"q{i}", arrival=float(i)) for i in range(6)]
    snapshot = snap({"w0": (4, []), "w1": (4, []), "w2": (4, [])}, queued)
    decision = make_policy("continuous").schedule(snapshot)
    assert_executable(snapshot, decision)
    # w0 takes one (its peers are idle); w1 catches up to w0's one; w2 to their one each,
    # admitting while its load stays <= 1, so two. Asked alone on this snapshot, every worker
    # would have admitted q0.
    assert admitted_by(decision) == {"w0": ("q0",), "w1": ("q1",), "w2": ("q2", "q3")}
    assert plan_on(decision, "w2").groups == steps(("q2", "q3"))


def test_each_worker_sees_the_snapshot_as_the_earlier_answers_left_it():
    queued = [req("q0", arrival=0.0), req("q1", arrival=1.0), req("late", arrival=2.0, ready=False)]
    policy = Recording(ContinuousBatching())
    snapshot = snap({"w0": (4, []), "w1": (4, [])}, queued)
    decision = PerWorker(policy).schedule(snapshot)
    assert admitted_by(decision) == {"w0": ("q0",), "w1": ("q1",)}
    (first, seen0), (second, seen1) = policy.asked
    assert (first, second) == ("w0", "w1")
    assert seen0 is snapshot  # the first asked sees the round as it came
    # The second sees q0 moved from the queue onto w0, running there; nothing else changed.
    assert [v.request_id for v in seen1.queued] == ["q1", "late"]
    assert seen1.worker("w0").running == ("q0",) and seen1.worker("w1").running == ()
    (moved,) = seen1.running_on("w0")
    assert moved.request_id == "q0" and moved.status is RequestStatus.RUNNING and moved.workers == ("w0",)
    assert seen1.now == snapshot.now and seen1.workers[1] == snapshot.workers[1]


def test_no_request_is_admitted_twice_even_by_a_policy_that_ignores_its_peers():
    # Static batching on idle workers takes the whole FCFS batch: without the updated snapshot
    # both workers would admit a and b.
    queued = [req("a"), req("b"), req("c", LARGE)]
    snapshot = snap({"w0": (4, []), "w1": (4, [])}, queued)
    decision = make_policy("static_fcfs").schedule(snapshot)
    assert_executable(snapshot, decision)
    assert admitted_by(decision) == {"w0": ("a", "b"), "w1": ("c",)}


def test_idle_workers_are_not_asked_while_nothing_ready_waits():
    policy = Recording(ContinuousBatching())
    snapshot = snap({"w0": (4, []), "w1": (4, [req("r")]), "w2": (4, [])}, [req("x", ready=False)])
    decision = PerWorker(policy).schedule(snapshot)
    assert [w for w, _ in policy.asked] == ["w1"]  # the only worker with something to step
    assert decision.plans == (WorkerPlan("w1", groups=steps(("r",))),)


def test_idle_workers_are_not_asked_once_earlier_answers_took_the_ready_work():
    policy = Recording(ContinuousBatching())
    snapshot = snap({"w0": (4, []), "w1": (4, []), "w2": (4, [])}, [req("only")])
    decision = PerWorker(policy).schedule(snapshot)
    assert [w for w, _ in policy.asked] == ["w0"]
    assert admitted_by(decision) == {"w0": ("only",)}


def test_nothing_to_do_asks_nobody():
    policy = Scripted({})
    assert PerWorker(policy).schedule(snap({"w0": (4, []), "w1": (4, [])})) == Decision()
    assert policy.asked == []


def test_the_earliest_wake_at_is_kept():
    answers = {"w0": Decision(wake_at=5.0), "w1": Decision(wake_at=3.0), "w2": Decision()}
    snapshot = snap({"w0": (4, []), "w1": (4, []), "w2": (4, [])}, [req("q")])
    assert PerWorker(Scripted(answers)).schedule(snapshot) == Decision(wake_at=3.0)
    # A wake from a worker that also plans survives next to the plans.
    plan = WorkerPlan("w2", admit=("q",), groups=steps(("q",)))
    answers = {"w0": Decision(wake_at=5.0), "w2": Decision((plan,), wake_at=4.0)}
    assert PerWorker(Scripted(answers)).schedule(snapshot) == Decision((plan,), wake_at=4.0)
    assert PerWorker(Scripted({})).schedule(snapshot).wake_at is None


def test_dynamic_batching_window_reaches_the_decision():
    snapshot = snap({"w0": (4, []), "w1": (4, [])}, [req("a", arrival=1.0)], now=1.2)
    decision = make_policy("dynamic_batching").schedule(snapshot)
    assert decision.plans == () and decision.wake_at == pytest.approx(1.5)


def test_closed_workers_are_neither_asked_nor_planned():
    policy = Recording(ContinuousBatching())
    # Both closed workers hold residents that would step if they were asked; their loads leave
    # continuous batching's join-shortest-queue ceiling at w1's own load, so w1 may admit q.
    snapshot = snap({"w0": slot(2, [req("r0")], open=False), "w1": slot(4, [req("r1")]),
                     "w2": slot(1, [req("r2")], open=False)}, [req("q")])
    decision = PerWorker(policy).schedule(snapshot)
    assert [w for w, _ in policy.asked] == ["w1"]
    assert decision.plans == (WorkerPlan("w1", admit=("q",), groups=steps(("r1", "q"))),)
    assert_executable(snapshot, decision)


def test_all_closed_gives_an_empty_decision():
    policy = Scripted({})
    snapshot = snap({"w0": slot(4, [req("r")], open=False)}, [req("q")])
    assert PerWorker(policy).schedule(snapshot) == Decision()
    assert policy.asked == []


def test_a_plan_for_another_worker_is_a_policy_error():
    stray = WorkerPlan("w1", admit=("q",), groups=steps(("q",)))
    snapshot = snap({"w0": (4, []), "w1": (4, [])}, [req("q")])
    with pytest.raises(PolicyError, match="w1"):
        PerWorker(Scripted({"w0": Decision((stray,))})).schedule(snapshot)


def test_name_comes_from_the_policy():
    assert PerWorker(ContinuousBatching()).name == "continuous"
    assert PerWorker(Scripted({})).name == "Scripted"


def random_round(rng):
    keys = [SMALL, LARGE]
    counter = iter(range(10_000))
    workers = {}
    for w in range(rng.randint(1, 5)):
        cap = rng.randint(1, 5)
        residents = [req(f"r{next(counter)}", rng.choice(keys), arrival=rng.uniform(0, 5), steps=rng.choice([10, 20]))
                     for _ in range(rng.choice([0, 0, rng.randint(0, cap)]))]
        workers[f"w{w}"] = slot(cap, residents, open=rng.random() < 0.8, busy=rng.random() < 0.3)
    queued = [req(f"q{next(counter)}", rng.choice(keys), arrival=5.0 + 0.1 * i, ready=rng.random() < 0.75,
                  steps=rng.choice([10, 20]))
              for i in range(rng.randint(0, 14))]
    return snap(workers, queued, now=rng.uniform(5.0, 8.0))


@pytest.mark.parametrize("seed", range(300))
def test_union_of_plans_is_executable_on_random_rounds(seed):
    rng = random.Random(seed)
    snapshot = random_round(rng)
    cap = rng.choice([None, 1, 2, 4])
    inner = rng.choice([ContinuousBatching(ContinuousConfig(cap)), StaticFCFS(StaticFCFSConfig(cap)),
                        DynamicBatching(DynamicBatchingConfig(rng.choice([0.0, 0.5, 5.0]), cap))])
    decision = PerWorker(inner).schedule(snapshot)

    # Brute force over the union, independent of the adapter's bookkeeping.
    ready = {v.request_id for v in snapshot.queued if v.ready}
    admitted = [rid for p in decision.plans for rid in p.admit]
    assert len(admitted) == len(set(admitted))  # each ready request admitted at most once
    assert set(admitted) <= ready  # and nothing else is admitted
    for p in decision.plans:
        w = snapshot.worker(p.worker_id)
        assert w.open
        limit = w.max_batch_size if cap is None else min(cap, w.max_batch_size)
        assert len(w.running) + len(p.admit) <= max(limit, len(w.running))  # never beyond the batch cap
        assert len(w.running) + len(p.admit) <= w.max_batch_size
        assert sorted(p.stepping) == sorted(w.running + p.admit)  # per-worker policies step everyone
    planned = {p.worker_id for p in decision.plans}
    # Every open worker with residents steps them; a closed one is never touched.
    assert planned == {w.worker_id for w in snapshot.workers if w.open and w.running} | \
        {p.worker_id for p in decision.plans if p.admit}
    assert_executable(snapshot, decision)
