"""The batched peer served for real beside stepserve: same route, same images."""

import asyncio
import base64
import io

import httpx
import numpy as np
import pytest
from PIL import Image
from ray import serve

from stepserve.load_tests.peers import build_peer_app
from stepserve.runtime import tiny_config_path, load_serve_config


def pixels(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB")).astype(int)


@pytest.fixture(scope="module")
def peer_url(live_app):
    url, _ = live_app
    model = load_serve_config(tiny_config_path())["applications"][0]["args"]["models"][0]
    # Small CPU asks: it shares the 2-CPU test Ray with the stepserve app (1.3 CPUs).
    app = build_peer_app({"model": model, "mode": "batched", "num_replicas": 1, "num_cpus": 0.1,
                          "ingress_num_cpus": 0.05, "batch_wait_timeout_s": 0.3})
    serve.run(app, name="peer", route_prefix="/peer")
    try:
        yield f"{url}/peer"
    finally:
        serve.delete("peer")


def test_a_batch_of_mixed_shapes_gives_every_request_the_image_stepserve_gives(live_app, peer_url):
    """Two requests share a shape (one pipeline call), one has its own; each matches stepserve's
    exact answer for the same body, so the benchmark compares the same work."""
    url, _ = live_app
    bodies = [{"prompt": "a red fox", "size": "64x64", "num_inference_steps": 4, "seed": 1},
              {"prompt": "a blue bird", "size": "64x64", "num_inference_steps": 4, "seed": 2},
              {"prompt": "a red fox", "size": "64x64", "num_inference_steps": 6, "seed": 1}]

    async def post_all(base: str):
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(client.post(f"{base}/v1/images/generations", json=b) for b in bodies))

    peer = asyncio.run(post_all(peer_url))
    ours = asyncio.run(post_all(url))
    for body, p, o in zip(bodies, peer, ours):
        assert p.status_code == 200 and o.status_code == 200, (p.text, o.text)
        assert p.json()["data"][0]["seed"] == body["seed"]
        assert np.abs(pixels(p.json()["data"][0]["b64_json"]) - pixels(o.json()["data"][0]["b64_json"])).max() <= 1


def test_the_peer_rejects_bad_input_in_the_openai_error_shape(peer_url):
    response = httpx.post(f"{peer_url}/v1/images/generations", json={"prompt": "a", "model": "nope"}, timeout=30)
    assert response.status_code == 404 and response.json()["error"]["param"] == "model"
