"""RouterCore: the one state machine for images and videos under every policy (stepserve/routing/core.py).

Driven by `core_harness.Harness` (SimWorkers execute the plans); policies are the real ones,
or a `FixedPolicy` test double that returns whatever decision a test hands it.
"""

import random

import pytest

from stepserve.load_tests.sim.worker import SimAdmission
from stepserve.policies import make_policy
from stepserve.policies.base import PolicyError
from stepserve.policies.types import (
    Decision,
    RequestFailure,
    RequestKind,
    RequestStatus as S,
    StepGroup,
    StepReport,
    WorkerPlan,
)
from stepserve.routing.core import (
    CoreConfig,
    DuplicateRequestError,
    QueueFullError,
    RouterCore,
    WorkerSlot,
)

from tests.cpu.core_harness import Harness, spec


class FixedPolicy:
    """Test double for a policy: returns `next` (then nothing)."""

    name = "fixed"
    steady = False
    joins_running = True

    def __init__(self) -> None:
        self.next = Decision()

    def schedule(self, snapshot):
        decision, self.next = self.next, Decision()
        return decision


# ---- requests in ---------------------------------------------------------------------------------


def test_duplicates_and_per_class_queue_bounds():
    h = Harness(max_queued={RequestKind.T2I: 2, RequestKind.T2V: 1})
    h.submit(spec("a"), spec("b"))
    with pytest.raises(DuplicateRequestError):
        h.submit(spec("a"))
    with pytest.raises(QueueFullError) as info:
        h.submit(spec("c"))
    assert info.value.status == 429
    # A full image queue does not turn videos away, and the other way round.
    h.submit(spec("v", frames=5))
    with pytest.raises(QueueFullError):
        h.submit(spec("v2", frames=5))
    h.run()
    assert h.status("a") is S.FINISHED
    h.core.forget("a")
    h.submit(spec("a"))  # an ended id may come back as a new request
    assert h.status("a") is S.QUEUED


def test_each_plan_carries_what_still_waits():
    """`WorkerPlan.queued` is the queue once the round's plans have admitted theirs (SynerDiff's
    load controller on a worker follows its trend)."""
    h = Harness(workers=1, batch=2)
    h.submit(spec("a"), spec("b"), spec("c"), spec("d"), spec("e"))
    h.schedule()
    assert len(h.sent[0].admit) == 2 and h.core.queue_length() == 3
    assert [plan.queued for plan in h.sent] == [3] * len(h.sent)


def test_queued_steps_count_what_waits_and_a_report_says_how_many_steps_its_plan_ran():
    h = Harness(workers=1, batch=1)
    h.submit(spec("a", steps=3), spec("b", steps=4), spec("v", steps=5, frames=5))
    h.schedule()
    assert h.core.queued_steps(RequestKind.T2I) == 4 and h.core.queued_steps(RequestKind.T2V) == 5
    plan, admissions, _ = h.queues["w0"][0]
    report, _, _ = h.workers["w0"].execute(plan, {a.spec.request_id: SimAdmission(a.spec, None) for a in admissions})
    assert h.core.steps_ran(report) == plan.steps >= 1
    h.core.apply(report, h.now)
    assert h.core.steps_ran(report) == 0  # applied: no longer in flight


def test_unready_requests_wait_and_ready_ones_pass_them():
    h = Harness(workers=1)
    h.submit(spec("late"), ready=False)
    h.submit(spec("early"))
    h.round()
    assert h.status("early") is S.RUNNING and h.status("late") is S.QUEUED
    h.core.mark_ready("late", "embeds", h.now)
    h.run()
    assert h.status("late") is S.FINISHED


def test_a_run_finishes_everything_with_each_last_step_finishing():
    h = Harness(workers=2, batch=2)
    specs = [spec(f"r{i}", steps=2 + i % 3) for i in range(7)]
    h.submit(*specs)
    h.run()
    for s in specs:
        state = h.core.state(s.request_id)
        assert state.status is S.FINISHED and state.steps_done == s.num_inference_steps
        finishing = [p for p in h.sent if s.request_id in p.finish]
        assert len(finishing) == 1 and s.request_id in finishing[0].stepping
        assert len(state.degrees) == s.num_inference_steps
    # Outputs come back by handle: a finished image's is its id (the SimWorker's token).
    denoised = dict(pair for o in h.outcomes for pair in o.denoised)
    assert denoised["r0"].value == "r0"


