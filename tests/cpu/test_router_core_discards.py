"""RouterCore applies the requests a policy gives up (`Decision.discard`): each ends FAILED with the
policy's reason before the round's plans are built, and a decision that discards a request that
is not waiting, or discards one it also plans, is refused whole."""

import pytest

from stepserve.policies.base import PolicyError
from stepserve.policies.types import Decision, RequestFailure, RequestStatus as S, StepGroup, WorkerPlan

from tests.cpu.core_harness import Harness, spec
from tests.cpu.policies.patchedserve.fakes import LinearCosts
from tests.cpu.test_router_core import FixedPolicy


class SteadyFixedPolicy(FixedPolicy):
    """A steady policy that joins running batches: its plans run several steps only while
    nothing waits that the worker has room for."""

    steady = True


def step(*ids: str) -> StepGroup:
    return StepGroup(tuple(ids))


def test_discarded_requests_fail_with_their_reasons_before_the_plans_are_built():
    policy = SteadyFixedPolicy()
    h = Harness(policy, workers=1, batch=4, max_plan_s=1.0)
    h.submit(spec("keep", steps=6), spec("late"))
    h.submit(spec("unready"), ready=False)
    policy.next = Decision((WorkerPlan("w0", admit=("keep",), groups=(step("keep"),)),))
    h.schedule()
    h.execute("w0")  # the worker's step time is known now: a steady plan may run several steps
    load = h.core.load_version
    discard = (RequestFailure("late", "cannot meet its deadline"), RequestFailure("unready", "too late"))
    policy.next = Decision((WorkerPlan("w0", groups=(step("keep"),)),), discard=discard)
    sent = h.schedule()
    assert sent.discard == discard
    for failure in discard:
        state = h.core.state(failure.request_id)
        assert (state.status, state.error, state.finish_time, state.admit_time) == (
            S.FAILED, failure.message, h.now, None)
    assert h.core.queue_length() == 0 and h.core.count(S.FAILED) == 2 and h.core.count(S.RUNNING) == 1
    assert h.core.load_version > load  # the edge hears of the shorter queue
    assert h.core.snapshot(h.now).queued == ()
    # Failed before the plan was built: nothing waits, so "keep" runs its 5 steps left in one plan.
    assert [(p.stepping, p.steps, p.finish) for p in sent.plans] == [(("keep",), 5, ("keep",))]
    h.core.mark_ready("unready", "embeds", h.now)  # its embeddings arriving late change nothing
    assert h.status("unready") is S.FAILED
    h.run()
    assert h.status("keep") is S.FINISHED
    assert not {rid for p in h.sent for rid in p.admit + p.stepping + p.drop} & {"late", "unready"}


def test_a_paused_request_may_be_discarded_and_its_export_report_is_ignored():
    policy = FixedPolicy()
    h = Harness(policy, workers=1)
    h.submit(spec("a", steps=5))
    policy.next = Decision((WorkerPlan("w0", admit=("a",), groups=(step("a"),)),))
    h.schedule()
    h.execute("w0")
    policy.next = Decision((WorkerPlan("w0", export=("a",)),))
    h.schedule()
    assert h.status("a") is S.PAUSED
    policy.next = Decision(discard=(RequestFailure("a", "too late"),))
    assert h.schedule().discard == (RequestFailure("a", "too late"),)
    h.execute("w0")  # the export's report comes back after it failed
    state = h.core.state("a")
    assert (state.status, state.error, h.core.queue_length()) == (S.FAILED, "too late", 0)


def _fixture():
    """w0 runs a; b waits (ready); c waits (not ready); x was cancelled."""
    policy = FixedPolicy()
    h = Harness(policy, workers=2, batch=3)
    h.submit(spec("a"), spec("b"), spec("x"))
    h.submit(spec("c"), ready=False)
    policy.next = Decision((WorkerPlan("w0", admit=("a",), groups=(step("a"),)),))
    h.schedule()
    h.core.cancel("x", h.now)
    return h, policy


BAD = {
    "running": (Decision(discard=(RequestFailure("a", "late"),)), "discards 'a', which is not waiting \\(running\\)"),
    "unknown": (Decision(discard=(RequestFailure("zz", "late"),)), "which is not waiting \\(unknown\\)"),
    "ended": (Decision(discard=(RequestFailure("x", "late"),)), "which is not waiting \\(cancelled\\)"),
    # The whole decision is checked first: the valid discard of b is not applied either.
    "one of two": (Decision(discard=(RequestFailure("b", "late"), RequestFailure("a", "late"))), "'a'"),
    "admitted too": (Decision((WorkerPlan("w1", admit=("b",), groups=(step("b"),)),),
                              discard=(RequestFailure("b", "late"),)), "discards 'b' and plans it"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_discards_raise_policy_error_and_change_nothing(case):
    h, policy = _fixture()
    before = [h.core.state(r) for r in "abcx"]
    snapshot = h.core.snapshot(h.now)
    failed = h.core.count(S.FAILED)
    policy.next, fragment = BAD[case]
    with pytest.raises(PolicyError, match=fragment):
        h.schedule()
    assert [h.core.state(r) for r in "abcx"] == before and h.core.count(S.FAILED) == failed
    assert h.core.snapshot(h.now) == snapshot


@pytest.mark.parametrize("discard, fragment", [
    ((RequestFailure("a", "late"), RequestFailure("a", "later")), "discarded twice"),
    ((RequestFailure(7, "late"),), "string request ids"),
    (("a",), "string request ids"),
    ((RequestFailure("a", "state gone", lost=True),), "marked lost"),
    ([RequestFailure("a", "late")], "must be a tuple"),
])
def test_a_decision_refuses_malformed_discards(discard, fragment):
    with pytest.raises(ValueError, match=fragment):
        Decision(discard=discard)


def test_patchedserve_through_the_core_discards_what_cannot_make_it_and_serves_the_rest():
    """The real policy: 20 steps alone take 0.4 s (LinearCosts, 64 px under CFG), past a 0.1 s SLO."""
    h = Harness("patchedserve", {"predictor": "cost_model"}, workers=1, costs=LinearCosts())
    h.submit(spec("doomed", steps=20, slo_s=0.1), spec("fine", steps=3, slo_s=5.0), spec("free", steps=3))
    h.run()
    doomed = h.core.state("doomed")
    assert doomed.status is S.FAILED and doomed.error.startswith("cannot meet its deadline")
    assert doomed.admit_time is None and doomed.steps_done == 0
    assert h.status("fine") is S.FINISHED and h.status("free") is S.FINISHED
    assert h.core.count(S.FAILED) == 1 and h.core.count(S.FINISHED) == 2
    assert all("doomed" not in p.admit for p in h.sent)
