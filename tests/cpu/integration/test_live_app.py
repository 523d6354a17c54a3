"""The embedded default served for real: HTTP (httpx and the official openai client) and a handle."""

import asyncio
import base64
import dataclasses
import io
import json
import time

import httpx
import numpy as np
import openai
import pytest
import ray
from diffusers.image_processor import VaeImageProcessor
from PIL import Image
from ray import serve

from stepserve.deployments.errors import APIError
from stepserve.deployments.protocol import ImageGenerationRequest
from stepserve.engine.families import ALL_PARTS, load_family
from stepserve.policies.admission import is_quiet
from stepserve.policies.types import ControlNetUse, LoraUse

from tests.addons import reference_image, write_preset_loras
from tests.tiny import TINY, control_image, make_spec, solo_pipeline_image


def png_array(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def png_b64(image: Image.Image) -> str:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


def body(**kw):
    return {"prompt": "a red fox", "size": "64x64", "num_inference_steps": 4, **kw}


def test_openai_client_gets_a_png_of_the_requested_size(live_app):
    url, _ = live_app
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    result = client.images.generate(
        model="tiny-sd", prompt="a lighthouse", size="128x64", response_format="b64_json", n=2,
        extra_body={"num_inference_steps": 5, "seed": 11},
    )
    assert len(result.data) == 2
    for item in result.data:
        assert png_array(item.b64_json).shape == (64, 128, 3)
    assert not np.array_equal(png_array(result.data[0].b64_json), png_array(result.data[1].b64_json))
    assert [m.id for m in client.models.list().data] == ["tiny-sd"]


@pytest.mark.parametrize("fmt, pil_format", [("png", "PNG"), ("jpeg", "JPEG"), ("webp", "WEBP")])
def test_openai_client_image_parameters_get_the_format_asked_for(live_app, fmt, pil_format):
    url, _ = live_app
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    result = client.images.generate(
        model="tiny-sd", prompt="a lighthouse", size="64x64", quality="low", output_format=fmt, background="opaque",
        moderation="low", style="vivid", user="user-7", extra_body={"seed": 3})
    assert (result.output_format, result.quality, result.size, result.background) == (fmt, "low", "64x64", "opaque")
    image = Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json)))
    assert (image.format, image.size) == (pil_format, (64, 64))


def test_served_image_in_a_mixed_batch_equals_solo_diffusers(live_app):
    """Other requests with other step counts run concurrently; the target is still exact."""
    url, _ = live_app
    target = dict(prompt="a castle on a hill", negative_prompt="fog", size="64x64", num_inference_steps=9,
                  guidance_scale=6.0, seed=1234)
    others = [body(num_inference_steps=s, seed=s, guidance_scale=g) for s, g in [(3, 7.5), (14, 1.0), (6, 3.0)]]

    async def fire():
        async with httpx.AsyncClient(timeout=120) as client:
            calls = [client.post(f"{url}/v1/images/generations", json=b) for b in others[:2]]
            calls.append(client.post(f"{url}/v1/images/generations", json=target))
            calls.append(client.post(f"{url}/v1/images/generations", json=others[2]))
            return await asyncio.gather(*calls)

    responses = asyncio.run(fire())
    assert [r.status_code for r in responses] == [200] * 4
    served = png_array(responses[2].json()["data"][0]["b64_json"])
    assert responses[2].json()["data"][0]["seed"] == 1234

    family = load_family(TINY, ALL_PARTS, "cpu")
    spec = make_spec("t", steps=9, seed=1234, guidance=6.0, prompt=target["prompt"], negative="fog")
    expected = np.asarray(VaeImageProcessor.numpy_to_pil(solo_pipeline_image(family, spec)[None])[0])
    # PNG is 8-bit: float noise at 1e-5 can flip a rounding, nothing more.
    assert np.abs(served.astype(int) - expected.astype(int)).max() <= 1


