"""The shipped shapes models: they load through the same local-folder paths as real checkpoints,
and training from the recorded seed reproduces the first losses logged when they were trained."""

import json

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL, UNet2DConditionModel
from transformers import CLIPTextModel

from stepserve.engine.addons.source import AddonKind, AddonSource, load_addon
from stepserve.engine.editing.masked_sd3 import CacheKind
from stepserve.engine.families import ALL_PARTS, ModelSource, family_class
from stepserve.engine.shapes.dataset import Renders
from stepserve.engine.shapes.export import SHIPPED
from stepserve.engine.shapes.judge import Judge, prompt_accuracy
from stepserve.engine.shapes.training import Schedule, ShapesTraining, Sizes

SD = str(SHIPPED / "sd")
RECORD = json.loads((SHIPPED / "training.json").read_text())


def test_the_shipped_folders_load_as_a_served_model_with_its_addons():
    source = ModelSource(name="shapes", family="sd15", path=SD)
    family = family_class("sd15").load(source, ALL_PARTS, "cpu")
    assert family.vae_scale_factor == 8
    load_addon(AddonSource(AddonKind.CONTROLNET, "silhouette", "shapes", path=str(SHIPPED / "controlnet-silhouette")),
               family)
    load_addon(AddonSource(AddonKind.LORA, "outlined", "shapes", path=str(SHIPPED / "lora-outlined")), family)
    assert set(family.controlnets) == {"silhouette"} and set(family.loras) == {"outlined"}
    # Every caption word is one token of the shipped tokenizer.
    assert len(family.pipe.tokenizer.tokenize("a large purple triangle on an orange background, top left")) == 11


def test_the_judge_names_shape_and_colour_of_held_out_renders():
    judge = Judge.from_pretrained(str(SHIPPED / "judge"), use_safetensors=True)
    held_out = Renders(seed=4242, count=300)
    assert prompt_accuracy(judge, held_out.pictures(np.arange(300)), held_out.scenes) >= 0.99


def test_training_from_the_recorded_seed_reproduces_the_first_logged_losses():
    """Each stage from scratch for a few steps; the stages after the VAE start from the shipped
    weights of the stages before them, as the full run started from what it had trained."""
    steps = 3
    run = ShapesTraining(RECORD["seed"], Sizes(**_tuples(RECORD["sizes"])), Schedule(**RECORD["schedule"]),
                         stop_after=steps, show=False)
    run.train_vae()
    vae = AutoencoderKL.from_pretrained(SD, subfolder="vae", use_safetensors=True)
    run.use_vae(vae)
    run.train_text_unet()
    run.use_text_unet(CLIPTextModel.from_pretrained(SD, subfolder="text_encoder", use_safetensors=True),
                      UNet2DConditionModel.from_pretrained(SD, subfolder="unet", use_safetensors=True))
    run.train_controlnet()
    run.train_lora()
    run.train_dit(vae)
    run.train_judge()
    for stage, logged in RECORD["first_losses"].items():
        assert run.logs[stage] == pytest.approx(logged[:steps], rel=1e-3), stage


def _tuples(value):
    """JSON lists back to the tuples the diffusers configs were given."""
    if isinstance(value, list):
        return tuple(value)
    if isinstance(value, dict):
        return {k: _tuples(v) for k, v in value.items()}
    return value


def test_served_pictures_in_one_batch_equal_diffusers_pipelines_loading_the_shipped_folders():
    """A plain, a ControlNet and a LoRA request denoised together by the worker's engine equal
    diffusers' own pipelines, each alone, loading the same folders (`from_pretrained`)."""
    from diffusers import ControlNetModel, StableDiffusionControlNetPipeline, StableDiffusionPipeline
    from PIL import Image

    from stepserve.engine.sampler import RequestInputs
    from stepserve.load_tests.bench_shapes import draw
    from stepserve.policies.types import ControlNetUse, LoraUse, RequestSpec

    family = family_class("sd15").load(ModelSource(name="shapes", family="sd15", path=SD), ALL_PARTS, "cpu")
    load_addon(AddonSource(AddonKind.CONTROLNET, "silhouette", "shapes", path=str(SHIPPED / "controlnet-silhouette")),
               family)
    load_addon(AddonSource(AddonKind.LORA, "outlined", "shapes", path=str(SHIPPED / "lora-outlined")), family)
    held_out = Renders(seed=5, count=1)
    scene, silhouette = held_out.scenes[0], held_out.silhouettes([0])[0]

    def spec(rid, seed, **addons):
        return RequestSpec(request_id=rid, model="shapes", prompt=scene.caption, width=64, height=64,
                           num_inference_steps=8, guidance_scale=5.0, seed=seed, **addons)

    specs = [spec("plain", 1), spec("cn", 2, controlnets=(ControlNetUse("silhouette"),)),
             spec("lora", 3, loras=(LoraUse("outlined"),))]
    served = draw(family, specs, [RequestInputs(), RequestInputs(control=(silhouette,)), RequestInputs()]).astype(int)

    local = dict(use_safetensors=True, local_files_only=True)
    pipe = StableDiffusionPipeline.from_pretrained(SD, safety_checker=None, requires_safety_checker=False, **local)
    pipe.set_progress_bar_config(disable=True)
    controlnet = ControlNetModel.from_pretrained(str(SHIPPED / "controlnet-silhouette"), **local)
    with_control = StableDiffusionControlNetPipeline(**pipe.components, controlnet=controlnet)
    with_control.set_progress_bar_config(disable=True)

    def reference(p, s, **extra):
        out = p(s.prompt, height=64, width=64, num_inference_steps=8, guidance_scale=5.0,
                generator=torch.Generator("cpu").manual_seed(s.seed), output_type="np", **extra).images[0]
        return (out * 255).round().astype(int)

    expected = [reference(pipe, specs[0]), reference(with_control, specs[1], image=Image.fromarray(silhouette))]
    pipe.load_lora_weights(str(SHIPPED / "lora-outlined"), **local)
    pipe.fuse_lora(lora_scale=1.0)
    expected.append(reference(pipe, specs[2]))
    for s, got, want in zip(specs, served, expected):
        assert np.abs(got - want).max() <= 1, s.request_id
    # The add-ons change the picture, so the comparisons can fail.
    assert np.abs(expected[1] - expected[0]).mean() > 2 and np.abs(expected[2] - expected[0]).mean() > 2


