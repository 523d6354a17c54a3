"""SDXL served for real beside SD1.5 (configs/local-sdxl.yaml) through the official openai client:
an SDXL image generated while SD1.5 and other SDXL requests run equals the solo diffusers
StableDiffusionXLPipeline."""

import base64
import io
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
from diffusers.image_processor import VaeImageProcessor
from PIL import Image

from stepserve.engine.families import ALL_PARTS, load_family

from ...tiny import TINY_SDXL, make_spec, solo_pipeline_image


def png_array(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def test_openai_client_serves_sdxl_exactly_beside_sd15(sdxl_app):
    url, _ = sdxl_app
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny-sd", "tiny-sdxl"]
    target = dict(model="tiny-sdxl", prompt="a castle on a hill", size="64x64", response_format="b64_json",
                  extra_body={"num_inference_steps": 9, "guidance_scale": 6.0, "seed": 1234,
                              "negative_prompt": "fog"})
    others = [dict(model=model, prompt="a red fox", size="64x64", response_format="b64_json",
                   extra_body={"num_inference_steps": steps, "seed": steps, "guidance_scale": 5.0})
              for model, steps in [("tiny-sdxl", 4), ("tiny-sd", 12), ("tiny-sdxl", 14), ("tiny-sd", 3)]]
    with ThreadPoolExecutor(len(others) + 1) as pool:
        futures = [pool.submit(client.images.generate, **call) for call in others[:2] + [target] + others[2:]]
        results = [f.result() for f in futures]
    assert all(png_array(r.data[0].b64_json).shape == (64, 64, 3) for r in results)
    served = png_array(results[2].data[0].b64_json)

    family = load_family(TINY_SDXL, ALL_PARTS, "cpu")
    spec = make_spec("t", steps=9, seed=1234, guidance=6.0, prompt=target["prompt"], negative="fog",
                     model="tiny-sdxl")
    expected = np.asarray(VaeImageProcessor.numpy_to_pil(solo_pipeline_image(family, spec)[None])[0])
    # PNG is 8-bit: float noise at 1e-5 can flip a rounding, nothing more.
    assert np.abs(served.astype(int) - expected.astype(int)).max() <= 1
    # The same seed and prompt on SD1.5 is another image: the families were not mixed up.
    sd15 = client.images.generate(**{**target, "model": "tiny-sd"})
    assert np.abs(png_array(sd15.data[0].b64_json).astype(int) - served.astype(int)).max() > 8