def test_controlnets_and_loras_through_the_openai_client_equal_diffusers(live_app, tmp_path):
    """A request with two ControlNets and a LoRA (the official client's `extra_body`), batched
    with a plain one and a LoRA-only one, equals the diffusers ControlNet pipeline with the LoRA
    fused; an unknown add-on is a 404 meanwhile."""
    url, _ = live_app
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    images = {"depth": control_image(5), "pose": control_image(6, size=96)}
    controlnets = [{"name": "depth", "image": png_b64(images["depth"]), "conditioning_scale": 0.8},
                   {"name": "pose", "image": png_b64(images["pose"]), "end": 0.5}]
    target = dict(model="tiny-sd", prompt="a tower", size="64x64", response_format="b64_json",
                  extra_body={"num_inference_steps": 6, "seed": 21, "negative_prompt": "fog",
                              "controlnets": controlnets, "loras": [{"name": "ink", "scale": 0.7}]})

    async def fire():
        calls = [client.images.generate(**target),
                 client.images.generate(model="tiny-sd", prompt="plain", size="64x64",
                                        extra_body={"num_inference_steps": 8, "seed": 1}),
                 client.images.generate(model="tiny-sd", prompt="styled", size="64x64",
                                        extra_body={"num_inference_steps": 5, "loras": [{"name": "papercut"}]})]
        results = await asyncio.gather(*calls)
        with pytest.raises(openai.NotFoundError):
            await client.images.generate(model="tiny-sd", prompt="x", extra_body={"loras": [{"name": "nope"}]})
        return results

    served, *_ = asyncio.run(fire())
    spec = dataclasses.replace(
        make_spec("t", steps=6, seed=21, prompt="a tower", negative="fog"),
        controlnets=(ControlNetUse("depth", 0.8), ControlNetUse("pose", end=0.5)), loras=(LoraUse("ink", 0.7),))
    expected = reference_image(TINY, spec, images, write_preset_loras(TINY, tmp_path))
    expected = np.asarray(VaeImageProcessor.numpy_to_pil(expected[None])[0])
    assert np.abs(png_array(served.data[0].b64_json).astype(int) - expected.astype(int)).max() <= 1
    models = httpx.get(f"{url}/v1/models").json()["data"]
    assert models[0]["controlnets"] == ["canny", "depth", "pose"] and models[0]["loras"] == ["papercut", "ink"]


def test_bad_input_gets_openai_errors_and_others_still_succeed(live_app):
    url, _ = live_app
    bad = [
        (b"{not json", 400, None),
        (json.dumps(body(size="65x64")).encode(), 400, "size"),
        (json.dumps(body(size="100000x100000")).encode(), 400, "size"),
        (json.dumps(body(num_inference_steps=10_000)).encode(), 400, "num_inference_steps"),
        (json.dumps(body(guidance_scale=-3)).encode(), 400, "guidance_scale"),
        (json.dumps(body(n=50)).encode(), 400, "n"),
        (json.dumps(body(prompt="")).encode(), 400, "prompt"),
        (json.dumps(body(prompt="x" * 100_000)).encode(), 400, "prompt"),
        (json.dumps(body(model="nope")).encode(), 404, "model"),
        (json.dumps(body(frobnicate=1)).encode(), 400, "frobnicate"),
        # A lone surrogate once failed the text encoder's whole batch, so concurrent users got 500.
        (b'{"prompt": "\\ud800 fox", "size": "64x64", "num_inference_steps": 4}', 400, "prompt"),
        (b"[" * 200_000 + b"]" * 200_000, 400, None),  # nesting bomb under the size cap
        (b"x" * (17 << 20), 413, None),  # over limits.max_body_bytes (16 MiB)
    ]

    async def fire():
        async with httpx.AsyncClient(timeout=120) as client:
            good = [client.post(f"{url}/v1/images/generations", json=body(num_inference_steps=8, seed=i))
                    for i in range(3)]
            wrong = [client.post(f"{url}/v1/images/generations", content=raw,
                                 headers={"content-type": "application/json"}) for raw, _, _ in bad]
            return await asyncio.gather(*good), await asyncio.gather(*wrong)

    good, wrong = asyncio.run(fire())
    assert [r.status_code for r in good] == [200, 200, 200]
    for (raw, status, param), response in zip(bad, wrong):
        assert response.status_code == status, (raw[:40], response.text[:200])
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert error["param"] == param
    after = httpx.post(f"{url}/v1/images/generations", json=body(), timeout=60)
    assert after.status_code == 200


def test_handle_api_and_errors(live_app):
    _, handle = live_app
    result = handle.generate.remote(ImageGenerationRequest(prompt="a boat", size="64x64", num_inference_steps=3,
                                                           seed=5)).result()
    assert png_array(result["data"][0]["b64_json"]).shape == (64, 64, 3)
    with pytest.raises(APIError) as info:
        handle.generate.remote({"prompt": "a boat", "size": "63x63"}).result()
    assert info.value.status == 400 and info.value.param == "size"
    # A client id makes a retry idempotent: the same body joins the request in flight ...
    slow = handle.generate.remote(body(num_inference_steps=60, size="128x128"), "same-id")
    # Handle calls are not ordered among themselves: wait until the router holds the first.
    for _ in range(200):
        if handle.progress.remote("same-id").result():
            break
        asyncio.run(asyncio.sleep(0.05))
    retry = handle.generate.remote(body(num_inference_steps=60, size="128x128"), "same-id")
    # ... another body under the same id is refused, and the first holder is unaffected.
    with pytest.raises(APIError) as info:
        handle.generate.remote(body(), "same-id").result()
    assert info.value.status == 409
    assert retry.result() == slow.result() and slow.result()["data"][0]["b64_json"]
    # After it finished, the same id and body get the stored response, without running again.
    assert handle.generate.remote(body(num_inference_steps=60, size="128x128"), "same-id").result() == slow.result()


