"""ControlNet and LoRA requests served in a mixed continuous batch equal the diffusers pipelines
alone: `StableDiffusion(XL)ControlNetPipeline` (one ControlNet, or three as a
`MultiControlNetModel`) and the plain pipeline with `load_lora_weights` + `fuse_lora`."""

import dataclasses
import math

import numpy as np
import pytest
import torch

from stepserve.actors.controlnet_client import InProcessControlNets
from stepserve.deployments.controlnet_service import ControlNetService
from stepserve.engine.addons.controlnet import control_pixels, control_tensor
from stepserve.engine.addons.lora import load_lora_file
from stepserve.engine.addons.presets import preset_controlnet
from stepserve.engine.addons.source import AddonKind, AddonSource
from stepserve.engine.families import ALL_PARTS, load_family
from stepserve.engine.sampler import Conditioning
from stepserve.engine.mode_settings import ModeSettings
from stepserve.engine.step_runner import Admission, StepRunner
from stepserve.load_tests.fidelity import psnr
from stepserve.policies.types import ControlNetUse, LoraUse, StepGroup, WorkerPlan

from tests.addons import CONTROLNETS, reference_image, write_preset_loras
from tests.tiny import TINY, TINY_SDXL, conditioning_for, control_image, make_spec, run_continuous_batch

# As the plain golden tests (fp32 CPU, batching changes GEMM blocking only), also for LoRAs,
# whose update is added to a layer's output here and merged into its weight by `fuse_lora`.
ATOL = 2e-5
IMAGES = {name: control_image(seed) for name, seed in CONTROLNETS.items()}


@pytest.fixture(scope="module", params=[TINY, TINY_SDXL], ids=["sd15", "sdxl"])
def served(request, tmp_path_factory):
    """A family serving the preset add-ons (its LoRAs read from files, as a server reads them),
    and those files' folders."""
    source = request.param
    family = load_family(source, ALL_PARTS, "cpu")
    for name, seed in CONTROLNETS.items():
        family.add_controlnet(name, preset_controlnet(source.family, source.preset, seed))
    folders = write_preset_loras(source, tmp_path_factory.mktemp("loras"))
    for name, folder in folders.items():
        family.add_lora(load_lora_file(name, folder))
    return family, folders


def admission(family, spec) -> Admission:
    text = conditioning_for(family, spec)
    control = tuple(control_tensor(control_pixels(IMAGES[use.name], spec.height, spec.width))
                    for use in spec.controlnets)
    return Admission(spec, conditioning=Conditioning(text.prompt, text.negative, control))


def test_controlnet_and_lora_requests_in_a_mixed_batch_equal_their_pipelines(served):
    family, folders = served

    def spec(rid, steps, seed, **addons):
        return dataclasses.replace(make_spec(rid, steps=steps, seed=seed, model=family.source.name,
                                             negative="blurry"), **addons)

    one_cn = spec("one-cn", 6, 1, controlnets=(ControlNetUse("canny", 0.8),))
    three_cn = spec("three-cn", 8, 2, controlnets=(
        ControlNetUse("depth", 1.0), ControlNetUse("canny", 0.5, start=0.25), ControlNetUse("pose", 1.2, end=0.6)))
    lora = spec("lora", 6, 3, loras=(LoraUse("papercut", 0.9),))
    two_loras = spec("two-loras", 5, 4, loras=(LoraUse("ink", 1.0), LoraUse("papercut", 0.5)))
    both = spec("both", 4, 5, controlnets=(ControlNetUse("pose", 0.7),), loras=(LoraUse("ink", -0.6),))
    plain = spec("plain", 7, 6)
    arrivals = {0: [plain, three_cn], 1: [lora, both], 2: [one_cn, two_loras]}
    latents = run_continuous_batch(family, arrivals, admit=lambda s: admission(family, s))

    for s in (plain, one_cn, three_cn, lora, two_loras, both):
        served_image = family.decode(torch.from_numpy(latents[s.request_id]))[0]
        expected = reference_image(family.source, s, IMAGES, folders)
        np.testing.assert_allclose(served_image, expected, atol=ATOL, err_msg=s.request_id)
        if s is not plain:  # the add-ons change the image: the comparison can fail
            without = reference_image(family.source, dataclasses.replace(s, controlnets=(), loras=()), IMAGES, {})
            assert np.abs(expected - without).max() > 0.01, s.request_id


