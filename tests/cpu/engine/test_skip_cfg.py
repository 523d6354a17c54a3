"""Adaptive skip-CFG as a worker serves it (`engine.forward_modes.skip_cfg`): from its first
skipping step on (`RequestSpec.skip_cfg_from`) a request runs its conditional row alone and is
guided by it; before, and for its partners in the same forward, nothing changes."""

import dataclasses

import numpy as np
import pytest

from stepserve.engine.forward_modes.base import ModeName
from stepserve.engine.step_runner import StepRunner
from stepserve.policies.types import StepGroup

from tests.tiny import make_spec, run_together

MODELS = [("tiny_family", "tiny-sd"), ("tiny_sd3", "tiny-sd3")]


def skipping(spec, start: float):
    """`spec` skipping CFG from fraction `start` of its steps on."""
    return dataclasses.replace(spec, skip_cfg_from=start)


def generate(family, model: str, specs, steps: int) -> tuple[dict, dict]:
    runner = StepRunner("w0", {model: family})
    return run_together(runner, family, specs, steps, (StepGroup(tuple(s.request_id for s in specs)),))


@pytest.mark.parametrize("name,model", MODELS)
def test_skipping_every_step_is_sampling_without_guidance(name, model, request):
    family = request.getfixturevalue(name)
    spec = make_spec("r", steps=4, seed=3, model=model)
    skipped, states = generate(family, model, [skipping(spec, 0.0)], 4)
    assert states["r"].first_step == 0
    unguided, _ = generate(family, model, [dataclasses.replace(spec, cfg=False)], 4)
    np.testing.assert_allclose(skipped["r"], unguided["r"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name,model", MODELS)
def test_a_late_skipper_changes_only_its_late_steps_and_its_partner_stays_exact(name, model, request):
    family = request.getfixturevalue(name)
    plain = make_spec("plain", steps=6, seed=1, model=model)
    late = make_spec("late", steps=6, seed=2, model=model, prompt="a lighthouse")
    together, states = generate(family, model, [plain, skipping(late, 0.5)], 6)
    assert states["late"].first_step == 3 and "plain" not in states
    exact, _ = generate(family, model, [plain, late], 6)
    np.testing.assert_allclose(together["plain"], exact["plain"], rtol=1e-4, atol=1e-4)  # the partner: exact
    assert np.abs(together["late"] - exact["late"]).max() > 1e-3  # it skipped: not the exact image
    early, _ = generate(family, model, [skipping(late, 0.0)], 6)
    assert np.abs(together["late"] - early["late"]).max() > 1e-3  # its first half was guided
    alone, _ = generate(family, model, [skipping(late, 0.5)], 6)
    np.testing.assert_allclose(together["late"], alone["late"], rtol=1e-4, atol=1e-4)  # as alone


def test_its_first_step_rounds_up_and_none_is_left_is_never(tiny_family):
    spec = make_spec("r", steps=10)
    assert skipping(spec, 0.7).skip_cfg_step == 7 and skipping(spec, 0.75).skip_cfg_step == 8
    assert skipping(spec, 0.95).skip_cfg_step is None and spec.skip_cfg_step is None
    assert dataclasses.replace(skipping(spec, 0.0), cfg=False).skip_cfg_step is None
    never, states = generate(tiny_family, "tiny-sd", [skipping(spec, 0.95)], 10)
    assert states == {}  # no state: every step exact
    exact, _ = generate(tiny_family, "tiny-sd", [spec], 10)
    np.testing.assert_array_equal(never["r"], exact["r"])


def test_the_mode_is_always_there_and_a_fraction_is_a_fraction():
    assert ModeName.SKIP_CFG in StepRunner("w0", {}).modes
    with pytest.raises(ValueError, match="skip_cfg_from"):
        skipping(make_spec("r"), 1.5)


@pytest.mark.parametrize("name,model", MODELS)
def test_a_request_caching_steps_also_skips_cfg_from_its_step(name, model, request):
    """Both asked for: the step cache's forward runs its conditional row alone from its first
    skipping step, and its cache keeps that row; a threshold it never reaches changes nothing."""
    family = request.getfixturevalue(name)
    spec = skipping(make_spec("r", steps=6, seed=2, model=model, prompt="a lighthouse"), 0.5)
    alone, _ = generate(family, model, [spec], 6)
    both, states = generate(family, model, [dataclasses.replace(spec, step_cache=1e-9)], 6)
    cache = states["r"]
    assert (cache.rows, cache.computed, cache.skipped) == (1, 6, 0)  # from step 3 on, one row
    np.testing.assert_allclose(both["r"], alone["r"], rtol=1e-4, atol=1e-4)
    reusing, states = generate(family, model, [dataclasses.replace(spec, step_cache=10.0)], 6)
    assert (states["r"].rows, states["r"].computed, states["r"].skipped) == (1, 1, 5)
    cached_only, _ = generate(family, model, [dataclasses.replace(spec, step_cache=10.0, skip_cfg_from=1.0)], 6)
    assert np.abs(reusing["r"] - cached_only["r"]).max() > 1e-3  # it skipped its unconditional rows too


@pytest.mark.parametrize("name,model", MODELS)
def test_a_skipper_beside_a_caching_request_skips_and_a_plain_partner_stays_exact(name, model, request):
    """One group of a caching request, a skip-CFG request and a plain one runs as one forward of
    the step cache's mode: each of the other two gets what it would get alone."""
    family = request.getfixturevalue(name)
    caching = dataclasses.replace(make_spec("caching", steps=6, seed=1, model=model), step_cache=10.0)
    skipper = skipping(make_spec("skipper", steps=6, seed=2, model=model, prompt="a lighthouse"), 0.5)
    plain = make_spec("plain", steps=6, seed=3, model=model, prompt="a boat")
    together, states = generate(family, model, [caching, skipper, plain], 6)
    assert states["caching"].skipped == 5 and states["skipper"].first_step == 3
    for spec in (skipper, plain):
        alone, _ = generate(family, model, [spec], 6)
        np.testing.assert_allclose(together[spec.request_id], alone[spec.request_id], rtol=1e-4, atol=1e-4)
    exact, _ = generate(family, model, [dataclasses.replace(skipper, skip_cfg_from=1.0)], 6)
    assert np.abs(together["skipper"] - exact["skipper"]).max() > 1e-3