def test_cancel_frees_the_request_at_a_step_boundary(live_app):
    _, handle = live_app
    response = handle.generate.remote(body(num_inference_steps=100, size="256x256"), "to-cancel")
    for _ in range(200):
        progress = handle.progress.remote("to-cancel").result()
        if progress and progress["steps_done"] > 0:
            break
        asyncio.run(asyncio.sleep(0.05))
    assert handle.cancel.remote("to-cancel").result() is True
    with pytest.raises(APIError) as info:
        response.result(timeout_s=60)
    assert info.value.code == "cancelled"
    assert handle.progress.remote("to-cancel").result() is None  # forgotten once delivered


def test_health_ready_models_and_metrics(live_app):
    url, _ = live_app
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    ready = httpx.get(f"{url}/ready").json()
    assert ready["status"] == "ready" and ready["workers"] == 2
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "tiny-sd"
    httpx.post(f"{url}/v1/images/generations", json=body(), timeout=60).raise_for_status()
    metrics = httpx.get(f"{url}/metrics").text
    for name in ('stepserve_queue_length{kind="image"}', 'stepserve_queued_steps{kind="image"}',
                 "stepserve_running_requests", "stepserve_step_latency_seconds_bucket",
                 "stepserve_worker_plan_seconds_bucket", "stepserve_batch_size_bucket",
                 'stepserve_requests_total{model="tiny-sd",status="finished"}',
                 'stepserve_http_requests_total{code="200",route="/v1/images/generations"}',
                 'stepserve_request_stage_seconds_count{kind="image",model="tiny-sd",stage="denoise"}',
                 'stepserve_ingress_stage_seconds_count{stage="router"}'):
        assert name in metrics, name


def test_the_edge_hears_nothing_of_a_quiet_load(live_app):
    # A request's queueing, admission and finish change the router's load, but far from every
    # bound the ingress's long poll must not answer them: each answer was a Serve call on both
    # sides, two or three a request at light load.
    url, _ = live_app
    router = serve.get_deployment_handle("Router", "stepserve")
    report = router.load.remote(-1).result()
    assert is_quiet(report)
    poll = router.load.remote(report.version, timeout_s=4.0)
    httpx.post(f"{url}/v1/images/generations", json=body(), timeout=60).raise_for_status()
    assert poll.result().version == report.version  # answered by its timeout, not by the request


def test_python_client(live_app):
    from stepserve import StepserveClient

    url, _ = live_app
    with StepserveClient(url) as client:
        client.wait_ready()
        assert client.models() == ["tiny-sd"]
        (png,) = client.generate("a tree", size="64x64", num_inference_steps=3, seed=1)
        assert Image.open(io.BytesIO(png)).size == (64, 64)
        with pytest.raises(APIError) as info:
            client.generate("a tree", num_inference_steps=0)
        assert info.value.status == 400 and info.value.param == "num_inference_steps"


def test_a_worker_killed_under_load_loses_no_request(live_app):
    """Kill one of the two workers while eight requests are mid-denoising: every request still
    succeeds (its state resumes elsewhere: from its last checkpoint, or from step 0), the one we
    check equals solo diffusers, and the restarted worker serves again. Last in this module: it
    disturbs the app."""
    url, _ = live_app
    router = serve.get_deployment_handle("Router", app_name="stepserve")
    names = router.worker_actor_names.remote().result()
    target = dict(prompt="a castle on a hill", size="128x128", num_inference_steps=60, guidance_scale=6.0, seed=77)

    async def fire():
        async with httpx.AsyncClient(timeout=300) as client:
            calls = [asyncio.create_task(client.post(f"{url}/v1/images/generations",
                                                     json=body(size="128x128", num_inference_steps=60, seed=i)))
                     for i in range(7)]
            calls.append(asyncio.create_task(client.post(f"{url}/v1/images/generations", json=target)))
            while (await router.readiness.remote())["running"] < 4:  # the workers hold requests now
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
            ray.kill(ray.get_actor(sorted(names.values())[0]), no_restart=False)
            return await asyncio.gather(*calls)

    responses = asyncio.run(fire())
    assert [r.status_code for r in responses] == [200] * 8, [r.text[:200] for r in responses]
    metrics = httpx.get(f"{url}/metrics").text
    assert "stepserve_worker_restarts_total 1.0" in metrics
    assert "stepserve_recoveries_total 0.0" not in metrics  # somebody resumed elsewhere

    family = load_family(TINY, ALL_PARTS, "cpu")
    spec = make_spec("t", steps=60, seed=77, guidance=6.0, prompt=target["prompt"], size=128)
    expected = np.asarray(VaeImageProcessor.numpy_to_pil(solo_pipeline_image(family, spec)[None])[0])
    served = png_array(responses[-1].json()["data"][0]["b64_json"])
    assert np.abs(served.astype(int) - expected.astype(int)).max() <= 1

    deadline = time.monotonic() + 120
    while router.readiness.remote().result()["live_workers"] < 2:
        assert time.monotonic() < deadline, "the killed worker never came back"
        time.sleep(0.5)
    assert httpx.post(f"{url}/v1/images/generations", json=body(), timeout=120).status_code == 200
