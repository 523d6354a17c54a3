"""A request's skip-CFG quality S: its own, or its model's; refused below the model's fidelity
floor, and below 1 on a model without a measured curve. The embedded default serves the shapes
model's curve with skip-CFG off unless a request asks."""

import math

import pytest
from pydantic import ValidationError

from stepserve.deployments.config import AppConfig, ModelConfig
from stepserve.deployments.edit_validation import to_edit_specs
from stepserve.deployments.errors import APIError
from stepserve.deployments.validation import to_specs
from stepserve.oneshot import app_config
from stepserve.runtime import default_config_path, load_serve_config

from tests.cpu.deployments.test_edits_api import body as edit_body

CURVE = [[0.0, 0.8], [0.4, 0.95], [0.7, 0.98], [0.9, 0.99]]
CONFIG = AppConfig.model_validate({"models": [
    {"name": "sd", "preset": "tiny", "default_size": "64x64", "skip_cfg_curve": CURVE, "min_skip_cfg_quality": 0.9},
    {"name": "plain", "preset": "tiny", "default_size": "64x64"},
]})


def skip_from(model: str = "sd", **body) -> float:
    (spec,) = to_specs({"prompt": "a cat", "model": model, **body}, CONFIG, "r")
    return spec.skip_cfg_from


def test_the_requests_own_quality_or_else_the_models():
    assert skip_from() == 1.0  # the model's S is 1: never
    assert skip_from(skip_cfg_quality=0.95) == 0.4
    assert skip_from(skip_cfg_quality=0.98) == 0.7
    assert skip_from(skip_cfg_quality=1) == 1.0
    assert skip_from("plain", skip_cfg_quality=1) == 1.0  # a request may always ask to be exact


def test_the_floor_a_load_controller_may_move_it_to():
    """Where the curve keeps the model's floor (0.9: from 0.4); exact requests stay exact."""
    def starts(**body) -> tuple[float, float]:
        (spec,) = to_specs({"prompt": "a cat", "model": "sd", **body}, CONFIG, "r")
        return spec.skip_cfg_from, spec.skip_cfg_floor_from

    assert starts(skip_cfg_quality=0.98) == (0.7, 0.4)
    assert starts(skip_cfg_quality=0.95) == (0.4, 0.4)
    assert starts() == starts(skip_cfg_quality=1) == (1.0, None)


def test_an_edit_takes_the_requests_quality_too():
    (spec,), _ = to_edit_specs(edit_body(model="sd", skip_cfg_quality=0.98), CONFIG, "e")
    assert (spec.skip_cfg_from, spec.skip_cfg_floor_from) == (0.7, 0.4)


@pytest.mark.parametrize("value", [0.89, 1.01, 0, -1, math.nan, math.inf])
def test_outside_the_fidelity_floor_is_a_400(value):
    with pytest.raises(APIError) as info:
        skip_from(skip_cfg_quality=value)
    assert (info.value.status, info.value.param) == (400, "skip_cfg_quality")


def test_a_model_without_a_curve_refuses_to_skip():
    with pytest.raises(APIError) as info:
        skip_from("plain", skip_cfg_quality=0.97)
    assert (info.value.status, info.value.param, info.value.code) == (400, "skip_cfg_quality", "unsupported_value")


def test_a_models_own_quality_may_not_be_below_its_floor():
    with pytest.raises(ValidationError, match="below min_skip_cfg_quality"):
        ModelConfig(name="m", preset="tiny", skip_cfg_quality=0.9, skip_cfg_curve=CURVE)


def test_the_embedded_default_skips_cfg_only_when_asked():
    app = app_config(load_serve_config(default_config_path()))
    (spec,) = to_specs({"prompt": "a red circle on a white background"}, app, "r")
    assert spec.skip_cfg_from == 1.0
    # S = 0.95 picks 40% of the steps on the measured curve (README "SynerDiff").
    (spec,) = to_specs({"prompt": "a red circle on a white background", "skip_cfg_quality": 0.95}, app, "r")
    assert spec.skip_cfg_from == 0.4