def test_controlnets_served_by_the_service_while_the_unet_runs_equal_their_pipelines(served):
    family, folders = served
    sources = [AddonSource(AddonKind.CONTROLNET, name, family.source.name, preset=family.source.preset, seed=seed)
               for name, seed in CONTROLNETS.items()]
    family.controlnet_service = InProcessControlNets(ControlNetService(sources, [family.source], "cpu", cache_size=2))
    try:
        three_cn = dataclasses.replace(
            make_spec("three", steps=5, seed=7, model=family.source.name), loras=(LoraUse("papercut", 0.5),),
            controlnets=(ControlNetUse("pose", 0.9), ControlNetUse("canny", 1.1, end=0.7), ControlNetUse("depth")))
        one_cn = dataclasses.replace(make_spec("one", steps=4, seed=8, model=family.source.name),
                                     controlnets=(ControlNetUse("canny", 0.6, start=0.2),))
        plain = make_spec("plain", steps=6, seed=9, model=family.source.name)
        latents = run_continuous_batch(family, {0: [plain, three_cn], 1: [one_cn]},
                                       admit=lambda s: admission(family, s))
    finally:
        family.controlnet_service = None
    for s in (plain, three_cn, one_cn):
        served_image = family.decode(torch.from_numpy(latents[s.request_id]))[0]
        np.testing.assert_allclose(served_image, reference_image(family.source, s, IMAGES, folders), atol=ATOL,
                                   err_msg=s.request_id)


def test_one_step_stale_controlnets_stay_close_to_exact_and_survive_a_move(served):
    """Stale residuals change the image a little (the approximation is real) and far less than
    leaving the ControlNets out; a request moved mid-way waits once for fresh residuals."""
    family, _ = served
    sources = [AddonSource(AddonKind.CONTROLNET, name, family.source.name, preset=family.source.preset, seed=seed)
               for name, seed in CONTROLNETS.items()]
    spec = dataclasses.replace(make_spec("s", steps=6, seed=3, model=family.source.name),
                               controlnets=(ControlNetUse("depth", 1.0), ControlNetUse("pose", 0.8, start=0.3)))
    family.controlnet_service = InProcessControlNets(ControlNetService(sources, [family.source], "cpu"))
    try:
        exact = run_continuous_batch(family, {0: [spec]}, admit=lambda s: admission(family, s))["s"]
        stale = run_continuous_batch(family, {0: [spec]}, admit=lambda s: admission(family, s),
                                     modes=ModeSettings(stale_controlnets=True))["s"]
        runner = StepRunner("w0", {family.source.name: family}, modes=ModeSettings(stale_controlnets=True))
        step = (StepGroup(("s",)),)
        runner.execute(WorkerPlan("w0", admit=("s",), groups=step), {"s": admission(family, spec)})
        runner.execute(WorkerPlan("w0", groups=step), {})
        _, (state,) = runner.execute(WorkerPlan("w0", groups=step, export=("s",)), {})
        other = StepRunner("w1", {family.source.name: family}, modes=ModeSettings(stale_controlnets=True))
        other.execute(WorkerPlan("w1", admit=("s",), groups=step), {"s": Admission(spec, state=state)})
        other.execute(WorkerPlan("w1", groups=step), {})
        report, (moved,) = other.execute(WorkerPlan("w1", groups=step, finish=("s",)), {})
        assert not report.failed and state["step_index"] == 3
    finally:
        family.controlnet_service = None
    without = reference_image(family.source, dataclasses.replace(spec, controlnets=()), IMAGES, {})
    images = {k: family.decode(torch.from_numpy(v))[0] for k, v in (("exact", exact), ("stale", stale),
                                                                    ("moved", moved))}
    assert 35 < psnr(images["stale"], images["exact"]) < math.inf
    assert psnr(images["stale"], images["exact"]) > psnr(without, images["exact"]) + 5
    assert 35 < psnr(images["moved"], images["exact"]) < math.inf
