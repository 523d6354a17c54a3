"""The benchmark's peers, as plain classes: what they accept, and that they make the right image
(the batched peer needs a Serve replica: tests/cpu/integration/test_peer_app.py)."""

import io

import numpy as np
import pytest
from PIL import Image

from stepserve.deployments.config import ModelConfig
from stepserve.load_tests.peers import PerRequestPeer, Rejected, parse

from tests.tiny import make_spec, solo_pipeline_image

MODEL = ModelConfig(name="tiny-sd", family="sd15", preset="tiny", default_size="64x64", max_size=128,
                    default_steps=5, max_steps=20)


def pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(int)


def expected(family, **request) -> np.ndarray:
    spec = make_spec("x", steps=request["num_inference_steps"], seed=request["seed"],
                     guidance=request["guidance_scale"], size=request["width"], prompt=request["prompt"])
    return np.rint(solo_pipeline_image(family, spec) * 255).astype(int)


def request(**kw):
    return parse({"prompt": "a red fox", "size": "64x64", "num_inference_steps": 4, "seed": 3, **kw}, MODEL)


def test_parse_fills_defaults_and_rejects_what_the_model_cannot_serve():
    parsed = parse({"prompt": "a fox", "model": "tiny-sd"}, MODEL)
    assert (parsed["width"], parsed["height"], parsed["num_inference_steps"], parsed["guidance_scale"]) == (
        64, 64, 5, 7.5)
    assert isinstance(parsed["seed"], int)
    for body, status, param in [({"prompt": "a", "model": "other"}, 404, "model"),
                                ({"prompt": "a", "n": 2}, 400, "n"),
                                ({"prompt": "a", "size": "4096x64"}, 400, "size"),
                                ({"prompt": "a", "size": "big"}, 400, "size"),
                                ({"prompt": "a", "num_inference_steps": 21}, 400, "num_inference_steps"),
                                ({"prompt": "a", "colour": "red"}, 400, None)]:
        with pytest.raises(Rejected) as info:
            parse(body, MODEL)
        assert (info.value.status, info.value.param) == (status, param), body


def test_the_per_request_peer_makes_the_pipelines_image():
    peer = PerRequestPeer(MODEL, torch_threads=1)
    r = request()
    assert np.abs(pixels(peer.generate(r)) - expected(peer.family, **r)).max() <= 1
