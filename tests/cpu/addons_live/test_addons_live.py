"""ControlNet-as-a-Service and bounded asynchronous LoRA loading, served for real."""

import asyncio
import base64
import dataclasses
import io

import httpx
import numpy as np
import openai
from diffusers.image_processor import VaeImageProcessor
from PIL import Image
from ray import serve

from stepserve.policies.types import ControlNetUse

from tests.addons import reference_image
from tests.tiny import TINY, control_image, make_spec


def png_b64(image: Image.Image) -> str:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


def pixels(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB")).astype(int)


def test_controlnets_run_by_the_service_equal_diffusers_beside_late_joining_loras(addons_app):
    url, _ = addons_app
    deployments = serve.status().applications["stepserve"].deployments
    assert deployments["ControlNetService"].status == "HEALTHY"
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    images = {"canny": control_image(8), "depth": control_image(9)}
    controlnets = [{"name": "canny", "image": png_b64(images["canny"]), "conditioning_scale": 1.2},
                   {"name": "depth", "image": png_b64(images["depth"]), "start": 0.3}]

    async def fire():
        return await asyncio.gather(
            client.images.generate(model="tiny-sd", prompt="a bridge", size="64x64", extra_body={
                "num_inference_steps": 7, "seed": 3, "controlnets": controlnets}),
            *(client.images.generate(model="tiny-sd", prompt="styled", size="64x64", extra_body={
                "num_inference_steps": 6, "seed": i, "loras": [{"name": name}], "controlnets": controlnets[:1]})
              for i, name in enumerate(["papercut", "ink", "papercut"])))

    served, *styled = asyncio.run(fire())
    spec = dataclasses.replace(make_spec("t", steps=7, seed=3, prompt="a bridge"),
                               controlnets=(ControlNetUse("canny", 1.2), ControlNetUse("depth", start=0.3)))
    expected = reference_image(TINY, spec, images, {})
    expected = np.asarray(VaeImageProcessor.numpy_to_pil(expected[None])[0]).astype(int)
    assert np.abs(pixels(served.data[0].b64_json) - expected).max() <= 1  # PNG rounding at most
    assert all(len(result.data) == 1 for result in styled)
    bounds = {line.split(" ")[0]: float(line.split(" ")[1]) for line in httpx.get(f"{url}/metrics").text.splitlines()
              if line.startswith("stepserve_lora_join_bound{")}
    assert bounds == {'stepserve_lora_join_bound{lora="ink",model="tiny-sd"}': 0.0,
                      'stepserve_lora_join_bound{lora="papercut",model="tiny-sd"}': 0.5}, bounds
