"""What step caching saves a forward, as the cost model prices it (`policies.step_cache_costs`)."""

import dataclasses

import pytest

from stepserve.policies.cost_model import BatchShape, ProfiledCostModel
from stepserve.policies.step_cache_costs import HEAD_SHARE, SKIP_SHARE, cached_forward_share, expected_skip_share
from stepserve.policies.types import LoraUse, RequestSpec, StepGroup

from tests.cpu.policies.test_cost_model import M, linear_profile


def spec(rid: str, step_cache: float = 0.0, **extra) -> RequestSpec:
    return RequestSpec(request_id=rid, model=M, prompt="p", width=64, height=64, num_inference_steps=20,
                       guidance_scale=5.0, seed=0, step_cache=step_cache, **extra)


def test_the_skip_share_follows_the_measured_curve():
    assert expected_skip_share(0.0) == 0.0
    for threshold, share in SKIP_SHARE:
        assert expected_skip_share(threshold) == pytest.approx(share)
    assert expected_skip_share(0.15) == pytest.approx((0.35 + 0.59) / 2)  # linear between measurements
    assert expected_skip_share(5.0) == SKIP_SHARE[-1][1]
    shares = [expected_skip_share(t / 100) for t in range(40)]
    assert shares == sorted(shares)


def test_a_batch_knows_its_rows_expected_skips():
    assert BatchShape.of([spec("a"), spec("b")]).skip_share == 0.0
    half = BatchShape.of([spec("a", 0.2), spec("b")])
    assert half.skip_share == pytest.approx(0.59 / 2)
    # Add-on groups and groups over ranks run the plain forward: nothing skips there.
    assert BatchShape.of([spec("a", 0.2, loras=(LoraUse("x"),))]).skip_share == 0.0
    assert BatchShape.of([spec("a", 0.2)], StepGroup(("a",), (0, 1))).skip_share == 0.0


def test_a_caching_batch_is_priced_cheaper_by_what_its_rows_skip():
    costs = ProfiledCostModel(linear_profile())
    full = BatchShape(M, 64, 64, 4)
    cached = dataclasses.replace(full, skip_share=0.5)
    assert costs.denoise_seconds(cached) == pytest.approx(costs.denoise_seconds(full) * cached_forward_share(0.5))
    assert cached_forward_share(0.0) == 1.0 and cached_forward_share(1.0) == HEAD_SHARE
    with pytest.raises(ValueError, match="skip_share"):
        BatchShape(M, 64, 64, 4, skip_share=1.5)