def test_plans_are_pipelined_to_the_configured_depth():
    h = Harness(workers=1, batch=4, depth=2)
    h.submit(spec("a", steps=6))
    h.schedule()
    h.schedule()
    h.schedule()
    assert len(h.queues["w0"]) == 2  # the third call finds the pipeline full
    assert [p.plan_id for p, _, _ in h.queues["w0"]] == [1, 2]
    h.run()
    assert h.status("a") is S.FINISHED and sum(len(p.stepping) for p in h.sent) == 6


def test_decisions_wait_for_the_pipeline_lead():
    """With a cost model a busy worker opens only `lead` before its plan is predicted to end."""

    class Costs:
        def round_seconds(self, batches):
            return 1.0

        def decode_seconds(self, *args):
            return 0.0

    h = Harness(workers=1, costs=Costs(), lead_s=0.1)
    h.submit(spec("a", steps=4))
    decision = h.schedule()
    assert len(decision.plans) == 1 and decision.wake_at == pytest.approx(h.now + 0.9)
    assert not h.schedule().plans  # not yet
    h.now += 0.95
    assert len(h.schedule().plans) == 1  # within the lead: the next step is queued behind


# ---- several steps a plan -------------------------------------------------------------------------


def _stepped(h, now_step=0.01):
    """Run the worker's oldest plan `now_step` seconds a step after it was sent; returns it."""
    plan = h.queues["w0"][0][0]
    h.now += now_step * plan.steps
    h.execute("w0")
    return plan


def test_a_steady_batch_runs_several_steps_a_plan_until_its_first_request_finishes():
    h = Harness(workers=1, batch=4, depth=1, max_plan_s=0.05)
    h.submit(spec("a", steps=14), spec("b", steps=8))
    h.schedule()
    first = _stepped(h)
    assert first.steps == 1  # a worker's step time is unknown before its first report
    plans = []
    while h.queues["w0"] or h.schedule().plans:
        plans.append(_stepped(h))
    # 0.05 s a plan at 0.01 s a step: 5 steps, cut where "b" ends (8 = 1 + 5 + 2), then "a" alone.
    assert [(p.steps, p.finish) for p in plans] == [(5, ()), (2, ("b",)), (5, ()), (1, ("a",))]
    assert h.status("a") is S.FINISHED and h.status("b") is S.FINISHED
    assert h.core.state("a").degrees == (1,) * 14


def test_one_step_a_plan_while_something_waits_that_the_worker_has_room_for():
    h = Harness(workers=1, batch=2, depth=1, max_plan_s=0.05)
    h.submit(spec("a", steps=20))
    h.schedule()
    _stepped(h)
    h.submit(spec("b", steps=20), ready=False)  # waiting for its text embeddings
    h.schedule()
    assert _stepped(h).steps == 1
    h.core.mark_ready("b", "embeds-b", h.now)
    h.schedule()
    joined = _stepped(h)
    assert joined.admit == ("b",) and joined.steps == 5  # nothing waits now
    # A full worker has no room: what waits does not hold its batch to single steps.
    h.submit(spec("c", steps=20))
    h.schedule()
    assert _stepped(h).steps == 5 and h.status("c") is S.QUEUED


def _long_plan(h, *specs, policy_steps=5):
    """Run `specs` on w0 (one worker, depth 1) until it holds a plan of several steps; returns it."""
    h.submit(*specs)
    h.schedule()
    while h.queues["w0"][0][0].steps == 1:  # the worker's step time is known after its first report
        _stepped(h)
        h.schedule()
    plan = h.queues["w0"][0][0]
    assert plan.steps == policy_steps and len(h.queues["w0"]) == 1
    return plan


def _finish_all(h):
    while h.queues["w0"] or h.schedule().plans:
        _stepped(h)


