"""A request's own `slo_s` overrides its model's; a nonsensical one is a 400 naming the field."""

import math

import pytest

from stepserve.deployments.config import AppConfig
from stepserve.deployments.errors import APIError
from stepserve.deployments.validation import MAX_SLO_S, to_specs

CONFIG = AppConfig.model_validate({"models": [{"name": "held", "preset": "tiny", "default_size": "64x64",
                                               "slo_s": 2.5},
                                              {"name": "free", "preset": "tiny", "default_size": "64x64"}]})


def slos(**body):
    return [s.slo_s for s in to_specs({"prompt": "a cat", **body}, CONFIG, "req")]


def test_the_request_slo_overrides_the_model_slo_for_every_image():
    assert slos(model="held", slo_s=0.75, n=2) == [0.75, 0.75]
    assert slos(model="free", slo_s=MAX_SLO_S) == [MAX_SLO_S]


def test_without_one_the_model_slo_holds():
    assert slos(model="held") == [2.5]
    assert slos(model="free") == [None]


@pytest.mark.parametrize("value", [0, -1.0, math.nan, math.inf, -math.inf, MAX_SLO_S * 1.001, "soon", [1.0]])
def test_nonsense_is_a_400_naming_slo_s(value):
    with pytest.raises(APIError) as info:
        slos(model="held", slo_s=value)
    assert (info.value.status, info.value.param, info.value.type) == (400, "slo_s", "invalid_request_error")
