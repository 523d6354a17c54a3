"""Adaptive skip-CFG as a worker serves it (`engine.forward_modes.skip_cfg`): from its first
skipping step on a request runs its conditional row alone and is guided by it; before, and for
its partners in the same forward, nothing changes."""

import dataclasses

import numpy as np
import pytest

from stepserve.engine.forward_modes.base import ModeName
from stepserve.engine.forward_modes.skip_cfg import SkipCfg
from stepserve.engine.step_runner import StepRunner
from stepserve.policies.synerdiff.skip_cfg import SkipCfgCurve
from stepserve.policies.types import StepGroup

from tests.tiny import make_spec, run_together

MODELS = [("tiny_family", "tiny-sd"), ("tiny_sd3", "tiny-sd3")]


def skipping_from(model: str, start: float, quality: float = 0.9) -> StepRunner:
    """A worker whose requests of `model` skip CFG from fraction `start` of their steps on."""
    return StepRunner("w0", {}, skip_cfg={model: SkipCfg(SkipCfgCurve(((start, 0.95),)), quality)})


def generate(runner: StepRunner, family, model: str, specs, steps: int) -> tuple[dict, dict]:
    runner.families[model] = family
    return run_together(runner, family, specs, steps, (StepGroup(tuple(s.request_id for s in specs)),))


@pytest.mark.parametrize("name,model", MODELS)
def test_skipping_every_step_is_sampling_without_guidance(name, model, request):
    family = request.getfixturevalue(name)
    spec = make_spec("r", steps=4, seed=3, model=model)
    skipped, states = generate(skipping_from(model, 0.0), family, model, [spec], 4)
    assert states["r"].first_step == 0
    unguided, _ = generate(StepRunner("w1", {}), family, model, [dataclasses.replace(spec, cfg=False)], 4)
    np.testing.assert_allclose(skipped["r"], unguided["r"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name,model", MODELS)
def test_a_late_skipper_changes_only_its_late_steps_and_its_partner_stays_exact(name, model, request):
    family = request.getfixturevalue(name)
    plain = make_spec("plain", steps=6, seed=1, model=model)
    late = make_spec("late", steps=6, seed=2, model=model, prompt="a lighthouse")
    runner = skipping_from(model, 0.5)
    together, states = generate(runner, family, model, [plain, late], 6)
    assert states["late"].first_step == 3 and states["plain"].first_step == 3
    runner.families.clear()
    exact, _ = generate(StepRunner("w1", {}), family, model, [plain, late], 6)
    assert np.abs(together["late"] - exact["late"]).max() > 1e-3  # it skipped: not the exact image
    early, _ = generate(skipping_from(model, 0.0), family, model, [late], 6)
    assert np.abs(together["late"] - early["late"]).max() > 1e-3  # its first half was guided


def test_a_skipper_beside_an_exact_partner_leaves_the_partner_exact(tiny_family):
    plain = make_spec("plain", steps=4, seed=1)
    skipper = make_spec("skipper", steps=4, seed=2, prompt="a lighthouse")
    runner = skipping_from("tiny-sd", 0.0)
    mode = runner.modes[ModeName.SKIP_CFG]
    admit = mode.admit
    mode.admit = lambda sampler, family: None if sampler.spec.request_id == "plain" else admit(sampler, family)
    mixed, _ = generate(runner, tiny_family, "tiny-sd", [plain, skipper], 4)
    alone, _ = generate(StepRunner("w1", {}), tiny_family, "tiny-sd", [plain], 4)
    np.testing.assert_allclose(mixed["plain"], alone["plain"], rtol=1e-4, atol=1e-4)
    skipping_alone, _ = generate(skipping_from("tiny-sd", 0.0), tiny_family, "tiny-sd", [skipper], 4)
    np.testing.assert_allclose(mixed["skipper"], skipping_alone["skipper"], rtol=1e-4, atol=1e-4)


def test_a_quality_the_curve_never_meets_never_skips(tiny_family):
    spec = make_spec("r", steps=4, seed=3)
    strict, states = generate(skipping_from("tiny-sd", 0.0, quality=0.99), tiny_family, "tiny-sd", [spec], 4)
    assert states == {}  # no state: every step exact
    exact, _ = generate(StepRunner("w1", {}), tiny_family, "tiny-sd", [spec], 4)
    np.testing.assert_array_equal(strict["r"], exact["r"])


def test_requests_without_cfg_and_unnamed_models_get_no_state(tiny_family):
    runner = skipping_from("other-model", 0.0)
    _, states = generate(runner, tiny_family, "tiny-sd", [make_spec("r", steps=2)], 2)
    assert states == {}
    _, states = generate(skipping_from("tiny-sd", 0.0), tiny_family, "tiny-sd",
                         [dataclasses.replace(make_spec("u", steps=2), cfg=False)], 2)
    assert states == {}


def test_the_mode_is_there_only_when_configured():
    assert ModeName.SKIP_CFG not in StepRunner("w0", {}).modes
    assert ModeName.SKIP_CFG in skipping_from("tiny-sd", 0.5).modes


def test_quality_is_a_similarity():
    with pytest.raises(ValueError, match="quality"):
        SkipCfg(SkipCfgCurve(((0.5, 0.95),)), 0.0)
