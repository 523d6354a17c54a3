"""A request's step-cache threshold: its own, or its model's; refused above the model's fidelity
floor, and on a model whose family has no step cache."""

import math

import pytest
from pydantic import ValidationError

from stepserve.deployments.config import AppConfig, ModelConfig
from stepserve.deployments.errors import APIError
from stepserve.deployments.validation import to_specs
from stepserve.policies.types import StepCacheMethod

CONFIG = AppConfig.model_validate({"models": [
    {"name": "sd", "preset": "tiny", "default_size": "64x64", "step_cache": 0.1, "max_step_cache": 0.3},
    {"name": "flux", "family": "flux", "preset": "tiny", "default_size": "64x64"},
]})


def threshold(**body) -> float:
    (spec,) = to_specs({"prompt": "a cat", "model": "sd", **body}, CONFIG, "r")
    return spec.step_cache


def method(**body) -> StepCacheMethod:
    (spec,) = to_specs({"prompt": "a cat", "model": "sd", **body}, CONFIG, "r")
    return spec.step_cache_method


def test_the_requests_own_or_else_the_models():
    assert threshold() == 0.1
    assert threshold(step_cache=0.25) == 0.25
    assert threshold(step_cache=0) == 0.0  # a request may always ask to be exact


def test_the_method_is_the_requests_or_else_the_models():
    assert method() is StepCacheMethod.FIRST_BLOCK
    assert method(step_cache_method="taylorseer") is StepCacheMethod.TAYLORSEER
    taylor = AppConfig.model_validate({"models": [{"name": "sd", "preset": "tiny", "default_size": "64x64",
                                                   "step_cache_method": "taylorseer"}]})
    assert to_specs({"prompt": "a cat"}, taylor, "r")[0].step_cache_method is StepCacheMethod.TAYLORSEER
    with pytest.raises(APIError) as info:
        method(step_cache_method="magic")
    assert info.value.status == 400


@pytest.mark.parametrize("value", [-0.1, 0.31, math.nan, math.inf])
def test_outside_the_fidelity_floor_is_a_400(value):
    with pytest.raises(APIError) as info:
        threshold(step_cache=value)
    assert (info.value.status, info.value.param) == (400, "step_cache")


def test_a_family_without_the_step_cache_refuses_it():
    with pytest.raises(APIError) as info:
        to_specs({"prompt": "a cat", "model": "flux", "step_cache": 0.1}, CONFIG, "r")
    assert (info.value.status, info.value.param, info.value.code) == (400, "step_cache", "unsupported_value")
    assert to_specs({"prompt": "a cat", "model": "flux", "step_cache": 0}, CONFIG, "r")[0].step_cache == 0.0


def test_a_config_cannot_default_past_its_floor_or_on_a_family_without_it():
    with pytest.raises(ValidationError, match="exceeds max_step_cache"):
        ModelConfig(name="m", preset="tiny", step_cache=0.5, max_step_cache=0.2)
    with pytest.raises(ValidationError, match="has no step cache"):
        ModelConfig(name="m", family="flux", preset="tiny", step_cache=0.1)
