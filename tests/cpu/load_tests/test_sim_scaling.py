"""The simulator's elastic pool (`SimConfig.scaling`): the live router's scaler decides, a started
worker serves after its start-up delay, a drained one leaves once its requests moved; a burst
grows the pool, the lull after it shrinks it back, and nothing is lost."""

import pytest

from stepserve.load_tests.sim import SimConfig, TextEncoderSpec, simulate
from stepserve.load_tests.workload import ScheduledRequest
from stepserve.routing.pool_scaler import ScalingSpec
from tests.cpu.load_tests.costs import ConstantCost

ENCODER = TextEncoderSpec(batch_wait_s=0.0, cache_size=0)


def burst(n: int, at: float, steps: int = 20, slo: float = 30.0, first: int = 0) -> list[ScheduledRequest]:
    return [ScheduledRequest(index=first + i, offset_s=at + 0.01 * i, num_inference_steps=steps, seed=i, width=64,
                             height=64, guidance_scale=7.5, prompt=f"p{i}", model="sd", slo_s=slo)
            for i in range(n)]


def config(scaling: ScalingSpec | None, workers: int = 1) -> SimConfig:
    return SimConfig(workers=workers, max_batch_size=2, text_encoder=ENCODER, decoders=1, scaling=scaling,
                     worker_start_s=5.0)


def test_a_burst_grows_the_pool_the_lull_shrinks_it_and_every_request_finishes():
    requests = burst(12, at=1.0) + burst(2, at=150.0, first=100)
    scaling = ScalingSpec(min_workers=1, max_workers=4, target_requests=2, scale_down_delay_s=10.0)
    result = simulate(requests, ConstantCost(step_s=0.5), config(scaling))
    assert all(t.status == "finished" for t in result.traces)
    sizes = [size for _, size in result.pool]
    assert max(sizes) == 4 and sizes[-1] == 1
    grew_at = next(t for t, size in result.pool if size == 4)
    assert 1.0 < grew_at < 3.0  # within a tick or two of the burst
    # Workers added mid-run took work; the drained ones moved theirs (pauses) and nothing ran twice.
    assert len(result.busy_s) > 1 and sum(s > 0 for s in result.busy_s.values()) > 1
    assert all(len(t.degrees) == t.steps for t in result.traces)


def test_scaling_meets_more_deadlines_than_a_fixed_pool_of_the_minimum_and_costs_less_than_the_maximum():
    # A burst, then one request every 10 s for three minutes.
    requests = burst(16, at=1.0, slo=40.0) + [r for i in range(18) for r in burst(1, at=20.0 + 10 * i, first=100 + i)]
    scaling = ScalingSpec(min_workers=1, max_workers=4, target_requests=2, scale_down_delay_s=10.0)
    elastic = simulate(requests, ConstantCost(step_s=0.5), config(scaling))
    small = simulate(requests, ConstantCost(step_s=0.5), config(None))
    large = simulate(requests, ConstantCost(step_s=0.5), config(None, workers=4))
    met = {name: sum(t.met_slo for t in r.traces) for name, r in
           (("elastic", elastic), ("small", small), ("large", large))}
    assert met["elastic"] > met["small"]
    assert elastic.worker_s < large.worker_s


def test_bounds_outside_the_start_size_are_refused():
    with pytest.raises(ValueError, match="min_workers <= workers <= max_workers"):
        config(ScalingSpec(min_workers=2, max_workers=4), workers=1)