def test_a_ready_arrival_cuts_a_long_plan_short_at_the_next_step():
    h = Harness(workers=1, batch=4, depth=1, max_plan_s=0.05)
    plan = _long_plan(h, spec("a", steps=20), spec("b", steps=6))  # 5 steps, ending with "b"
    assert plan.finish == ("b",)
    h.now += 0.01  # a step into it
    h.submit(spec("c", steps=3))
    assert h.schedule().plans == () and h.interrupts == [("w0", plan.plan_id)]
    assert h.schedule().plans == () and len(h.interrupts) == 1  # asked once; nothing is planned after it
    h.now += 0.01
    h.execute("w0", steps_run=2)
    # The three steps it did not run are taken back; "b", not finished, is still resident.
    assert h.core.state("b").status is S.RUNNING and h.core.state("b").workers == ("w0",)
    assert h.core.state("b").steps_done == 3 and len(h.core.state("b").degrees) == 3
    joined = h.schedule().plans[0]
    assert joined.admit == ("c",) and joined.steps == 3 and set(joined.finish) == {"b", "c"}
    _finish_all(h)
    for rid, steps in (("a", 20), ("b", 6), ("c", 3)):
        assert h.status(rid) is S.FINISHED and h.core.state(rid).degrees == (1,) * steps


def test_a_cancel_cuts_a_long_plan_short_and_a_cut_drops_what_it_was_to_finish_if_it_ended():
    h = Harness(workers=1, batch=4, depth=1, max_plan_s=0.05)
    plan = _long_plan(h, spec("a", steps=20), spec("b", steps=6), spec("c", steps=20))
    h.now += 0.01
    assert h.core.cancel("c", h.now)
    h.schedule()
    assert h.interrupts == [("w0", plan.plan_id)]
    # "b" is cancelled too while the cut is under way: the plan was to finish it, so the router
    # had already let go of it there; the worker still holds it, and is told to drop it.
    assert h.core.cancel("b", h.now)
    h.execute("w0", steps_run=1)
    after = h.schedule().plans[0]
    assert set(after.drop) == {"b", "c"} and after.stepping == ("a",)
    _stepped(h)
    assert set(h.workers["w0"].resident) == {"a"}
    _finish_all(h)
    assert h.status("a") is S.FINISHED and set(h.workers["w0"].resident) == set()


def test_no_cut_under_a_policy_that_does_not_join_running_batches():
    h = Harness("static_fcfs", workers=1, batch=4, depth=1, max_plan_s=0.05)
    plan = _long_plan(h, spec("a", steps=20))
    h.submit(spec("b", steps=20))
    h.schedule()
    assert h.interrupts == []
    _stepped(h)
    h.schedule()
    # "b" cannot join, so it does not hold "a"'s plans to single steps either.
    assert h.queues["w0"][0][0].steps == 5 and plan.steps == 5 and h.status("b") is S.QUEUED


def test_no_cut_with_a_plan_queued_behind_or_less_than_a_step_left():
    h = Harness(workers=1, batch=4, depth=2, max_plan_s=0.05, lead_s=0.02)
    _long_plan(h, spec("a", steps=20))
    h.now += 0.035  # within the lead of its end (0.05): the next plan is decided and queued
    assert h.schedule().plans and len(h.queues["w0"]) == 2
    h.submit(spec("b", steps=3))
    h.schedule()
    assert h.interrupts == []  # the plan behind it assumes all of its steps
    h.now += 0.015
    h.execute("w0")
    h.schedule()
    second = h.queues["w0"][0][0]
    assert second.steps == 5 and h.interrupts == [("w0", second.plan_id)]  # alone now: cut
    h = Harness(workers=1, batch=4, depth=1, max_plan_s=0.05)
    _long_plan(h, spec("a", steps=20))
    h.now += 0.045  # less than a step left
    h.submit(spec("b", steps=3))
    h.schedule()
    assert h.interrupts == []


def test_the_least_loaded_worker_with_room_is_cut_one_per_ready_request():
    h = Harness(workers=3, batch=2, depth=1, max_plan_s=0.05)
    h.submit(spec("a", steps=20), spec("b", steps=20), spec("c", steps=20))
    h.schedule()
    h.now += 0.01
    for w in ("w0", "w1", "w2"):
        h.execute(w)
    h.submit(spec("d", steps=20))  # one worker takes it: full
    h.schedule()
    h.now += 0.01
    for w in ("w0", "w1", "w2"):
        h.execute(w)
    h.schedule()
    assert all(h.queues[w][0][0].steps == 5 for w in ("w0", "w1", "w2"))
    full = [w for w in ("w0", "w1", "w2") if len(h.queues[w][0][0].stepping) == 2]
    first, second = [w for w in ("w0", "w1", "w2") if w not in full]  # rank order breaks the tie
    h.now += 0.01
    h.submit(spec("e", steps=3))
    h.schedule()
    assert len(full) == 1 and h.interrupts == [(first, h.queues[first][0][0].plan_id)]
    h.submit(spec("f", steps=3), spec("g", steps=3))
    h.schedule()
    # One more for "f"; "g" finds no other worker with room.
    assert [w for w, _ in h.interrupts] == [first, second]


