"""Every text-to-image family served for real in one pool (configs/local-images.yaml), through the
official openai client: an image generated while requests of every model run equals its family's
solo diffusers pipeline (StableDiffusionXLPipeline, StableDiffusion3Pipeline, FluxPipeline)."""

import base64
import io
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
from diffusers.image_processor import VaeImageProcessor
from PIL import Image

from stepserve.engine.families import ALL_PARTS, load_family

from tests.tiny import TINY_FLUX, TINY_SD3, TINY_SDXL, make_spec, solo_pipeline_image

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
    others = [dict(model=model, prompt="a red fox", size="64x64", response_format="b64_json",
                   extra_body={"num_inference_steps": steps, "seed": steps, "guidance_scale": 5.0})
              for model, steps in [("tiny-sdxl", 4), ("tiny-flux", 12), ("tiny-sd3", 14), ("tiny-sd", 3),
                                   ("tiny-flux", 5)]]
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
