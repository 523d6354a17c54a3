"""Latent parallelism served for real: a lone CFG image splits over both worker actors (a gloo
all-gather between them a step), through the router handle and through the `openai` client with
a ControlNet, and equals diffusers alone; a burst is batched, not split."""

import asyncio
import dataclasses
import io
import time

import numpy as np
import openai
from diffusers.image_processor import VaeImageProcessor
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from stepserve.policies.types import ControlNetUse

from tests.addons import reference_image
from tests.cpu.addons_live.test_addons_live import pixels, png_b64
from tests.tiny import TINY, control_image, make_spec


def split_steps(router) -> float:
    text = router.metrics_text.remote().result().decode()
    for family in text_string_to_metric_families(text):
        if family.name == "stepserve_split_steps":
            return sum(s.value for s in family.samples if s.labels.get("split") == "cfg" and s.name.endswith("_total"))
    return 0.0


def as_uint8(image: np.ndarray) -> np.ndarray:
    return np.asarray(VaeImageProcessor.numpy_to_pil(image[None])[0]).astype(int)


def test_a_lone_image_splits_over_both_workers_and_equals_diffusers(latent_app):
    url, _ = latent_app
    router = serve.get_deployment_handle("Router", app_name="stepserve")
    spec = dataclasses.replace(make_spec("split-1", steps=8, seed=4, prompt="a harbour"), request_id="split-1")
    response = router.submit.remote(spec)
    degrees = []
    deadline = time.monotonic() + 120
    while not degrees and time.monotonic() < deadline:
        progress = router.progress.remote("split-1").result()
        degrees = progress["degrees"] if progress else []
        time.sleep(0.05)
    png = response.result(timeout_s=120)
    assert degrees and degrees[0] == 2, degrees  # both workers were idle: it split
    served = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(int)
    assert np.abs(served - as_uint8(reference_image(TINY, spec, {}, {}))).max() <= 1  # PNG rounding at most


def test_controlnet_requests_split_through_the_openai_client_and_a_burst_is_batched(latent_app):
    url, _ = latent_app
    router = serve.get_deployment_handle("Router", app_name="stepserve")
    image = control_image(5)
    body = {"num_inference_steps": 6, "seed": 2, "controlnets": [{"name": "canny", "image": png_b64(image),
                                                                  "conditioning_scale": 0.9}]}
    before = split_steps(router)

    async def one():
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
            return await client.images.generate(model="tiny-sd", prompt="a mill", size="64x64", extra_body=body)

    served = asyncio.run(one())
    assert split_steps(router) - before == 6  # every step split
    spec = dataclasses.replace(make_spec("t", steps=6, seed=2, prompt="a mill"),
                               controlnets=(ControlNetUse("canny", 0.9),))
    expected = as_uint8(reference_image(TINY, spec, {"canny": image}, {}))
    assert np.abs(pixels(served.data[0].b64_json) - expected).max() <= 1

    async def burst():
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(client.images.generate(
                model="tiny-sd", prompt="a row", size="64x64", extra_body={"num_inference_steps": 4, "seed": i})
                for i in range(4)))

    before = split_steps(router)
    assert all(len(r.data) == 1 for r in asyncio.run(burst()))
    assert split_steps(router) - before < 4 * 4  # more requests than workers: they batch
