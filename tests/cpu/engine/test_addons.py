"""Add-on plumbing: what a request may name, what a worker refuses, and a ControlNet request
moved between workers mid-way."""

import dataclasses
import pickle
import re

import numpy as np
import pytest
import safetensors.torch
import torch

from stepserve.engine.addons.controlnet import control_pixels, control_tensor
from stepserve.engine.addons.lora import load_lora_file
from stepserve.engine.addons.presets import preset_controlnet, preset_lora, save_lora_file
from stepserve.engine.addons.source import AddonKind, AddonSource, LoraJoinBounds
from stepserve.engine.families import ALL_PARTS, DENOISER, load_family
from stepserve.engine.sampler import Conditioning, Sampler
from stepserve.engine.mode_settings import ModeSettings
from stepserve.engine.step_runner import Admission, StepRunner
from stepserve.policies.types import ControlNetUse, LoraUse, StepGroup, WorkerPlan

from tests.tiny import TINY, conditioning_for, control_image, make_spec


@pytest.fixture(scope="module")
def family():
    family = load_family(TINY, ALL_PARTS, "cpu")
    family.add_controlnet("canny", preset_controlnet("sd15", "tiny", 1))
    family.add_lora(preset_lora("papercut", family.denoiser, 11))
    return family


def with_control(family, spec, size=64) -> Conditioning:
    text = conditioning_for(family, spec)
    image = control_tensor(control_pixels(control_image(1, size), size, size))
    return Conditioning(text.prompt, text.negative, (image,) * len(spec.controlnets))


def test_controlnet_scale_follows_the_pipelines_keep_rule():
    use = ControlNetUse("canny", 0.5, start=0.25, end=0.75)
    assert [use.scale_at(i, 8) for i in range(8)] == [0.0, 0.0, 0.5, 0.5, 0.5, 0.5, 0.0, 0.0]
    with pytest.raises(ValueError, match="start < end"):
        ControlNetUse("canny", start=0.5, end=0.5)


def test_a_lora_named_twice_is_refused():
    with pytest.raises(ValueError, match="named twice"):
        dataclasses.replace(make_spec("r"), loras=(LoraUse("a"), LoraUse("a", 0.5)))


@pytest.mark.parametrize("change, message", [
    (dict(controlnets=(ControlNetUse("scribble"),)), r"ControlNet \['scribble'\] not loaded"),
    (dict(loras=(LoraUse("watercolor"),)), r"LoRA \['watercolor'\] not loaded"),
])
def test_an_unknown_addon_fails_only_its_own_admission(family, change, message):
    bad = dataclasses.replace(make_spec("bad"), **change)
    good = make_spec("good")
    runner = StepRunner("w0", {family.source.name: family})
    admissions = {"bad": Admission(bad, conditioning=with_control(family, bad)),
                  "good": Admission(good, conditioning=conditioning_for(family, good))}
    report, _ = runner.execute(WorkerPlan("w0", admit=("bad", "good"), groups=(StepGroup(("bad", "good")),)),
                               admissions)
    assert [f.request_id for f in report.failed] == ["bad"]
    assert report.failed[0].message.startswith("admission failed")
    assert re.search(message, report.failed[0].message)
    assert runner.resident == ("good",)


def test_a_control_image_of_the_wrong_size_or_count_is_refused(family):
    spec = dataclasses.replace(make_spec("r"), controlnets=(ControlNetUse("canny"),))
    with pytest.raises(ValueError, match=r"not \(1, 3, 64, 64\)"):
        Sampler(spec, family, with_control(family, spec, size=32))
    text = conditioning_for(family, spec)
    with pytest.raises(ValueError, match="1 ControlNets but 0 control images"):
        Sampler(spec, family, text)


def test_a_family_without_addons_refuses_them(tiny_sd3):
    spec = dataclasses.replace(make_spec("r", model="tiny-sd3"), loras=(LoraUse("papercut"),))
    with pytest.raises(ValueError, match="takes no ControlNets or LoRAs"):
        Sampler(spec, tiny_sd3, conditioning_for(tiny_sd3, spec))


