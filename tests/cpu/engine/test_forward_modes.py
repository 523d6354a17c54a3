"""The forward-mode interface (`engine.forward_modes`): which modes a runner has and in what
order, what a family that declares a mode must have, and a request's mode state: at most one,
dropped where its mode says a step elsewhere spoils it."""

import pytest

from stepserve.actors.activation_cache import ActivationCache
from stepserve.engine.editing.masked_sd3 import CacheKind
from stepserve.engine.families import FAMILIES
from stepserve.engine.forward_modes.base import ModeName
from stepserve.engine.forward_modes.registry import forward_modes
from stepserve.engine.mode_settings import ModeSettings
from stepserve.engine.step_runner import StepRunner
from stepserve.engine.template_edits import TemplateCache
from stepserve.policies.types import StepGroup, WorkerPlan

from tests.cpu.engine.test_edit_golden import edit_admission, edit_spec
from tests.cpu.engine.test_template_edits import templated

# What each mode calls on a family that declares it.
NEEDS = {
    ModeName.PACKED: ("packs", "denoise_mixed"),
    ModeName.TEMPLATE_EDIT: ("patch_size", "cache_slots", "denoise_recording", "denoise_masked", "dit_dims"),
    ModeName.PATCH_CACHE: ("denoise_patch_cached",),
    ModeName.STEP_CACHE: ("denoise_first_block_cached",),
}


def test_exact_modes_are_always_there_and_approximations_only_when_set():
    # Step caching and skip-CFG too: they come with the request.
    assert list(forward_modes()) == [ModeName.PACKED, ModeName.CFG_SPLIT, ModeName.STEP_CACHE, ModeName.SKIP_CFG,
                                     ModeName.PLAIN]
    templates = TemplateCache(ActivationCache(memory_bytes=1 << 20))
    modes = forward_modes(ModeSettings(templates=templates, patch_reuse={"m": object()}, pack_resolutions=True))
    # The plain forward last: it takes every group; a template edit's state before the patch cache's.
    assert list(modes) == [ModeName.PACKED, ModeName.CFG_SPLIT, ModeName.TEMPLATE_EDIT, ModeName.PATCH_CACHE,
                           ModeName.STEP_CACHE, ModeName.SKIP_CFG, ModeName.PLAIN]
    assert modes[ModeName.PACKED].join and not forward_modes()[ModeName.PACKED].join


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_family_has_what_its_declared_modes_call(name):
    family = FAMILIES[name]
    assert family.forward_modes <= set(NEEDS)  # the plain forward and the CFG split need no declaring
    for mode in family.forward_modes:
        assert all(hasattr(family, attribute) for attribute in NEEDS[mode]), (name, mode)


def test_a_request_holds_one_modes_state(tiny_sd3):
    spec, inputs = edit_spec(tiny_sd3, "a", seed=1, size=64)
    runner = StepRunner("w0", {tiny_sd3.source.name: tiny_sd3},
                        modes=ModeSettings(templates=TemplateCache(ActivationCache(memory_bytes=64 << 20),
                                                                   CacheKind.OUTPUTS),
                                           patch_reuse={tiny_sd3.source.name: object()}))
    admission = edit_admission(tiny_sd3, templated(spec), inputs)
    runner.execute(WorkerPlan("w0", admit=("a",)), {"a": admission})
    sampler = runner.samplers["a"]
    assert sampler.mode is ModeName.TEMPLATE_EDIT  # the earlier mode gave it state; the patch cache did not
    with pytest.raises(ValueError, match="already holds"):
        sampler.enter(ModeName.PATCH_CACHE, None)


def test_a_template_edit_stepped_beside_a_plain_edit_leaves_its_mode(tiny_sd3):
    """Its record would miss that step, so it records nothing (and the store gets nothing)."""
    store = ActivationCache(memory_bytes=64 << 20)
    runner = StepRunner("w0", {tiny_sd3.source.name: tiny_sd3},
                        modes=ModeSettings(templates=TemplateCache(store, CacheKind.OUTPUTS)))
    (b, b_in), (d, d_in) = edit_spec(tiny_sd3, "b", seed=2, size=64), edit_spec(tiny_sd3, "d", seed=4, size=64)
    admissions = {"b": edit_admission(tiny_sd3, templated(b), b_in), "d": edit_admission(tiny_sd3, d, d_in)}
    report, _ = runner.execute(WorkerPlan("w0", admit=("b", "d"), groups=(StepGroup(("b",)),)), admissions)
    assert not report.failed and runner.samplers["b"].mode is ModeName.TEMPLATE_EDIT
    assert runner.samplers["b"].mode_state.recorded  # its own step recorded
    report, _ = runner.execute(WorkerPlan("w0", groups=(StepGroup(("b", "d")),), plan_id=1), {})
    assert not report.failed and runner.samplers["b"].mode is None and runner.samplers["d"].mode is None