def test_a_worker_may_not_cut_a_plan_unasked():
    h = Harness(workers=1, batch=4, depth=1, max_plan_s=0.05)
    _long_plan(h, spec("a", steps=20))
    with pytest.raises(ValueError, match="short unasked"):
        h.execute("w0", steps_run=2)


@pytest.mark.parametrize("max_plan_s, steady", [(0.0, True), (0.05, False)])
def test_one_step_a_plan_when_switched_off_or_the_policy_is_not_steady(max_plan_s, steady):
    policy = make_policy("continuous")
    policy.steady = steady  # a policy whose plans move with the clock
    h = Harness(policy, workers=1, batch=2, depth=1, max_plan_s=max_plan_s)
    h.submit(spec("a", steps=6))
    h.run()
    assert h.status("a") is S.FINISHED and {p.steps for p in h.sent} == {1} and len(h.sent) == 6


# ---- plan validation -----------------------------------------------------------------------------


def _fixture():
    """w0 (cap 3) runs a, b; w1 runs e (128 px); c ready; d not ready; f, g ready."""
    policy = FixedPolicy()
    h = Harness(policy, workers=2, batch=3, depth=4)
    h.submit(*[spec(r, size=128 if r in "ef" else 64) for r in "abcefg"])
    h.submit(spec("d"), ready=False)
    policy.next = Decision((WorkerPlan("w0", admit=("a", "b"), groups=(StepGroup(("a", "b")),)),
                            WorkerPlan("w1", admit=("e",), groups=(StepGroup(("e",)),))))
    h.schedule()
    return h, policy


