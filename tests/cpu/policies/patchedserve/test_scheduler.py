"""Algorithm 1 on hand-made rounds: discards, least slack first, throughput mode, the
schedulability limit. Costs are `LinearCosts`: one CFG request alone steps in 20 ms at 64 px
(SMALL) and 50 ms at 128 px (LARGE); each more request of a size adds 10 ms / 40 ms, and each
more size on a worker a 10 ms forward of its own (none when the workers pack resolutions)."""

from __future__ import annotations

import math

from stepserve.policies.patchedserve import PatchedServeConfig, PatchedServePolicy
from stepserve.policies.patchedserve.mixed_costs import PackedForwardCosts
from stepserve.policies.types import Decision, RequestKind

from tests.cpu.policies.patchedserve.fakes import LinearCosts
from tests.cpu.policies.snapshots import LARGE, assert_executable, plan_on, req, slot, snap, steps


def decide(snapshot, packed: bool = False, **options) -> Decision:
    costs = PackedForwardCosts(LinearCosts()) if packed else LinearCosts()
    policy = PatchedServePolicy(PatchedServeConfig(predictor="cost_model", **options), costs)
    decision = policy.schedule(snapshot)
    assert_executable(snapshot, decision)
    return decision


def discarded(decision: Decision) -> dict[str, str]:
    return {f.request_id: f.message for f in decision.discard}


def test_a_request_that_cannot_meet_its_deadline_even_alone_is_discarded_with_a_reason():
    queued = [req("hopeless", deadline=0.19), req("fine", deadline=5.0),
              req("late_text", ready=False, deadline=0.1), req("text", ready=False, deadline=5.0)]
    decision = decide(snap({"w0": (4, [])}, queued))
    gone = discarded(decision)
    assert set(gone) == {"hopeless", "late_text"}  # 10 steps alone take 0.2 s
    assert "cannot meet its deadline" in gone["hopeless"] and "alone" in gone["hopeless"]
    assert plan_on(decision, "w0").admit == ("fine",)
    # Exactly at the deadline is on time.
    assert not decide(snap({"w0": (4, [])}, [req("edge", deadline=0.2)])).discard


def test_urgent_mode_admits_the_least_slack_request_first():
    # At t = 0.1, 10 steps alone take 0.2 s: slack (0.5 - 0.1 - 0.2) / 0.2 = 1.0 against
    # (0.4 - 0.1 - 0.2) / 0.2 = 0.5, both below the throughput threshold (2).
    queued = [req("early", arrival=0.0, deadline=0.5), req("urgent", arrival=0.05, deadline=0.4)]
    decision = decide(snap({"w0": (1, [])}, queued, now=0.1))
    assert plan_on(decision, "w0").admit == ("urgent",)
    assert plan_on(decision, "w0").groups == steps(["urgent"])


def test_slack_is_counted_in_standalone_latencies():
    # Both have 0.3 s of margin; the SMALL one's is 1.5 solo runs, the LARGE one's 0.6.
    queued = [req("small", deadline=0.5), req("large", key=LARGE, deadline=0.8)]
    assert plan_on(decide(snap({"w0": (1, [])}, queued)), "w0").admit == ("large",)


def throughput_round():
    """w0 holds two SMALL requests and has room for one more; the least slack waiting is a LARGE
    request (slack 19, loose), a SMALL one would batch with the residents for 10 ms a step."""
    residents = [req("a"), req("b")]
    queued = [req("large", key=LARGE, deadline=10.0), req("small", deadline=20.0)]
    return snap({"w0": (3, residents)}, queued)


def test_throughput_mode_admits_what_batches_cheapest_when_slack_is_loose():
    decision = decide(throughput_round())
    plan = plan_on(decision, "w0")
    assert plan.admit == ("small",)  # gain 0.02 / 0.01 = 2 against the LARGE one's 0.05 / 0.05 = 1
    assert plan.groups == steps(["a", "b", "small"])


def test_below_the_threshold_it_stays_urgent_first():
    assert plan_on(decide(throughput_round(), throughput_slack=math.inf), "w0").admit == ("large",)
    assert plan_on(decide(throughput_round(), throughput_slack=20.0), "w0").admit == ("large",)
    assert plan_on(decide(throughput_round(), throughput_slack=18.0), "w0").admit == ("small",)


def test_no_admission_that_would_make_an_active_request_miss():
    # Alone the resident ends at 0.2 s; with one more SMALL request each step takes 30 ms: 0.3 s.
    tight = snap({"w0": (4, [req("resident", deadline=0.25)])}, [req("cand", deadline=10.0)])
    assert plan_on(decide(tight), "w0").admit == ()
    loose = snap({"w0": (4, [req("resident", deadline=0.3)])}, [req("cand", deadline=10.0)])
    assert plan_on(decide(loose), "w0").admit == ("cand",)
    # One that misses anyway (0.2 s > 0.15 s) does not block.
    late = snap({"w0": (4, [req("resident", deadline=0.15)])}, [req("cand", deadline=10.0)])
    assert plan_on(decide(late), "w0").admit == ("cand",)


