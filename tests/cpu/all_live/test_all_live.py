"""Everything the CPU twin serves, at once (configs/local-all.yaml: the composed policy over 2 CPU
workers, with the ControlNet service, the text encoder and VAE decoder deployments, an activation
store and a LoRA store). Two videos hold both workers; then, through the official openai client,
plain, LoRA and ControlNet images, an inpaint edit and an edit of a template arrive together.
Every request succeeds; each add-on and edit image equals the same request sent alone; the
urgent images pause a video at a step boundary, and both videos complete with the frames of an
uninterrupted run."""

import asyncio
import base64
import io
import time

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from stepserve.runtime import CONFIGS, load_serve_config

from tests.cpu.coserve_live.test_coserve_live import job_record, reference_frames, unzip_frames, wait_until
from tests.cpu.deployments.test_edits_api import mask_png
from tests.cpu.integration.conftest import serving
from tests.tiny import control_image

VIDEOS = [dict(model="tiny-wan", prompt="a red fox runs through snow", size="64x64", num_frames=9,
               num_inference_steps=steps, seed=seed) for steps, seed in ((250, 5), (250, 6))]


@pytest.fixture(scope="module")
def app():
    yield from serving(load_serve_config(CONFIGS / "local-all.yaml"))


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def pixels(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB")).astype(int)


PHOTO = png(Image.fromarray(np.random.default_rng(7).integers(0, 256, (64, 64, 3), dtype=np.uint8)))
CANNY = base64.b64encode(png(control_image(8))).decode()
# What arrives together: (name, method, arguments). Two sizes of plain image, so they cannot all
# share one forward and need both workers.
CALLS = [
    ("plain", "generate", dict(model="tiny-sd", prompt="a lighthouse", size="128x64",
                               extra_body={"num_inference_steps": 6, "seed": 1})),
    ("lora", "generate", dict(model="tiny-sd", prompt="a lighthouse", size="64x64",
                              extra_body={"num_inference_steps": 6, "seed": 2, "loras": [{"name": "papercut"}]})),
    ("controlnet", "generate", dict(model="tiny-sd", prompt="a bridge", size="64x64", extra_body={
        "num_inference_steps": 6, "seed": 3, "controlnets": [{"name": "canny", "image": CANNY}]})),
    ("inpaint", "edit", dict(model="tiny-sd", prompt="a cat", image=("photo.png", PHOTO, "image/png"),
                             mask=("mask.png", mask_png(), "image/png"),
                             extra_body={"num_inference_steps": 6, "seed": 4})),
    # Its template's first edit: it records the activations (an exact forward) for later edits.
    ("template", "edit", dict(model="tiny-sd3", prompt="a cat", image=("photo.png", PHOTO, "image/png"),
                              mask=("mask.png", mask_png(), "image/png"),
                              extra_body={"num_inference_steps": 4, "seed": 5, "template_id": "sofa"})),
]


def test_images_edits_addons_and_videos_at_once(app):
    url, _ = app
    deadline = time.monotonic() + 400
    with httpx.Client(base_url=url, timeout=120) as http:
        ids = []
        for body in VIDEOS:
            created = http.post("/v1/videos", json=body)
            assert created.status_code == 200, created.text
            ids.append(created.json()["id"])
            wait_until(http, url, ids[-1], lambda v: v["steps_done"] >= 2, deadline)

        async def together():
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
            return await asyncio.gather(*(getattr(client.images, method)(**kwargs) for _, method, kwargs in CALLS))

        served = {name: pixels(result.data[0].b64_json) for (name, _, _), result in zip(CALLS, asyncio.run(together()))}

        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        for name, method, kwargs in CALLS[1:]:
            if name == "template":  # alone and exact: the same edit without its template
                kwargs = {**kwargs, "extra_body": {k: v for k, v in kwargs["extra_body"].items() if k != "template_id"}}
            alone = pixels(getattr(client.images, method)(**kwargs).data[0].b64_json)
            assert np.abs(served[name] - alone).max() <= 1, name  # PNG rounding at most

        pauses = []
        for video_id, body in zip(ids, VIDEOS):
            video = wait_until(http, url, video_id, lambda v: v["status"] == "completed", deadline)
            assert video["steps_done"] == video["steps_total"] == body["num_inference_steps"]
            pauses.append(job_record(video_id).pauses)
            frames = http.get(f"/v1/videos/{video_id}/content", params={"variant": "frames"})
            assert frames.status_code == 200
            expected = reference_frames(steps=body["num_inference_steps"], seed=body["seed"], frames=9)
            assert np.abs(unzip_frames(frames.content).astype(int) - expected.astype(int)).max() <= 1
        assert max(pauses) >= 1, pauses
