"""Step caching as a worker serves it: per request, inside a batch. A request that asks for it
skips steps; its partner that does not is exact, as is the asking request with threshold 0."""

import dataclasses

import numpy as np
import pytest

from stepserve.engine.step_runner import StepRunner
from stepserve.policies.types import StepCacheMethod, StepGroup, WorkerPlan

from tests.tiny import admission_for, make_spec, run_together


def generate(runner: StepRunner, family, specs, steps: int) -> tuple[dict, dict]:
    """Everyone admitted at once, one group, stepped to the end: the finished latents and the
    step caches, by id."""
    return run_together(runner, family, specs, steps, (StepGroup(tuple(s.request_id for s in specs)),))


@pytest.mark.parametrize("name,model", [("tiny_family", "tiny-sd"), ("tiny_sd3", "tiny-sd3")])
def test_a_caching_request_skips_and_its_partner_stays_exact(name, model, request):
    family = request.getfixturevalue(name)
    runner = StepRunner("w0", {model: family})
    plain = make_spec("plain", steps=6, seed=1, model=model)
    caching = dataclasses.replace(make_spec("caching", steps=6, seed=2, model=model, prompt="a lighthouse"),
                                  step_cache=10.0)
    together, caches = generate(runner, family, [plain, caching], 6)
    assert (caches["caching"].computed, caches["caching"].skipped) == (1, 5)  # it computed its first step only
    alone, _ = generate(StepRunner("w1", {model: family}), family, [plain], 6)
    np.testing.assert_allclose(together["plain"], alone["plain"], rtol=1e-4, atol=1e-4)  # (latents of ~10)
    exact, _ = generate(StepRunner("w2", {model: family}), family, [dataclasses.replace(caching, step_cache=0.0)], 6)
    assert np.abs(together["caching"] - exact["caching"]).max() > 1e-3  # it reused steps: not the exact image


def test_a_threshold_of_zero_holds_no_cache(tiny_family):
    runner = StepRunner("w0", {"tiny-sd": tiny_family})
    spec = make_spec("a", steps=2)
    runner.execute(WorkerPlan("w0", admit=("a",)), {"a": admission_for(tiny_family, spec)})
    assert runner.samplers["a"].mode is None


def test_a_taylorseer_request_extrapolates(tiny_family):
    runner = StepRunner("w0", {"tiny-sd": tiny_family})
    spec = dataclasses.replace(make_spec("a", steps=2), step_cache=0.2, step_cache_method=StepCacheMethod.TAYLORSEER)
    runner.execute(WorkerPlan("w0", admit=("a",)), {"a": admission_for(tiny_family, spec)})
    assert runner.samplers["a"].mode_state.order == 1
