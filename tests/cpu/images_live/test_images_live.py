"""Every text-to-image family served for real in one pool (configs/local-images.yaml), through the
official openai client: an image generated while requests of every model run (some of them caching
steps) equals its family's solo diffusers pipeline (StableDiffusionXLPipeline,
StableDiffusion3Pipeline, FluxPipeline)."""

import base64
import io
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
import torch
from diffusers.image_processor import VaeImageProcessor
from PIL import Image

from stepserve.engine.families import ALL_PARTS, load_family
from stepserve.engine.inpaint import edit_pixels
from stepserve.engine.sampler import RequestInputs
from stepserve.policies.types import RequestKind, RequestSpec

from tests.cpu.deployments.test_edits_api import mask_png
from tests.cpu.engine.test_edit_golden import pipeline_latents
from tests.tiny import TINY, TINY_FLUX, TINY_SD3, TINY_SDXL, make_spec, solo_pipeline_image

# The served models checked against their pipeline (tiny-sd's own exactness is tested elsewhere).
CHECKED = {"tiny-sdxl": TINY_SDXL, "tiny-sd3": TINY_SD3, "tiny-flux": TINY_FLUX}


def png_array(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


@pytest.fixture(scope="module")
def client(images_app):
    url, _ = images_app
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_models_are_listed(client):
    assert [m.id for m in client.models.list().data] == ["tiny-sd", "tiny-sdxl", "tiny-sd3", "tiny-flux"]


def test_each_family_is_served_exactly_beside_the_others(client):
    targets = [dict(model=model, prompt="a castle on a hill", size="64x64", response_format="b64_json",
                    extra_body={"num_inference_steps": 9, "guidance_scale": 6.0, "seed": 1234,
                                "negative_prompt": "fog"})
               for model in CHECKED]
    # Some partners cache steps (per request, in the batches the targets run in): the targets stay exact.
    others = [dict(model=model, prompt="a red fox", size="64x64", response_format="b64_json",
                   extra_body={"num_inference_steps": steps, "seed": steps, "guidance_scale": 5.0, **cache})
              for model, steps, cache in [("tiny-sdxl", 4, {}), ("tiny-flux", 12, {}),
                                          ("tiny-sd3", 14, {"step_cache": 0.2}), ("tiny-sd", 3, {"step_cache": 0.2}),
                                          ("tiny-flux", 5, {})]]
    calls = others[:2] + targets + others[2:]
    with ThreadPoolExecutor(len(calls)) as pool:
        results = [f.result() for f in [pool.submit(client.images.generate, **call) for call in calls]]
    assert all(png_array(r.data[0].b64_json).shape == (64, 64, 3) for r in results)
    served = {call["model"]: png_array(r.data[0].b64_json) for call, r in zip(calls[2:2 + len(targets)],
                                                                            results[2:2 + len(targets)])}
    for model, source in CHECKED.items():
        family = load_family(source, ALL_PARTS, "cpu")
        spec = make_spec("t", steps=9, seed=1234, guidance=6.0, prompt="a castle on a hill", negative="fog",
                         model=model)
        expected = np.asarray(VaeImageProcessor.numpy_to_pil(solo_pipeline_image(family, spec)[None])[0])
        # PNG is 8-bit: float noise at 1e-5 can flip a rounding, nothing more.
        assert np.abs(served[model].astype(int) - expected.astype(int)).max() <= 1, model
    # The same seed and prompt on SD1.5 is another image: the families were not mixed up.
    sd15 = client.images.generate(**{**targets[0], "model": "tiny-sd"})
    assert all(np.abs(png_array(sd15.data[0].b64_json).astype(int) - image.astype(int)).max() > 8
               for image in served.values())


def test_openai_images_edit_end_to_end_equals_the_inpaint_pipeline(client):
    """`images.edit` (multipart, a PNG mask with alpha) on the models that edit, while generations
    run beside them: each edit equals its family's inpaint pipeline alone (SD3's decoded as the
    served images are: its inpaint pipeline forgets the VAE's shift when it decodes); a bad mask
    is a 400 and disturbs nothing."""
    image = np.random.default_rng(5).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(image).save(out, format="PNG")
    mask = mask_png(box=(8, 16, 40, 48))
    edits = [dict(model=model, image=("photo.png", out.getvalue(), "image/png"), mask=("mask.png", mask, "image/png"),
                  prompt="a cat on a sofa", size="64x64",
                  extra_body={"num_inference_steps": 8, "strength": strength, "seed": 77, "guidance_scale": 6.0})
             for model, strength in (("tiny-sd", 0.75), ("tiny-sd3", 1.0))]
    others = [dict(model=model, prompt="a red fox", size="64x64", extra_body={"num_inference_steps": 6, "seed": 1})
              for model in ("tiny-sd", "tiny-sd3", "tiny-flux")]
    with ThreadPoolExecutor(len(edits) + len(others)) as pool:
        edited = [pool.submit(client.images.edit, **call) for call in edits]
        for call in others:
            pool.submit(client.images.generate, **call)
        served = [png_array(f.result().data[0].b64_json) for f in edited]
    area = np.where(np.asarray(Image.open(io.BytesIO(mask)).getchannel("A")) == 0, 255, 0).astype(np.uint8)
    for call, got, source in zip(edits, served, (TINY, TINY_SD3)):
        family = load_family(source, ALL_PARTS, "cpu")
        settings = call["extra_body"]
        pixels, edit_mask = edit_pixels(Image.fromarray(image), Image.fromarray(area, mode="L"), 64, 64)
        spec = RequestSpec(request_id="e", model=call["model"], prompt=call["prompt"], width=64, height=64,
                           num_inference_steps=8, guidance_scale=6.0, seed=77, kind=RequestKind.EDIT,
                           strength=settings["strength"], skip_steps=type(family).skipped_steps(8, settings["strength"]))
        latents = pipeline_latents(family, spec, RequestInputs(image=pixels, mask=edit_mask))
        expected = np.asarray(VaeImageProcessor.numpy_to_pil(family.decode(torch.from_numpy(latents)))[0])
        assert np.abs(got.astype(int) - expected.astype(int)).max() <= 1, call["model"]
    with pytest.raises(openai.BadRequestError) as error:
        client.images.edit(model="tiny-sd", image=("photo.png", out.getvalue(), "image/png"), prompt="a cat",
                           mask=("mask.png", out.getvalue(), "image/png"))  # RGB: no alpha channel
    assert error.value.body["param"] == "mask"
    assert client.images.generate(model="tiny-sd", prompt="a fox", size="64x64").data[0].b64_json
