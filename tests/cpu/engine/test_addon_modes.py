"""The add-on-mode interface (`engine.addon_modes`): which modes a runner has, which families
serve them, and a request's add-on state, held beside its forward mode's."""

import dataclasses

import pytest
import torch

from stepserve.engine.addon_modes.base import AddonModeName
from stepserve.engine.addon_modes.registry import addon_modes
from stepserve.engine.addons.controlnet import RemoteControlNets, StaleResiduals, control_tensor
from stepserve.engine.families import ALL_PARTS, DENOISER, ModelSource, load_family
from stepserve.engine.forward_modes.base import ModeName
from stepserve.engine.sampler import Conditioning
from stepserve.engine.mode_settings import ModeSettings
from stepserve.engine.step_runner import Admission, StepRunner
from stepserve.policies.types import ControlNetUse, WorkerPlan

from tests.tiny import TINY, conditioning_for, make_spec


@pytest.fixture(scope="module")
def served():
    """A family whose ControlNets run as a service (never called here: nothing steps)."""
    return load_family(TINY, ALL_PARTS, "cpu", RemoteControlNets(object()))


def admitted(runner, family, spec):
    text = conditioning_for(family, spec)
    control = tuple(control_tensor(torch.zeros(spec.height, spec.width, 3, dtype=torch.uint8).numpy())
                    for _ in spec.controlnets)
    report, _ = runner.execute(WorkerPlan("w0", admit=(spec.request_id,)),
                               {spec.request_id: Admission(spec, Conditioning(text.prompt, text.negative, control))})
    assert not report.failed, report.failed
    return runner.samplers[spec.request_id]


def test_lora_joining_is_always_there_and_stale_controlnets_only_when_set():
    assert list(addon_modes()) == [AddonModeName.LORA_JOINING]
    stale = ModeSettings(stale_controlnets=True)
    assert list(addon_modes(stale)) == [AddonModeName.LORA_JOINING, AddonModeName.STALE_CONTROLNET]


def test_stale_controlnets_are_served_only_where_a_service_runs_them(served):
    stale = addon_modes(ModeSettings(stale_controlnets=True))[AddonModeName.STALE_CONTROLNET]
    assert stale.serves(served)
    assert not stale.serves(load_family(TINY, {DENOISER}, "cpu"))  # its ControlNets run on the worker
    assert not stale.serves(load_family(ModelSource("tiny-wan", "wan", preset="tiny"), {DENOISER}, "cpu"))


def test_a_request_holds_its_forward_modes_state_and_its_add_on_modes_state(served):
    spec = dataclasses.replace(make_spec("r", steps=4, seed=1, model=served.source.name), step_cache=0.1,
                               controlnets=(ControlNetUse("canny", 1.0), ControlNetUse("depth", 0.5, start=0.5)))
    sampler = admitted(StepRunner("w0", {served.source.name: served},
                                  modes=ModeSettings(stale_controlnets=True)), served, spec)
    assert sampler.mode is ModeName.STEP_CACHE
    holders = sampler.addon_state[AddonModeName.STALE_CONTROLNET]
    assert len(holders) == 2 and all(isinstance(h, StaleResiduals) for h in holders)

    exact = admitted(StepRunner("w1", {served.source.name: served}), served, spec)
    assert exact.addon_state == {}  # switched off: its ControlNets are exact
    assert all(use.stale is None for use in exact.addons(0).controls)


def test_a_stale_controlnet_brings_its_holder_and_drops_it_while_off(served):
    spec = dataclasses.replace(make_spec("r", steps=4, seed=1, model=served.source.name),
                               controlnets=(ControlNetUse("canny", 1.0), ControlNetUse("depth", 0.5, start=0.5)))
    runner = StepRunner("w0", {served.source.name: served}, modes=ModeSettings(stale_controlnets=True))
    sampler = admitted(runner, served, spec)
    on, off = sampler.addon_state[AddonModeName.STALE_CONTROLNET]
    on.ready = off.ready = ([], torch.zeros(1))
    adjusted = runner.addon_modes[AddonModeName.STALE_CONTROLNET].adjust(sampler, sampler.addons(2))
    assert [use.stale for use in adjusted.controls] == [on, off]
    assert [use.rows for use in adjusted.controls] == [slice(2, 4)] * 2  # its rows, from the forward's row 2
    # Off at step 0 (it starts halfway): what it held would be more than one step old when it is on again.
    assert on.ready is not None and off.ready is None
