"""What skip-CFG saves a forward, as the cost model prices it: the unconditional rows its
requests skip over their steps (`RequestSpec.skip_cfg_from`, `BatchShape.cfg_skip_share`)."""

import dataclasses

import pytest

from stepserve.policies.cost_model import BatchShape, ProfiledCostModel
from stepserve.policies.types import LoraUse, RequestSpec, StepGroup

from tests.cpu.policies.test_cost_model import M, linear_profile


def spec(rid: str, skip_cfg_from: float = 1.0, **extra) -> RequestSpec:
    return RequestSpec(request_id=rid, model=M, prompt="p", width=64, height=64, num_inference_steps=20,
                       guidance_scale=5.0, seed=0, skip_cfg_from=skip_cfg_from, **extra)


def test_a_batch_knows_the_rows_its_requests_skip():
    assert BatchShape.of([spec("a"), spec("b")]).cfg_skip_share == 0.0
    # a skips its unconditional row over the last 30% of its steps: 0.3 of one of the batch's 4 rows
    assert BatchShape.of([spec("a", 0.7), spec("b")]).cfg_skip_share == pytest.approx(0.3 / 4)
    assert BatchShape.of([spec("a", 0.0)]).cfg_skip_share == pytest.approx(0.5)
    # Without CFG there is no row to skip; add-on groups and groups over ranks run the plain forward.
    assert BatchShape.of([dataclasses.replace(spec("a", 0.0), guidance_scale=1.0)]).cfg_skip_share == 0.0
    assert BatchShape.of([spec("a", 0.0, loras=(LoraUse("x"),))]).cfg_skip_share == 0.0
    assert BatchShape.of([spec("a", 0.0)], StepGroup(("a",), (0, 1))).cfg_skip_share == 0.0


def test_a_skipping_batch_is_priced_by_the_rows_it_runs():
    costs = ProfiledCostModel(linear_profile())
    full = BatchShape(M, 64, 64, 4)
    skipping = dataclasses.replace(full, cfg_skip_share=0.25)
    assert costs.denoise_seconds(skipping) == pytest.approx(costs.denoise_seconds(full) * 0.75)
    with pytest.raises(ValueError, match="cfg_skip_share"):
        BatchShape(M, 64, 64, 4, cfg_skip_share=-0.1)


def test_a_request_skips_from_between_its_own_start_and_its_floors():
    """Its load controller moves the start toward the floor (`skip_cfg_step_under`); the price
    stays its own start's (what it skips without load)."""
    request = spec("a", 0.7, skip_cfg_floor_from=0.3)
    assert [request.skip_cfg_step_under(load) for load in (0.0, 0.5, 1.0)] == [14, 10, 6]
    assert request.skip_cfg_step == 14
    assert spec("a", 1.0, skip_cfg_floor_from=0.5).skip_cfg_step is None  # own S never skips; under load it may
    with pytest.raises(ValueError, match="skip_cfg_floor_from"):
        spec("a", 0.3, skip_cfg_floor_from=0.7)