SD3 = str(SHIPPED / "sd3")


def test_the_shipped_sd3_folder_loads_as_a_served_model_with_its_short_t5_context():
    family = family_class("sd3").load(ModelSource(name="shapes-sd3", family="sd3", path=SD3), ALL_PARTS, "cpu")
    assert family.vae_scale_factor == 8 and family.max_sequence_length == 16
    # Every caption word is one piece of the shipped T5 tokenizer (and one token of both CLIPs').
    caption = "a large purple triangle on an orange background, top left"
    assert len(family.pipe.tokenizer_3.tokenize(caption)) == len(family.pipe.tokenizer.tokenize(caption)) == 11
    assert family.encode_text([caption])["context"].shape == (1, 32 + 16, 64)  # CLIP tokens, then T5's
    # The router prices its edits with those lengths, read from the folder without loading it.
    sd3 = family_class("sd3")
    assert sd3.dit_dims(family.source, CacheKind.OUTPUTS)[0].text_tokens == 32 + 16
    preset = ModelSource(name="t", family="sd3", preset="tiny")
    assert sd3.dit_dims(preset, CacheKind.OUTPUTS)[0].text_tokens == 77 + 256


def test_served_sd3_pictures_in_one_batch_equal_the_diffusers_pipeline_loading_the_shipped_folder():
    """Two requests of the trained MMDiT denoised together by the worker's engine equal diffusers'
    `StableDiffusion3Pipeline` loading the same folder, each alone, at the model's T5 length."""
    from diffusers import StableDiffusion3Pipeline

    from stepserve.load_tests.bench_shapes import draw
    from stepserve.policies.types import RequestSpec

    family = family_class("sd3").load(ModelSource(name="shapes-sd3", family="sd3", path=SD3), ALL_PARTS, "cpu")
    scenes = Renders(seed=6, count=2).scenes
    specs = [RequestSpec(request_id=f"r{i}", model="shapes-sd3", prompt=s.caption, width=64, height=64,
                         num_inference_steps=8, guidance_scale=guidance, seed=i + 1)
             for i, (s, guidance) in enumerate(zip(scenes, (3.0, 5.0)))]
    served = draw(family, specs).astype(int)
    pipe = StableDiffusion3Pipeline.from_pretrained(SD3, use_safetensors=True, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    for s, got in zip(specs, served):
        want = pipe(s.prompt, height=64, width=64, num_inference_steps=8, guidance_scale=s.guidance_scale,
                    max_sequence_length=16, generator=torch.Generator("cpu").manual_seed(s.seed),
                    output_type="np").images[0]
        assert np.abs(got - (want * 255).round().astype(int)).max() <= 1, s.request_id
    assert np.abs(served[0] - served[1]).mean() > 2  # two prompts, two pictures: the comparison can fail


def test_served_sd3_edits_equal_the_diffusers_inpaint_pipeline_loading_the_shipped_folder():
    """Two recolouring edits of held-out pictures, denoised together by the worker's engine, equal
    diffusers' `StableDiffusion3InpaintPipeline` loading the same folder, each alone."""
    from diffusers import StableDiffusion3InpaintPipeline
    from PIL import Image

    from stepserve.load_tests.bench_shapes import draw
    from stepserve.load_tests.shape_edits import edit_requests, recoloured
    from stepserve.policies.types import RequestSpec

    family = family_class("sd3").load(ModelSource(name="shapes-sd3", family="sd3", path=SD3), ALL_PARTS, "cpu")
    renders = Renders(seed=7, count=2)
    templates = renders.pictures([0, 1])
    specs = [RequestSpec(request_id=f"e{i}", model="shapes-sd3", prompt=recoloured(s, 1).caption, width=64, height=64,
                         num_inference_steps=8, guidance_scale=3.0, seed=i + 1) for i, s in enumerate(renders.scenes)]
    edits = edit_requests(specs, renders.scenes, templates, 0.6, type(family).skipped_steps(8, 0.6), template_ids=False)
    served = draw(family, [spec for spec, _ in edits], [inputs for _, inputs in edits]).astype(int)
    pipe = StableDiffusion3InpaintPipeline.from_pretrained(SD3, use_safetensors=True, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    for (spec, inputs), got in zip(edits, served):
        want = pipe(spec.prompt, image=Image.fromarray(inputs.image), mask_image=Image.fromarray(inputs.mask, mode="L"),
                    height=64, width=64, strength=0.6, num_inference_steps=8, guidance_scale=3.0,
                    max_sequence_length=16, generator=torch.Generator("cpu").manual_seed(spec.seed),
                    output_type="np").images[0]
        assert np.abs(got - (want * 255).round().astype(int)).max() <= 1, spec.request_id
    assert np.abs(served - templates).mean() > 2  # the edits changed the pictures: the comparison can fail
