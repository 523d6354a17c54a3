"""ControlNet and LoRA requests served in a mixed continuous batch equal the diffusers pipelines
alone: `StableDiffusion(XL)ControlNetPipeline` (one ControlNet, or three as a
`MultiControlNetModel`) and the plain pipeline with `load_lora_weights` + `fuse_lora`."""

import dataclasses

import numpy as np
import PIL.Image
import pytest
import torch
from diffusers import (
    MultiControlNetModel, StableDiffusionControlNetPipeline, StableDiffusionXLControlNetPipeline,
)

from stepserve.engine.addons.controlnet import prepare_control_image
from stepserve.engine.addons.lora import load_lora_file
from stepserve.engine.addons.presets import preset_controlnet, preset_lora, save_lora_file
from stepserve.engine.families import ALL_PARTS, load_family
from stepserve.engine.sampler import Conditioning
from stepserve.engine.step_runner import Admission
from stepserve.policies.types import ControlNetUse, LoraUse

from tests.tiny import (
    TINY, TINY_SDXL, conditioning_for, control_image, make_spec, run_continuous_batch, solo_pipeline_image,
)

# As the plain golden tests (fp32 CPU, batching changes GEMM blocking only), also for LoRAs,
# whose update is added to a layer's output here and merged into its weight by `fuse_lora`.
ATOL = 2e-5
CONTROLNETS = {"canny": 1, "depth": 2, "pose": 3}  # name: preset seed
LORAS = {"papercut": 11, "ink": 12}


@dataclasses.dataclass
class Served:
    """A family serving the preset add-ons, the folder of their LoRA files, and a second copy of
    the family for diffusers' LoRA loading (which rewrites the UNet it is given)."""

    family: object
    reference: object
    lora_folders: dict


@pytest.fixture(scope="module", params=[TINY, TINY_SDXL], ids=["sd15", "sdxl"])
def served(request, tmp_path_factory):
    source = request.param
    family = load_family(source, ALL_PARTS, "cpu")
    for name, seed in CONTROLNETS.items():
        family.add_controlnet(name, preset_controlnet(source.family, source.preset, seed))
    folders = {}
    for name, seed in LORAS.items():
        folder = tmp_path_factory.mktemp(name)
        save_lora_file(preset_lora(name, family.denoiser, seed), str(folder))
        family.add_lora(load_lora_file(name, str(folder)))  # through the file, as a server reads it
        folders[name] = str(folder)
    return Served(family, load_family(source, ALL_PARTS, "cpu"), folders)


def admission(family, spec, images: dict[str, PIL.Image.Image]) -> Admission:
    text = conditioning_for(family, spec)
    control = tuple(prepare_control_image(images[use.name], spec.height, spec.width, family.vae_scale_factor)
                    for use in spec.controlnets)
    return Admission(spec, conditioning=Conditioning(text.prompt, text.negative,
                                                     tuple(torch.from_numpy(c) for c in control)))


def controlnet_reference(family, spec, images) -> np.ndarray:
    nets = [family.controlnets[use.name] for use in spec.controlnets]
    pipeline_cls = StableDiffusionXLControlNetPipeline if family.source.family == "sdxl" \
        else StableDiffusionControlNetPipeline
    components = {k: v for k, v in family.pipe.components.items() if k in pipeline_cls._get_signature_keys(
        pipeline_cls)[0] or k in ("safety_checker", "feature_extractor")}
    multi = len(nets) > 1
    pipe = pipeline_cls(**{**components, "controlnet": MultiControlNetModel(nets) if multi else nets[0]},
                        **({} if family.source.family == "sdxl" else {"requires_safety_checker": False}))
    pipe.set_progress_bar_config(disable=True)
    uses = spec.controlnets
    one = (lambda xs: xs) if multi else (lambda xs: xs[0])
    with torch.inference_mode():
        return pipe(
            spec.prompt, negative_prompt=spec.negative_prompt or None, height=spec.height, width=spec.width,
            image=one([images[u.name] for u in uses]), num_inference_steps=spec.num_inference_steps,
            guidance_scale=spec.guidance_scale, generator=torch.Generator("cpu").manual_seed(spec.seed),
            controlnet_conditioning_scale=one([u.conditioning_scale for u in uses]),
            control_guidance_start=one([u.start for u in uses]), control_guidance_end=one([u.end for u in uses]),
            output_type="np",
        ).images[0]


def lora_reference(served: Served, spec) -> np.ndarray:
    pipe = served.reference.pipe
    names = [use.name for use in spec.loras]
    for name in names:
        pipe.load_lora_weights(served.lora_folders[name], adapter_name=name)
    pipe.set_adapters(names, adapter_weights=[use.scale for use in spec.loras])
    pipe.fuse_lora(adapter_names=names)
    try:
        return solo_pipeline_image(served.reference, spec)
    finally:
        pipe.unfuse_lora()
        pipe.unload_lora_weights()


def test_controlnet_and_lora_requests_in_a_mixed_batch_equal_their_pipelines(served):
    family = served.family
    spec = lambda rid, **kw: dataclasses.replace(  # noqa: E731
        make_spec(rid, model=family.source.name, negative="blurry", **{k: kw.pop(k) for k in ("steps", "seed")
                                                                       if k in kw}), **kw)
    images = {"canny": control_image(1), "depth": control_image(2), "pose": control_image(3)}
    one_cn = spec("one-cn", steps=6, seed=1, controlnets=(ControlNetUse("canny", 0.8),))
    three_cn = spec("three-cn", steps=8, seed=2, controlnets=(
        ControlNetUse("depth", 1.0), ControlNetUse("canny", 0.5, start=0.25), ControlNetUse("pose", 1.2, end=0.6)))
    lora = spec("lora", steps=6, seed=3, loras=(LoraUse("papercut", 0.9),))
    two_loras = spec("two-loras", steps=5, seed=4, loras=(LoraUse("ink", 1.0), LoraUse("papercut", 0.5)))
    plain = spec("plain", steps=7, seed=5)
    arrivals = {0: [plain, three_cn], 1: [lora], 2: [one_cn, two_loras]}
    latents = run_continuous_batch(family, arrivals, admit=lambda s: admission(family, s, images))

    def image(s):
        return family.decode(torch.from_numpy(latents[s.request_id]))[0]

    np.testing.assert_allclose(image(plain), solo_pipeline_image(family, plain), atol=ATOL)
    for s in (one_cn, three_cn):
        expected = controlnet_reference(family, s, images)
        np.testing.assert_allclose(image(s), expected, atol=ATOL, err_msg=s.request_id)
        assert np.abs(expected - solo_pipeline_image(family, dataclasses.replace(s, controlnets=()))).max() > 0.01
    for s in (lora, two_loras):
        expected = lora_reference(served, s)
        np.testing.assert_allclose(image(s), expected, atol=ATOL, err_msg=s.request_id)
        assert np.abs(expected - solo_pipeline_image(family, dataclasses.replace(s, loras=()))).max() > 0.01
