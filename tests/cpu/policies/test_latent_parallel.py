"""The latent-parallel policy: a lone CFG image splits over two idle workers when the cost model
says it pays, runs as plain continuous batching otherwise, and gives a worker back when requests
wait; every plan passes the core's checks and every request finishes."""

from __future__ import annotations

import pytest

from stepserve.policies.cost_model import BatchShape, load_profile
from stepserve.policies.types import GroupSplit, RequestStatus
from tests.cpu.core_harness import Harness, spec

MODEL = "stable-diffusion-xl-base-1.0"
COSTS = load_profile("sdxl-h800")


def sdxl(rid: str, guidance: float = 7.5, steps: int = 6):
    return spec(rid, steps=steps, size=1024, guidance=guidance, model=MODEL)


def harness(workers: int = 2, **options) -> Harness:
    return Harness("latent_parallel", options, workers=workers, batch=4, costs=COSTS)


def splits(plans) -> list[tuple[str, tuple[str, ...], tuple[int, ...]]]:
    return [(p.worker_id, g.request_ids, g.ranks) for p in plans for g in p.groups if g.split is GroupSplit.CFG
            and g.ranks]


def test_the_sdxl_profile_says_a_split_pays():
    whole = COSTS.step_seconds(BatchShape(MODEL, 1024, 1024, 2))
    split = COSTS.step_seconds(BatchShape(MODEL, 1024, 1024, 2, cfg_split=True))
    assert 1.3 < whole / split < 1.4  # SwiftDiffusion: 1.36x for SDXL on an H800


def test_a_lone_cfg_image_splits_over_two_idle_workers_to_its_last_step():
    h = harness()
    h.submit(sdxl("a"))
    h.schedule()
    first = h.sent[:2]  # (the core pipelines a second round of plans behind these)
    assert splits(first) == [("w0", ("a",), (0, 1)), ("w1", ("a",), (0, 1))]
    assert all(p.admit == ("a",) for p in first)
    h.run()
    state = h.core.state("a")
    assert state.status is RequestStatus.FINISHED and state.degrees == (2,) * 6


@pytest.mark.parametrize("guidance", [1.0])
def test_a_request_without_cfg_is_not_split(guidance):
    h = harness()
    h.submit(sdxl("a", guidance=guidance))
    h.schedule()
    assert not splits(h.sent) and {p.worker_id for p in h.sent} == {"w0"}


def test_no_split_where_it_does_not_pay_or_workers_are_short():
    h = harness(min_gain=0.5)  # a split step is 0.74 of a whole one: no
    h.submit(sdxl("a"))
    h.schedule()
    assert not splits(h.sent)
    h = harness(workers=3)
    h.submit(sdxl("a"), sdxl("b"))  # two requests, three workers: each takes one
    h.schedule()
    assert not splits(h.sent) and len({p.worker_id for p in h.sent}) == 2


def test_a_pair_gives_a_worker_back_when_requests_wait():
    h = harness(workers=2)
    h.submit(sdxl("a", steps=10))
    h.round()
    h.round()  # split, stepping on both
    h.submit(sdxl("b"), sdxl("c"))
    h.now += 1
    h.sent.clear()
    decision = h.schedule()
    by_worker = {p.worker_id: p for p in decision.plans}
    assert [g.request_ids for g in by_worker["w0"].groups] == [("a",)] and not by_worker["w0"].groups[0].ranks
    assert by_worker["w1"].release == ("a",)
    h.run()
    for rid in "abc":
        assert h.status(rid) is RequestStatus.FINISHED
    degrees = h.core.state("a").degrees
    assert degrees[0] == 2 and degrees[-1] == 1 and len(degrees) == 10


def test_nothing_splits_while_the_world_is_down():
    h = harness()
    h.core.set_sp_available(False)
    h.submit(sdxl("a"))
    h.schedule()
    assert not splits(h.sent)


def test_a_split_request_whose_worker_dies_resumes_and_finishes():
    h = harness(workers=3)
    h.submit(sdxl("a", steps=8))
    h.round()
    h.round()
    assert h.core.state("a").degrees[:2] == (2, 2)
    outcome = h.core.worker_lost("w1", h.now)
    assert outcome.recovered == ("a",) and h.status("a") is RequestStatus.QUEUED
    h.queues["w1"].clear()
    h.core.set_sp_available(False)  # the world is down until every worker joins a new one
    h.core.worker_back("w1", "w1-2")
    h.run()
    state = h.core.state("a")
    assert state.status is RequestStatus.FINISHED and state.recoveries == 1 and set(state.degrees) == {1}


def test_a_pair_runs_plans_of_several_steps_in_lockstep_and_is_never_cut_alone():
    h = Harness("latent_parallel", {}, workers=2, batch=4, costs=COSTS, max_plan_s=1.0, depth=1)
    h.submit(sdxl("a", steps=30))
    h.run()
    split = [p for p in h.sent if p.groups and p.groups[0].ranks]
    by_round = {}
    for plan in split:
        by_round.setdefault(plan.plan_id, []).append(plan.steps)
    assert any(steps > 1 for steps, *_ in by_round.values())  # several steps a plan, once timed
    assert all(len(set(steps)) == 1 for steps in by_round.values())  # the same on both members
    assert h.core.state("a").degrees == (2,) * 30 and not h.interrupts
