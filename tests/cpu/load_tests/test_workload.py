"""The Poisson workload: deterministic by seed, the asked rate and mix, valid request bodies."""

from __future__ import annotations

import statistics

import pytest

from stepserve.deployments.config import AppConfig
from stepserve.deployments.validation import to_specs
from stepserve.load_tests.workload import PoissonWorkload, generate


def test_same_seed_same_requests_other_seed_other_requests():
    spec = PoissonWorkload(rate=5.0, duration_s=30.0, seed=7)
    assert generate(spec) == generate(spec)
    assert generate(spec) != generate(PoissonWorkload(rate=5.0, duration_s=30.0, seed=8))


def test_rate_and_gaps_on_a_long_run():
    requests = generate(PoissonWorkload(rate=4.0, duration_s=2500.0, seed=1))
    # Poisson count over 2500 s at 4/s: mean 10000, sd 100; 5 sd either side.
    assert 9500 < len(requests) < 10500
    gaps = [b.offset_s - a.offset_s for a, b in zip(requests, requests[1:])]
    # Exponential gaps: mean 1/rate and standard deviation equal to the mean.
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.03)
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.05)


def test_offsets_increase_within_duration_and_indices_count_up():
    requests = generate(PoissonWorkload(rate=3.0, duration_s=20.0, seed=2))
    offsets = [r.offset_s for r in requests]
    assert offsets == sorted(offsets) and 0 < offsets[0] and offsets[-1] < 20.0
    assert [r.index for r in requests] == list(range(len(requests)))


def test_num_requests_bounds_the_run():
    assert len(generate(PoissonWorkload(rate=100.0, num_requests=17, seed=3))) == 17


def test_steps_drawn_from_choices_roughly_uniformly():
    requests = generate(PoissonWorkload(rate=1.0, num_requests=3000, steps_choices=(10, 20, 40), seed=4))
    counts = {s: sum(r.num_inference_steps == s for r in requests) for s in (10, 20, 40)}
    assert sum(counts.values()) == 3000
    assert all(900 < c < 1100 for c in counts.values()), counts


def test_each_request_has_its_own_seed():
    requests = generate(PoissonWorkload(rate=10.0, num_requests=200, seed=5))
    assert len({r.seed for r in requests}) == 200


def test_body_is_accepted_by_the_ingress_validation():
    request = generate(PoissonWorkload(rate=1.0, num_requests=1, width=128, height=96, seed=6))[0]
    config = AppConfig.model_validate({"models": [{"name": "tiny-sd", "preset": "tiny"}]})
    [spec] = to_specs(request.body(), config, "r0")
    assert (spec.width, spec.height) == (128, 96)
    assert spec.num_inference_steps == request.num_inference_steps
    assert spec.seed == request.seed and spec.guidance_scale == 7.5


@pytest.mark.parametrize("kwargs", [
    dict(rate=0.0, duration_s=1.0),
    dict(rate=1.0),
    dict(rate=1.0, duration_s=1.0, num_requests=3),
    dict(rate=1.0, num_requests=0),
    dict(rate=1.0, duration_s=1.0, steps_choices=()),
    dict(rate=1.0, duration_s=1.0, steps_choices=(10, 0)),
])
def test_invalid_workloads_are_refused(kwargs):
    with pytest.raises(ValueError):
        PoissonWorkload(**kwargs)
