"""The patch cache as a worker serves it (`patch_cache.enabled`): the runner gives each admitted
SD3 request its own cache and steps plain groups through `denoise_patch_cached` with the model's
calibrated `PatchReuse`. A predictor that never reuses is the exact generation; one that always
reuses is not, and counts its reuses; requests with a patch cache are not packed with other
sizes; the calibration a worker runs at startup is deterministic; the config turns it all on."""

import math

import numpy as np
import pytest

from stepserve.actors.denoiser import worker_parts
from stepserve.deployments.config import PatchCacheConfig
from stepserve.engine.families import TEXT
from stepserve.engine.forward_modes.base import ModeName
from stepserve.engine.patch_cache.cached_sd3 import PatchReuse
from stepserve.engine.patch_cache.calibration import PatchCacheSpec, calibrate
from stepserve.engine.patch_cache.predictor import ReusePredictor
from stepserve.engine.mode_settings import ModeSettings
from stepserve.engine.step_runner import Admission, StepRunner
from stepserve.policies.types import StepGroup, WorkerPlan

from tests.tiny import TINY, TINY_SD3, admission_for, make_spec, run_together


def rule(family, bias: float) -> PatchReuse:
    return PatchReuse(ReusePredictor(0.0, 0.0, (bias,) * len(family.denoiser.transformer_blocks), 1e-3), side=2)


def generate(family, specs, reuse: PatchReuse | None, steps: int, groups=None):
    """`specs` admitted together and stepped to the end, one group each unless `groups` says:
    their patch caches and the finished latents by id."""
    runner = StepRunner("w0", {"tiny-sd3": family},
                        modes=ModeSettings(pack_resolutions=True,
                                           patch_reuse={} if reuse is None else {"tiny-sd3": reuse}))
    done, caches = run_together(runner, family, specs, steps, groups)
    return caches, done


def test_never_reusing_is_the_exact_generation_and_always_reusing_is_not(tiny_sd3):
    specs = [make_spec("a", steps=4, seed=1, size=64, model="tiny-sd3"),
             make_spec("b", steps=4, seed=2, size=64, model="tiny-sd3", prompt="a lighthouse")]
    _, exact = generate(tiny_sd3, specs, None, 4, groups=(StepGroup(("a", "b")),))
    caches, never = generate(tiny_sd3, specs, rule(tiny_sd3, -math.inf), 4, groups=(StepGroup(("a", "b")),))
    assert caches["a"] is not caches["b"] and caches["a"].rows == 2  # each request its own, CFG rows
    for rid in exact:
        np.testing.assert_array_equal(never[rid], exact[rid])
    caches, always = generate(tiny_sd3, specs, rule(tiny_sd3, math.inf), 4, groups=(StepGroup(("a", "b")),))
    assert all(int(cache.reused.sum()) > 0 for cache in caches.values())
    assert not np.array_equal(always["a"], exact["a"])


def test_requests_with_a_patch_cache_keep_their_own_size_forwards(tiny_sd3):
    specs = [make_spec("s", steps=2, size=64, model="tiny-sd3"), make_spec("l", steps=2, size=128, model="tiny-sd3")]
    caches, done = generate(tiny_sd3, specs, rule(tiny_sd3, -math.inf), 2)
    assert set(done) == {"s", "l"} and all(cache.steps == 2 for cache in caches.values())  # each its own forward


def test_the_startup_calibration_is_deterministic(tiny_sd3):
    spec = PatchCacheSpec(tolerance=3e-3, side=2, size=64, steps=4)
    first, second = calibrate(tiny_sd3, "tiny-sd3", spec), calibrate(tiny_sd3, "tiny-sd3", spec)
    assert first == second and (first.side, first.full_steps) == (2, 1)
    assert len(first.predictor.block_bias) == len(tiny_sd3.denoiser.transformer_blocks)


def test_the_config_switch_and_the_worker_parts():
    assert PatchCacheConfig().spec() is None  # off by default: every step exact
    assert PatchCacheConfig(enabled=True, tolerance=0.01).spec() == PatchCacheSpec(tolerance=0.01)
    with pytest.raises(ValueError):
        PatchCacheConfig(enabled=True, tolerance=0)
    assert TEXT in worker_parts(TINY_SD3, patch_cache=True)  # its calibration encodes prompts
    assert TEXT not in worker_parts(TINY_SD3) and TEXT not in worker_parts(TINY, patch_cache=True)


def test_a_request_resumed_elsewhere_starts_a_fresh_cache(tiny_sd3):
    spec = make_spec("m", steps=4, size=64, model="tiny-sd3")
    reuse = {"tiny-sd3": rule(tiny_sd3, math.inf)}
    first = StepRunner("w0", {"tiny-sd3": tiny_sd3}, modes=ModeSettings(patch_reuse=reuse))
    admission = admission_for(tiny_sd3, spec)
    _, (state,) = first.execute(WorkerPlan("w0", admit=("m",), groups=(StepGroup(("m",)),), export=("m",)),
                                {"m": admission})
    second = StepRunner("w1", {"tiny-sd3": tiny_sd3}, modes=ModeSettings(patch_reuse=reuse))
    report, _ = second.execute(WorkerPlan("w1", admit=("m",), groups=(StepGroup(("m",)),)),
                               {"m": Admission(spec, state=state)})
    assert not report.failed, report.failed
    cache = second.samplers["m"].mode_state
    # Its step there computed in full, then cached.
    assert second.samplers["m"].mode is ModeName.PATCH_CACHE and cache.steps == 1
