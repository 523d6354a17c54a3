"""What the solver asks of a cost model: one `step_seconds(BatchShape)`, memoized, plus the
overhead the live router observes per request kind."""

from __future__ import annotations

import math

import pytest

from stepserve.policies.cost_model import BatchShape
from stepserve.policies.genserve import (
    GenServeConfig,
    MemoizedCosts,
    ObservedOverheadCosts,
    RoundInput,
    StepCosts,
    decide_round,
)
from stepserve.policies.types import RequestKind

from tests.cpu.policies.genserve.fakes import SMALL, FakeCosts, img, vid, workers

IMAGE = BatchShape("sd", 512, 512, 4)
VIDEO = BatchShape("wan", 480, 832, 2, frames=81, sp_degree=2)


def test_fakes_and_wrappers_are_step_costs():
    fake = FakeCosts()
    for costs in (fake, MemoizedCosts(fake), ObservedOverheadCosts(fake, {})):
        assert isinstance(costs, StepCosts)


def test_observed_overhead_is_added_by_kind():
    fake = FakeCosts()
    costs = ObservedOverheadCosts(fake, {RequestKind.T2I: 0.05, RequestKind.T2V: 0.2})
    assert costs.step_seconds(IMAGE) == pytest.approx(fake.step_seconds(IMAGE) + 0.05)
    assert costs.step_seconds(VIDEO) == pytest.approx(fake.step_seconds(VIDEO) + 0.2)
    # One kind measured: the other gets back the profile exactly.
    video_only = ObservedOverheadCosts(fake, {RequestKind.T2V: 0.5})
    assert video_only.step_seconds(IMAGE) == fake.step_seconds(IMAGE)
    assert video_only.step_seconds(VIDEO) == pytest.approx(fake.step_seconds(VIDEO) + 0.5)
    # A degree the model cannot run at stays impossible.
    table = FakeCosts(video_steps={"wan": {1: 3.0}})
    assert math.isinf(ObservedOverheadCosts(table, {RequestKind.T2V: 0.5}).step_seconds(VIDEO))


@pytest.mark.parametrize("extra, match", [
    ({RequestKind.T2I: -0.1}, "t2i"),
    ({RequestKind.T2V: math.nan}, "t2v"),
    ({"t2v": 0.1}, "RequestKind"),
])
def test_observed_overhead_is_checked(extra, match):
    with pytest.raises(ValueError, match=match):
        ObservedOverheadCosts(FakeCosts(), extra)


def test_memo_asks_each_shape_once():
    fake = FakeCosts()
    costs = MemoizedCosts(fake)
    assert costs.step_seconds(VIDEO) == fake.step_seconds(VIDEO)
    calls = fake.calls
    assert costs.step_seconds(BatchShape("wan", 480, 832, 2, frames=81, sp_degree=2)) == fake.step_seconds(VIDEO)
    assert costs.step_seconds_of(("wan", 480, 832, 2, 81, 2)) == fake.step_seconds(VIDEO)
    assert fake.calls == calls + 2  # only the two direct questions to the fake
    # Every field is part of the key.
    assert costs.step_seconds(IMAGE) != costs.step_seconds(BatchShape("sd", 512, 512, 2))
    assert costs.step_seconds(VIDEO) != costs.step_seconds(BatchShape("wan", 480, 832, 2, frames=81))
    table = costs.video_step_table("wan", 480, 832, 2, 81, (1, 2, 4))
    assert table == tuple(fake.step_seconds(BatchShape("wan", 480, 832, 2, 81, d)) for d in (1, 2, 4))


class Recording(FakeCosts):
    def __init__(self) -> None:
        super().__init__()
        self.asked: list[BatchShape] = []

    def step_seconds(self, batch: BatchShape) -> float:
        self.asked.append(batch)
        return super().step_seconds(batch)


def test_the_solver_costs_each_request_with_its_own_rows_and_frames():
    costs = Recording()
    inp = RoundInput(0.0, workers(4), images=(img("i", 5.0, rows=1, key=SMALL),),
                     videos=(vid("v", 100.0, frames=33, rows=1),))
    decide_round(inp, GenServeConfig(sp_degrees=(1, 2)), costs)
    videos = {b for b in costs.asked if b.frames > 1}
    assert videos == {BatchShape("wan", 480, 832, 1, 33, d) for d in (1, 2)}
    assert BatchShape("sd", 512, 512, 1) in costs.asked
