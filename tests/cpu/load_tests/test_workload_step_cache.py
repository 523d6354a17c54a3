"""Step caching in workloads: a class's `step_cache` reaches each request's body and its simulated
spec, and the simulator prices the caching steps cheaper (the cost model's `skip_share`)."""

from dataclasses import replace

import pytest

from stepserve.load_tests.sim import SimConfig, simulate
from stepserve.load_tests.workload import WorkloadError, generate, parse_workload
from stepserve.policies.cost_model import load_profile


def workload(step_cache: float, **extra) -> dict:
    return {"arrival": {"process": "poisson", "rate": 4.0}, "num_requests": 24, "seed": 3,
            "classes": [{"name": "img", "model": "stable-diffusion-v1-5", "sizes": ["512x512"], "steps": 20,
                         "step_cache": step_cache, **extra}]}


def test_a_classes_threshold_reaches_its_requests():
    requests = generate(parse_workload(workload(0.2)))
    assert all(r.step_cache == 0.2 and r.body()["step_cache"] == 0.2 for r in requests)
    assert "step_cache" not in generate(parse_workload(workload(0.0)))[0].body()  # exact: the field is left out
    with pytest.raises(WorkloadError, match="videos have no step cache"):
        parse_workload(workload(0.2, num_frames=17))


def test_the_simulator_runs_caching_requests_faster():
    cost = load_profile("sd15-a100")
    cached = generate(parse_workload(workload(0.2)))
    exact = [replace(r, step_cache=0.0) for r in cached]
    config = SimConfig(workers=1, max_batch_size=8, policy="continuous")
    busy = {name: sum(simulate(requests, cost, config).busy_s.values())
            for name, requests in (("cached", cached), ("exact", exact))}
    assert busy["cached"] < 0.8 * busy["exact"]