BAD = {
    "admit unknown": (WorkerPlan("w0", admit=("zz",)), "not waiting"),
    "admit not ready": (WorkerPlan("w0", admit=("d",)), "not ready"),
    "admit running": (WorkerPlan("w0", admit=("e",)), "not waiting"),
    "admit twice": (WorkerPlan("w0", admit=("c", "c")), "twice"),
    "over capacity": (WorkerPlan("w0", admit=("c", "g")), "max_batch_size"),
    "step non-resident": (WorkerPlan("w0", groups=(StepGroup(("a", "c")),)), "not resident"),
    "step other worker's": (WorkerPlan("w0", groups=(StepGroup(("e",)),)), "not resident"),
    "mixed shapes": (WorkerPlan("w0", admit=("f",), groups=(StepGroup(("a", "f")),)), "mixes shapes"),
    "stepped twice": (WorkerPlan("w0", groups=(StepGroup(("a",)), StepGroup(("a",)))), "twice"),
    "empty group": (WorkerPlan("w0", groups=(StepGroup(()),)), "empty"),
    "router fields": (WorkerPlan("w0", drop=("a",)), "router-filled"),
    "export not resident": (WorkerPlan("w0", export=("e",)), "not resident"),
    "release without export": (WorkerPlan("w0", release=("a",)), "without an export"),
    "unknown worker": (WorkerPlan("w9"), "unknown or dead"),
    "sp on one worker": (WorkerPlan("w0", groups=(StepGroup(("a",), (0, 1)),)), "SP group"),
    "steps set by the policy": (WorkerPlan("w0", groups=(StepGroup(("a", "b")),), steps=2), "router-filled"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_plans_raise_policy_error_and_change_nothing(case):
    h, policy = _fixture()
    before = [h.core.state(r) for r in "abcdefg"]
    snapshot = h.core.snapshot(h.now)
    plan, fragment = BAD[case]
    policy.next = Decision((plan,))
    with pytest.raises(PolicyError, match=fragment):
        h.schedule()
    assert [h.core.state(r) for r in "abcdefg"] == before
    assert h.core.snapshot(h.now) == snapshot


def test_two_plans_for_one_worker_and_a_full_pipeline_are_refused():
    h, policy = _fixture()
    policy.next = Decision((WorkerPlan("w0"), WorkerPlan("w0")))
    with pytest.raises(PolicyError, match="twice"):
        h.schedule()
    h2 = Harness(FixedPolicy(), workers=1, depth=1)
    h2.submit(spec("a"))
    h2.core.policy.next = Decision((WorkerPlan("w0", admit=("a",), groups=(StepGroup(("a",)),)),))
    h2.schedule()
    h2.core.policy.next = Decision((WorkerPlan("w0", groups=(StepGroup(("a",)),)),))
    with pytest.raises(PolicyError, match="not open"):
        h2.schedule()


# ---- cancellation and failures -------------------------------------------------------------------


def test_cancel_queued_is_immediate_and_running_is_dropped_at_the_next_plan():
    h = Harness(workers=1, batch=4)
    h.submit(spec("run", steps=20), spec("wait", steps=20))
    h.core.cancel("wait", h.now)  # still queued: gone at once
    assert h.status("wait") is S.CANCELLED and h.core.queue_length() == 1  # "run" waits
    h.round()
    h.round()
    assert h.core.cancel("run", h.now) and h.status("run") is S.CANCELLED
    assert not h.core.cancel("run", h.now)  # terminal stays terminal
    h.run()
    drops = [p for p in h.sent if "run" in p.drop]
    assert len(drops) == 1 and not drops[0].stepping  # a plan of its own frees the worker at once
    assert not h.workers["w0"].resident


def test_a_worker_failure_fails_only_that_request():
    h = Harness(workers=1)
    h.submit(spec("a"), spec("b"))
    h.schedule()
    plan, _, _ = h.queues["w0"].popleft()
    report = StepReport("w0", plan.plan_id, failed=(RequestFailure("a", "bad input"),), incarnation="w0-1")
    h.core.apply(report, h.now)
    assert h.status("a") is S.FAILED and h.core.state("a").error == "bad input"
    assert h.status("b") is S.RUNNING


def test_a_report_naming_another_request_is_rejected_without_change():
    h = Harness(workers=1)
    h.submit(spec("a"), spec("b", size=128))
    h.schedule()
    plan = h.queues["w0"][0][0]
    before = h.core.state("a")
    bogus = StepReport("w0", plan.plan_id, failed=(RequestFailure("zz", "?"),))
    with pytest.raises(ValueError, match="does not name"):
        h.core.apply(bogus, h.now)
    with pytest.raises(ValueError, match="expected"):
        h.core.apply(StepReport("w0", plan.plan_id + 5), h.now)
    assert h.core.apply(StepReport("w0", plan.plan_id - 1), h.now).denoised == ()  # written off: ignored
    assert h.core.state("a") == before and h.core.in_flight("w0") == len(h.queues["w0"])


# ---- faults --------------------------------------------------------------------------------------


def test_a_lost_worker_loses_no_request():
    """Requests on a dead worker resume elsewhere: from their checkpoint, or from step 0."""
    h = Harness(workers=2, batch=2, checkpoint_interval_s=0.0)
    h.submit(spec("a", steps=8), spec("b", steps=8), spec("c", steps=8), spec("d", steps=8))
    for _ in range(3):
        h.round()
    victim = h.core.state("a").workers[0]
    lost = [r for r in "abcd" if h.core.state(r).workers == (victim,)]
    outcome = h.core.worker_lost(victim, h.now)
    h.queues[victim].clear()
    assert sorted(outcome.recovered) == sorted(lost) and not outcome.failed
    for rid in lost:
        state = h.core.state(rid)
        assert state.status is S.PAUSED and 0 < state.steps_done < 8 and state.recoveries == 1
    assert victim not in {w.worker_id for w in h.core.snapshot(h.now).workers}  # nothing goes to it
    h.run()
    assert all(h.status(r) is S.FINISHED for r in "abcd")
    assert all(p.worker_id != victim for p in h.sent[-10:])


def test_without_checkpoints_a_lost_request_starts_over_and_gives_up_after_max_recoveries():
    h = Harness(workers=1, max_recoveries=1)
    h.submit(spec("a", steps=5))
    h.round()
    h.core.worker_lost("w0", h.now)
    h.queues["w0"].clear()
    assert h.status("a") is S.QUEUED and h.core.state("a").steps_done == 0
    h.core.worker_back("w0", "w0-2")
    h.workers["w0"].resident.clear()
    h.workers["w0"].incarnation = "w0-2"
    h.round()
    outcome = h.core.worker_lost("w0", h.now)
    assert outcome.failed == ("a",) and "faults" in h.core.state("a").error


def test_a_restarted_worker_is_recognised_by_its_incarnation():
    h = Harness(workers=1, checkpoint_interval_s=0.0)
    h.submit(spec("a", steps=6))
    h.round()
    h.round()
    # The actor restarted behind the router's back: its next report has a new incarnation.
    h.workers["w0"].resident.clear()
    h.workers["w0"].incarnation = "w0-2"
    h.round()
    assert h.core.state("a").recoveries == 1
    h.run()
    assert h.status("a") is S.FINISHED


def test_a_lost_input_resumes_the_request_instead_of_failing_it():
    h = Harness(workers=1, checkpoint_interval_s=0.0)
    h.submit(spec("a", steps=6))
    h.round()
    h.round()
    h.schedule()
    plan = h.queues["w0"].popleft()[0]
    report = StepReport("w0", plan.plan_id, failed=(RequestFailure("a", "state unavailable", lost=True),),
                        incarnation="w0-1")
    outcome = h.core.apply(report, h.now)
    assert outcome.recovered == ("a",) and h.status("a") is S.PAUSED
    h.run()  # the plan still queued steps "a" in its old epoch: that report is ignored
    assert h.status("a") is S.FINISHED


# ---- policies through the core -------------------------------------------------------------------


def test_new_requests_join_a_running_batch_only_under_continuous():
    def run(policy):
        h = Harness(policy, workers=1, batch=4, depth=1)
        h.submit(spec("long", steps=10))
        for _ in range(3):
            h.round()
        h.submit(spec("late", steps=2))
        h.run()
        return h.core.state("late")

    assert run("continuous").admit_time < run("static_fcfs").admit_time


def test_join_shortest_queue_spreads_a_burst():
    h = Harness(workers=2, batch=4, depth=1)
    h.submit(*[spec(f"r{i}", steps=20) for i in range(6)])
    h.round()
    h.round()
    loads = [len(w.running) for w in h.core.snapshot(h.now).workers]
    assert sorted(loads) == [3, 3]


def _random_arrivals(rng, n, frames=(1,)):
    return [(rng.randint(0, 30), spec(f"r{i:02d}", steps=rng.choice([2, 3, 5, 8]), size=rng.choice([64, 128]),
                                      frames=rng.choice(frames)))
            for i in range(n)]


@pytest.mark.parametrize("policy", ["continuous", "static_fcfs", "dynamic_batching"])
@pytest.mark.parametrize("seed", range(6))
def test_random_runs_keep_invariants(policy, seed):
    rng = random.Random(seed)
    h = Harness(policy, workers=rng.randint(1, 3), batch=rng.randint(1, 4), depth=rng.randint(1, 2),
                max_plan_s=rng.choice([0.0, 0.05]))
    arrivals = _random_arrivals(rng, rng.randint(5, 25), frames=(1, 1, 5))
    cancels = {rng.randint(0, 40): a[1].request_id for a in rng.sample(arrivals, len(arrivals) // 5)}

    def check(snapshot):  # no request in two places; the snapshot agrees with the workers
        seen = [rid for w in snapshot.workers for rid in w.running]
        assert len(seen) == len(set(seen))
        for w in snapshot.workers:
            assert len(w.running) <= w.max_batch_size

    h.drive(arrivals, cancels, lambda worker_id: rng.random() < 0.6, check)
    for _, s in arrivals:
        state = h.core.state(s.request_id)
        assert state.status in (S.FINISHED, S.CANCELLED)
        if state.status is S.FINISHED:
            assert state.steps_done == len(state.degrees) == s.num_inference_steps
    assert all(not w.resident for w in h.workers.values())


def denoised_and_decoding(h: Harness) -> None:
    h.submit(spec("a", steps=1))
    h.core.policy.next = Decision((WorkerPlan("w0", admit=("a",), groups=(StepGroup(("a",)),)),))
    h.schedule()
    plan, admissions, handles = h.queues["w0"].popleft()
    report, outputs, _ = h.workers["w0"].execute(plan, {"a": SimAdmission(admissions[0].spec, None)})
    h.core.apply(report, h.now)  # denoised, not yet decoded
    assert h.core.state("a").status is S.DECODING


def test_load_report_counts_decoding_as_backlog():
    h = Harness(FixedPolicy(), workers=1, max_queued={RequestKind.T2I: 2, RequestKind.T2V: 2})
    denoised_and_decoding(h)
    load = h.core.load().classes[RequestKind.T2I]
    assert load.decoding == 1 and load.backlog == 1
    h.submit(spec("b"))
    with pytest.raises(QueueFullError):
        h.submit(spec("c"))  # b queued + a decoding fill the bound of 2


def test_an_image_its_worker_decoded_is_no_backlog():
    # Only its PNG is on its way back: a batch's end must not raise the backlog an edge counted
    # when it let requests in (the router would refuse what the edge admitted).
    h = Harness(FixedPolicy(), workers=1, max_queued={RequestKind.T2I: 2, RequestKind.T2V: 2},
                images_decode_on_workers=True)
    denoised_and_decoding(h)
    load = h.core.load().classes[RequestKind.T2I]
    assert load.decoding == 0 and load.running == 1 and load.backlog == 0
    h.submit(spec("b"))
    h.submit(spec("c"))
    with pytest.raises(QueueFullError):
        h.submit(spec("d"))


def test_constructor_validation():
    policy = make_policy("continuous")
    with pytest.raises(ValueError):
        RouterCore(policy, [])
    with pytest.raises(ValueError):
        RouterCore(policy, [WorkerSlot("w0", 1, 0), WorkerSlot("w0", 2, 1)])
    with pytest.raises(ValueError):
        RouterCore(policy, [WorkerSlot("w0", 0, 0)])
    with pytest.raises(ValueError):
        CoreConfig(pipeline_depth=0)
    with pytest.raises(KeyError):
        RouterCore(policy, [WorkerSlot("w0", 1, 0)]).worker_lost("nope", 0.0)


def test_the_drain_rate_averages_gaps_so_a_batch_finishing_together_does_not_inflate_it():
    """Under steady load eight requests finish together every second: that drains 8/s, not the
    thousands per second their microsecond gaps would suggest; and an idle stretch between
    busy periods does not count as slowness."""
    core = RouterCore(make_policy("continuous"), [WorkerSlot("w0", 8, 0)])

    def batch(name: str) -> list[str]:
        ids = [f"{name}-{i}" for i in range(8)]
        for rid in ids:
            core.submit(spec(rid), now)
        return ids

    def finish(ids: list[str]) -> None:
        for i, rid in enumerate(ids):  # denoised and decoded together, a microsecond apart
            record = core._requests[rid]
            core._leave_waiting(record)
            core._set_status(record, S.DECODING)
            core.complete(rid, now + i * 1e-6)

    now = 0.0
    current = batch("b0")
    for k in range(1, 12):
        upcoming = batch(f"b{k}")  # queued while the current batch runs: the class is busy
        now += 1.0
        finish(current)
        current = upcoming
        if k == 6:  # an idle minute: everything finishes, nothing waits
            now += 1.0
            finish(current)
            now += 60.0
            current = batch("after-idle")
    drain = core.load().classes[RequestKind.T2I].drain_per_s
    assert 4.0 < drain < 16.0


def test_the_load_version_moves_with_what_the_load_says_not_with_every_step():
    """The edge long-polls the load: a plain step (a plan out, its report in) is not news, and
    must not wake it; an admission, a finish and a new arrival are."""
    h = Harness(workers=1, max_queued={RequestKind.T2I: 8, RequestKind.T2V: 8})
    h.submit(spec("a", steps=4))
    submitted = h.core.load_version
    h.round()  # admitted and first step
    admitted = h.core.load_version
    assert admitted > submitted and h.status("a") is S.RUNNING
    h.round()
    h.round()  # plain steps
    assert h.core.load_version == admitted
    h.run()
    assert h.status("a") is S.FINISHED and h.core.load_version > admitted