def test_admission_stops_at_the_most_urgent_request_that_does_not_fit():
    # Algorithm 1, lines 22-24: the least-slack request (LARGE, slack 1) would make the resident
    # miss, so the round stops there, although the SMALL one-step request behind it would fit.
    resident = req("resident", deadline=0.25)
    blocked = snap({"w0": (3, [resident])}, [req("large", key=LARGE, deadline=1.0), req("short", steps=1,
                                                                                        deadline=5.0)])
    decision = decide(blocked)
    assert plan_on(decision, "w0").admit == () and not decision.discard
    alone = snap({"w0": (3, [resident])}, [req("short", steps=1, deadline=5.0)])
    assert plan_on(decide(alone), "w0").admit == ("short",)


def test_an_urgent_request_that_misses_on_every_worker_with_room_is_discarded():
    # Alone it would make it (0.5 s of 0.9 s), but the one worker with room holds three LARGE
    # requests: 0.17 s a step, 1.7 s for its 10 steps.
    busy = snap({"w0": (4, [req(f"r{i}", key=LARGE) for i in range(3)]), "w1": (1, [req("x")])},
                [req("cand", key=LARGE, deadline=0.9)])
    decision = decide(busy)
    assert "on any worker with room" in discarded(decision)["cand"]
    assert plan_on(decision, "w0").admit == ()


def test_a_busy_worker_starts_the_request_after_its_current_step():
    # The resident has one step left: with the candidate, 0.03 s, then 9 steps alone, 0.18 s.
    def round_(busy: bool):
        return snap({"w0": slot(4, [req("resident", steps=1)], busy=busy)}, [req("cand", deadline=0.215)])
    assert plan_on(decide(round_(busy=False)), "w0").admit == ("cand",)  # ends at 0.21 s
    assert "cand" in discarded(decide(round_(busy=True)))  # a step of 0.02 s first: 0.23 s


def test_a_request_waits_for_the_worker_where_it_finishes_first_even_if_not_open():
    # w1 opens within a step and is empty: the request finishes there first, so w0 does not take it.
    decision = decide(snap({"w0": (12, [req(f"r{i}", key=LARGE) for i in range(3)]), "w1": slot(4, [], open=False)},
                           [req("cand", deadline=10.0)]))
    assert plan_on(decision, "w0").admit == () and not decision.discard
    assert [p.worker_id for p in decision.plans] == ["w0"]


def test_packed_resolutions_let_a_request_join_where_a_forward_of_its_own_would_not():
    # The resident ends at 0.65 s at the latest; a LARGE request joining costs it 50 ms a step
    # as a forward of its own (0.7 s), 40 ms packed into the resident's forward (0.6 s).
    round_ = snap({"w0": (4, [req("resident", deadline=0.65)])}, [req("large", key=LARGE, deadline=10.0)])
    assert plan_on(decide(round_), "w0").admit == ()
    plan = plan_on(decide(round_, packed=True), "w0")
    assert plan.admit == ("large",)
    assert plan.groups == steps(["resident"], ["large"])  # one group per shape: the workers pack them


def test_the_round_respects_the_batch_cap_and_plans_only_open_workers():
    queued = [req(f"q{i}", deadline=10.0) for i in range(6)]
    decision = decide(snap({"w0": (4, []), "w1": slot(4, [req("r")], open=False)}, queued), max_batch_size=2)
    assert len(plan_on(decision, "w0").admit) == 2
    assert [p.worker_id for p in decision.plans] == ["w0"]
    assert not decide(snap({"w0": (2, [])}, [])).plans


def test_an_idle_pool_predicts_without_the_overhead_a_past_load_left():
    """The measured overhead is learned from running plans: on an idle pool it may be stale (an
    overload's), and nothing would run to correct it. An idle pool admits by the profile alone;
    with something running, the overhead counts."""
    stale = ((RequestKind.T2I, 0.5),)  # 0.5 s a step: 10 steps would take 5.2 s
    idle = decide(snap({"w0": (4, [])}, [req("a", deadline=1.0)], step_overhead_s=stale))
    assert not idle.discard and plan_on(idle, "w0").admit == ("a",)
    busy = decide(snap({"w0": (4, [req("r", deadline=100.0)])}, [req("a", deadline=1.0)], step_overhead_s=stale))
    assert set(discarded(busy)) == {"a"}
