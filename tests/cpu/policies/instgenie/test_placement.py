"""Mask-aware placement (Algorithm 2) on hand-made snapshots, and against a brute-force finish
time computed step by step."""

from __future__ import annotations

import math
import random

import pytest

from stepserve.policies import Scheduler, make_policy, needs_costs
from stepserve.policies.instgenie import Horizon, MaskAwarePlacement
from stepserve.policies.instgenie.placement import batch_shapes
from stepserve.policies.types import RequestKind, RequestStatus, RequestView, ShapeKey

from tests.cpu.policies.snapshots import assert_executable, plan_on, slot, snap, steps

KEY = ShapeKey("flux", 1024, 1024)


class FakeCosts:
    """A round: 10 ms fixed per forward plus 100 ms per computed row (rows x mask ratio)."""

    def round_seconds(self, batches):
        return sum(0.01 + 0.1 * b.rows * b.mask_ratio for b in batches)


def edit(rid, mask, steps_total=20, done=0, arrival=0.0, ready=True, template="t"):
    return RequestView(rid, RequestKind.EDIT, KEY, 1, done, steps_total, arrival, math.inf, ready,
                       RequestStatus.QUEUED, mask_ratio=mask, template_id=template)


def image(rid, steps_total=20, arrival=0.0):
    return RequestView(rid, RequestKind.T2I, KEY, 1, 0, steps_total, arrival, math.inf, True, RequestStatus.QUEUED)


def policy(**options):
    return make_policy("mask_aware", options, FakeCosts())


def test_registered_by_name_with_costs():
    assert needs_costs("mask_aware")
    built = policy(max_batch_size=4, horizon="step")
    assert isinstance(built, Scheduler) and isinstance(built, MaskAwarePlacement)
    assert built.name == "mask_aware" and built.config.horizon is Horizon.STEP and built.config.max_batch_size == 4
    assert built.joins_running and built.steady and not built.splits_cfg
    with pytest.raises(ValueError, match="latency profiles"):
        make_policy("mask_aware", {})
    for bad in ({"horizon": "forever"}, {"max_batch_size": 0}, {"window": 1}):
        with pytest.raises(ValueError):
            make_policy("mask_aware", bad, FakeCosts())


def test_an_edit_goes_where_the_masks_are_small_not_where_the_count_is():
    s = snap({"w0": (4, [edit("a", 0.9), edit("b", 0.9)]), "w1": (4, [edit("c", 0.05), edit("d", 0.05)])},
             [edit("new", 0.2)])
    decision = policy().schedule(s)
    assert_executable(s, decision)
    assert plan_on(decision, "w1").admit == ("new",)
    assert plan_on(decision, "w1").groups == steps(["c", "d", "new"])
    assert plan_on(decision, "w0").groups == steps(["a", "b"]) and not plan_on(decision, "w0").admit


def test_a_generation_is_placed_by_request_count():
    s = snap({"w0": (4, [edit("a", 0.9)]), "w1": (4, [edit("c", 0.05), edit("d", 0.05)])}, [image("new")])
    assert plan_on(policy().schedule(s), "w0").admit == ("new",)


def test_each_edit_sees_the_edits_placed_before_it():
    s = snap({"w0": (4, []), "w1": (4, [])}, [edit("x", 0.5, arrival=0.0), edit("y", 0.5, arrival=1.0)])
    decision = policy().schedule(s)
    assert plan_on(decision, "w0").admit == ("x",) and plan_on(decision, "w1").admit == ("y",)


def test_finish_horizon_counts_residents_leaving_and_step_horizon_does_not():
    draining = [edit(f"d{i}", 0.5, steps_total=20, done=19) for i in range(3)]  # one step left each
    s = snap({"w0": (8, draining), "w1": (8, [edit("long", 0.5, steps_total=40, done=10)])}, [edit("new", 0.5)])
    # finish: w0 = 1 x (0.01 + 0.2) + 19 x 0.06 = 1.35 s, w1 = 20 x 0.11 = 2.2 s; step: w0 = 20 x 0.21 = 4.2 s.
    assert plan_on(policy().schedule(s), "w0").admit == ("new",)
    assert plan_on(policy(horizon="step").schedule(s), "w1").admit == ("new",)
    assert policy().cost(draining, edit("new", 0.5)) == pytest.approx(1.35)


def test_an_edit_waits_for_its_best_worker_and_holds_its_place_there():
    s = snap({"w0": slot(1, [], open=False, busy=True), "w1": (4, [edit("a", 0.9)])},
             [edit("first", 0.2), edit("second", 0.2)])
    decision = policy().schedule(s)
    assert_executable(s, decision)
    assert plan_on(decision, "w0").is_empty  # not open: it gets no plan, "first" waits for it
    w1 = plan_on(decision, "w1")
    assert w1.admit == ("second",) and w1.groups == steps(["a", "second"])


def test_full_workers_admit_nothing_and_go_on_stepping():
    s = snap({"w0": (1, [edit("a", 0.3)]), "w1": (1, [edit("b", 0.3)])}, [edit("new", 0.1), image("img")])
    decision = policy().schedule(s)
    assert [p.admit for p in decision.plans] == [(), ()]
    assert {p.worker_id: p.groups for p in decision.plans} == {"w0": steps(["a"]), "w1": steps(["b"])}


def test_requests_still_waiting_for_conditioning_are_left_alone():
    s = snap({"w0": (4, [])}, [edit("late", 0.2, ready=False), edit("now", 0.2, arrival=1.0)])
    assert plan_on(policy().schedule(s), "w0").admit == ("now",)


def test_an_edit_without_a_cached_template_counts_as_a_full_forward():
    (shape,) = batch_shapes([edit("a", 0.2), edit("b", 0.2, template=None), image("c")])
    assert shape.rows == 3 and shape.mask_ratio == pytest.approx((0.2 + 1 + 1) / 3)


def finish_by_steps(costs, batch, request):
    """The request's finish on a worker, one step at a time."""
    seconds = 0.0
    for step in range(request.steps_left):
        members = [v for v in batch if v.steps_left > step] + [request]
        seconds += costs.round_seconds(batch_shapes(members))
    return seconds


@pytest.mark.parametrize("horizon", list(Horizon))
def test_the_edit_goes_to_the_worker_where_it_finishes_first(horizon):
    rng = random.Random(3)
    costs = FakeCosts()
    for trial in range(200):
        workers, batches = {}, {}
        for w in range(rng.randint(1, 4)):
            batch = [edit(f"r{w}{i}", rng.uniform(0.01, 1), steps_total=30, done=rng.randint(0, 29))
                     for i in range(rng.randint(0, 3))]
            workers[f"w{w}"] = slot(4, batch, open=rng.random() < 0.8, busy=bool(batch))
            batches[f"w{w}"] = batch
        new = edit("new", rng.uniform(0.01, 1), steps_total=rng.randint(1, 30))
        s = snap(workers, [new])
        decision = make_policy("mask_aware", {"horizon": horizon.value}, costs).schedule(s)
        assert_executable(s, decision)

        def cost(wid):
            batch = batches[wid]
            if horizon is Horizon.STEP:
                return new.steps_left * costs.round_seconds(batch_shapes(batch + [new]))
            return finish_by_steps(costs, batch, new)

        best = min(workers, key=lambda wid: (cost(wid), not workers[wid].open))
        placed = [p.worker_id for p in decision.plans if "new" in p.admit]
        assert placed == ([best] if workers[best].open else []), trial