def test_a_controlnet_request_moved_mid_way_equals_an_unmoved_one(family):
    spec = dataclasses.replace(make_spec("r", steps=4, seed=3), controlnets=(ControlNetUse("canny", 0.7, end=0.6),),
                               loras=(LoraUse("papercut", 0.8),))
    models = {family.source.name: family}
    step = (StepGroup(("r",)),)
    whole = StepRunner("w0", models)
    whole.execute(WorkerPlan("w0", admit=("r",), groups=step), {"r": Admission(spec, with_control(family, spec))})
    whole.execute(WorkerPlan("w0", groups=step), {})
    whole.execute(WorkerPlan("w0", groups=step), {})
    _, (expected,) = whole.execute(WorkerPlan("w0", groups=step, finish=("r",)), {})

    first, second = StepRunner("w1", models), StepRunner("w2", models)
    first.execute(WorkerPlan("w1", admit=("r",), groups=step), {"r": Admission(spec, with_control(family, spec))})
    _, (state,) = first.execute(WorkerPlan("w1", groups=step, export=("r",)), {})
    second.execute(WorkerPlan("w2", admit=("r",), groups=step), {"r": Admission(spec, state=pickle.loads(
        pickle.dumps(state)))})
    _, (moved,) = second.execute(WorkerPlan("w2", groups=step, finish=("r",)), {})
    np.testing.assert_array_equal(moved, expected)


def test_lora_files_are_safetensors_of_the_denoiser_only(tmp_path):
    denoiser = load_family(TINY, {DENOISER}, "cpu").denoiser
    lora = preset_lora("p", denoiser, 1)
    path = save_lora_file(lora, str(tmp_path / "ok"))
    assert load_lora_file("p", path).layers.keys() == lora.layers.keys()  # a file, or its folder
    with pytest.raises(FileNotFoundError):
        load_lora_file("p", str(tmp_path / "missing"))
    pickled = tmp_path / "lora.bin"
    pickled.write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="only .safetensors"):
        load_lora_file("p", str(pickled))
    text_encoder = tmp_path / "te" / "pytorch_lora_weights.safetensors"
    text_encoder.parent.mkdir()
    tensors = safetensors.torch.load_file(path)
    tensors["text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight"] = torch.zeros(4, 32)
    tensors["text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_B.weight"] = torch.zeros(32, 4)
    safetensors.torch.save_file(tensors, str(text_encoder))
    with pytest.raises(ValueError, match="only denoiser LoRAs"):
        load_lora_file("p", str(text_encoder))


class ArrivingLoras:
    """A `LoraLoader` test double (the real one, over the LoRA store, runs in the live tests):
    each LoRA arrives `after` polls after it was requested; `wait` brings it at once."""

    def __init__(self, families, loras, after: int):
        self.families, self.loras, self.after = families, loras, after
        self.coming: dict[tuple[str, str], int] = {}
        self.waited: list[str] = []
        self.trimmed: list[set] = []

    def request(self, model, name):
        self.coming.setdefault((model, name), self.after)

    def poll(self):
        for key in list(self.coming):
            self.coming[key] -= 1
            if self.coming[key] < 0:
                self._install(key)

    def wait(self, model, name):
        self.waited.append(name)
        self._install((model, name))

    def trim(self, keep):
        self.trimmed.append(keep)

    def _install(self, key):
        del self.coming[key]
        self.families[key[0]].add_lora(self.loras[key[1]])


@pytest.fixture
def bare_family():
    """A family holding no LoRA: the loader brings them."""
    return load_family(TINY, ALL_PARTS, "cpu")


def run_alone(runner, spec, steps):
    step = (StepGroup((spec.request_id,)),)
    runner.execute(WorkerPlan("w0", admit=(spec.request_id,), groups=step),
                   {spec.request_id: Admission(spec, conditioning_for(runner.families[spec.model], spec))})
    for _ in range(steps - 2):
        runner.execute(WorkerPlan("w0", groups=step), {})
    report, (latents,) = runner.execute(WorkerPlan("w0", groups=step, finish=(spec.request_id,)), {})
    assert not report.failed, report.failed
    return latents


def test_exact_lora_loading_waits_for_the_lora_before_the_first_step(family, bare_family):
    spec = dataclasses.replace(make_spec("r", steps=4, seed=5), loras=(LoraUse("papercut", 0.8),))
    loader = ArrivingLoras({bare_family.source.name: bare_family}, family.loras, after=10)
    late = StepRunner("w0", {bare_family.source.name: bare_family},
                      modes=ModeSettings(loras=loader, lora_bounds=LoraJoinBounds(0.0)))
    exact = StepRunner("w1", {family.source.name: family})
    np.testing.assert_array_equal(run_alone(late, spec, 4), run_alone(exact, spec, 4))
    assert loader.waited == ["papercut"]
    assert loader.trimmed[-1] == set()  # nothing resident holds it any more


def test_a_late_lora_joins_when_it_arrives_and_by_its_deadline_at_the_latest(family, bare_family):
    spec = dataclasses.replace(make_spec("r", steps=8, seed=5), loras=(LoraUse("papercut", 0.8),))
    families = {bare_family.source.name: bare_family}
    arrives = StepRunner("w0", families,
                         modes=ModeSettings(loras=ArrivingLoras(families, family.loras, after=2),
                                            lora_bounds=LoraJoinBounds(0.5)))
    step = (StepGroup(("r",)),)
    arrives.execute(WorkerPlan("w0", admit=("r",), groups=step), {"r": Admission(spec, conditioning_for(
        bare_family, spec))})
    for _ in range(3):
        arrives.execute(WorkerPlan("w0", groups=step), {})
    assert arrives.samplers["r"].loras_joined == {"papercut": 2}  # arrived on the third poll

    bare_family.remove_lora("papercut")
    slow = ArrivingLoras(families, family.loras, after=100)
    bounded = StepRunner("w1", families, modes=ModeSettings(loras=slow, lora_bounds=LoraJoinBounds(0.5)))
    late = run_alone(bounded, dataclasses.replace(spec, request_id="s"), 8)
    assert slow.waited == ["papercut"]  # it had not come by step 4 of 8: the step waited for it
    exact = run_alone(StepRunner("w2", {family.source.name: family}), spec, 8)
    without = run_alone(StepRunner("w3", {family.source.name: family}), dataclasses.replace(spec, loras=()), 8)
    # Joining at step 4 of 8 gives an image between none and exact, and not equal to either.
    assert 0 < np.abs(late - exact).max() < np.abs(without - exact).max()


def test_each_lora_joins_by_its_own_bound(family, bare_family):
    """A LoRA profiled as unable to join late (its own bound 0) applies from the first step, exactly,
    under a pool default that lets others join halfway."""
    spec = dataclasses.replace(make_spec("r", steps=4, seed=5), loras=(LoraUse("papercut", 0.8),))
    families = {bare_family.source.name: bare_family}
    slow = ArrivingLoras(families, family.loras, after=100)
    own = LoraJoinBounds(0.5, {(bare_family.source.name, "papercut"): 0.0})
    assert own.bound(bare_family.source.name, "papercut") == 0.0 and own.bound(bare_family.source.name, "ink") == 0.5
    assert own.tightest(bare_family.source.name, ["ink", "papercut"]) == 0.0
    runner = StepRunner("w0", families, modes=ModeSettings(loras=slow, lora_bounds=own))
    exact = run_alone(StepRunner("w1", {family.source.name: family}), spec, 4)
    np.testing.assert_array_equal(run_alone(runner, spec, 4), exact)
    assert slow.waited == ["papercut"]


def test_a_join_bound_is_a_loras_own():
    with pytest.raises(ValueError, match="join_by is a LoRA's"):
        AddonSource(AddonKind.CONTROLNET, "canny", "m", preset="tiny", join_by=0.2)
    with pytest.raises(ValueError, match="in \\[0, 1\\)"):
        AddonSource(AddonKind.LORA, "papercut", "m", preset="tiny", join_by=1.0)
    sources = [AddonSource(AddonKind.LORA, "papercut", "m", preset="tiny", join_by=0.25),
               AddonSource(AddonKind.LORA, "ink", "m", preset="tiny")]
    assert LoraJoinBounds.of(sources, 0.1) == LoraJoinBounds(0.1, {("m", "papercut"): 0.25})
