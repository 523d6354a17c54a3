"""ControlNets and LoRAs on /v1/images/generations: listed by GET /v1/models, unknown names 404,
bad values and bad control images 400/413 before anything is queued; a good request reaches the
router with its uses in its spec and its control images decoded and resized."""

import base64
import io
import json
import struct
import zlib

import numpy as np
import PIL.Image
import pytest

from stepserve.deployments import images as images_module
from stepserve.deployments.config import AppConfig
from stepserve.policies.types import ControlNetUse, LoraUse
from tests.cpu.deployments.fakes import CONFIG, assert_error, build, http_client

ADDONS = {
    "models": CONFIG["models"] + [{"name": "tiny-sd3", "family": "sd3", "preset": "tiny", "default_size": "64x64",
                                        "max_size": 256}],
    "controlnets": [{"name": "canny", "model": "tiny-sd", "preset": "tiny", "seed": 1},
                    {"name": "depth", "model": "tiny-sd", "preset": "tiny", "seed": 2}],
    "loras": [{"name": "papercut", "model": "tiny-sd", "preset": "tiny", "seed": 11}],
    "limits": {"max_body_bytes": 1 << 20, "max_controlnets": 2, "max_image_bytes": 64 << 10,
               "max_image_pixels": 512 * 512},
}


def png(width: int = 32, height: int = 24, mode: str = "RGB") -> bytes:
    out = io.BytesIO()
    PIL.Image.new(mode, (width, height), 128).save(out, format="PNG")
    return out.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def bomb(side: int = 60_000) -> bytes:
    """A valid PNG header declaring side x side pixels, with almost no data: decoding it would
    take gigabytes."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) \
        + chunk(b"IEND", b"")


@pytest.fixture
def app():
    return build(**ADDONS)


@pytest.fixture
def http(app, monkeypatch):
    with http_client(app.ingress, monkeypatch) as client:
        yield client


def body(**extra):
    return {"prompt": "a house", "size": "64x64", **extra}


def test_models_lists_the_addons_served_for_each_model(http):
    entries = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    assert entries["tiny-sd"]["controlnets"] == ["canny", "depth"] and entries["tiny-sd"]["loras"] == ["papercut"]
    assert entries["tiny-sd3"]["kind"] == "t2i" and "controlnets" not in entries["tiny-sd3"]


@pytest.mark.parametrize("extra, status, code, param", [
    (dict(controlnets=[{"name": "scribble", "image": b64(png())}]), 404, "controlnet_not_found", "controlnets.0.name"),
    (dict(loras=[{"name": "watercolor"}]), 404, "lora_not_found", "loras.0.name"),
    (dict(model="tiny-sd3", loras=[{"name": "papercut"}]), 400, "invalid_value", "loras"),
    (dict(controlnets=[{"name": "canny", "image": b64(png())}] * 3), 400, "invalid_value", "controlnets"),
    (dict(controlnets=[{"name": "canny", "image": b64(png()), "conditioning_scale": 9}]), 400, "invalid_value",
     "controlnets.0.conditioning_scale"),
    (dict(controlnets=[{"name": "canny", "image": b64(png()), "start": 0.5, "end": 0.5}]), 400, "invalid_value",
     "controlnets.0.start"),
    (dict(loras=[{"name": "papercut"}, {"name": "papercut", "scale": 0.5}]), 400, "invalid_value", "loras"),
    (dict(loras=[{"name": "papercut", "extra": 1}]), 400, "invalid_value", "loras.0.extra"),
    (dict(controlnets=[{"name": "canny", "image": "%%% not base64"}]), 400, "invalid_image", "controlnets.0.image"),
    (dict(controlnets=[{"name": "canny", "image": b64(b"GIF89a" + bytes(64))}]), 400, "invalid_image",
     "controlnets.0.image"),
    (dict(controlnets=[{"name": "canny", "image": b64(png()[:60])}]), 400, "invalid_image", "controlnets.0.image"),
    (dict(controlnets=[{"name": "canny", "image": b64(bomb())}]), 400, "image_too_large", "controlnets.0.image"),
    (dict(controlnets=[{"name": "canny", "image": b64(png(600, 600))}]), 400, "image_too_large",
     "controlnets.0.image"),
    (dict(controlnets=[{"name": "canny", "image": b64(bytes(70 << 10))}]), 413, "image_too_large",
     "controlnets.0.image"),
])
def test_bad_addon_requests_are_refused_before_anything_is_queued(http, router, extra, status, code, param):
    assert_error(http.post("/v1/images/generations", json=body(**extra)), status, code, param)
    assert router.submitted == []
    assert http.post("/v1/images/generations", json=body()).status_code == 200  # nothing else disturbed


def test_a_good_request_reaches_the_router_with_its_addons(http, router, monkeypatch):
    monkeypatch.setattr(images_module.ray, "put", lambda value: value)  # no object store in these tests
    image = PIL.Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 30, 3), dtype=np.uint8))
    out = io.BytesIO()
    image.save(out, format="PNG")
    request = body(n=2, controlnets=[{"name": "depth", "image": f"data:image/png;base64,{b64(out.getvalue())}",
                                      "conditioning_scale": 0.5, "end": 0.8},
                                     {"name": "canny", "image": b64(png(mode="RGBA"))}],
                   loras=[{"name": "papercut", "scale": -0.5}])
    response = http.post("/v1/images/generations", json=request)
    assert response.status_code == 200, response.text
    (first, (inputs,), _), (second, (same,), _) = router.submit.calls
    assert first.controlnets == second.controlnets == (ControlNetUse("depth", 0.5, 0.0, 0.8), ControlNetUse("canny"))
    assert first.loras == (LoraUse("papercut", -0.5),)
    pixels, pixels_again = inputs.control, same.control
    assert [p.shape for p in pixels] == [(64, 64, 3), (64, 64, 3)] and all(p.dtype == np.uint8 for p in pixels)
    np.testing.assert_array_equal(pixels[0], np.array(image.resize((64, 64), PIL.Image.LANCZOS)))
    assert all(np.array_equal(a, b) for a, b in zip(pixels, pixels_again))


def multipart(fields: dict, files: dict) -> dict:
    """httpx's arguments for a multipart/form-data body: text fields and file parts."""
    return {"data": {k: v if isinstance(v, str) else json.dumps(v) for k, v in fields.items()},
            "files": {name: (f"{name}.png", data, "image/png") for name, data in files.items()}}


def test_control_images_may_come_as_file_parts_of_a_form_body(http, router, monkeypatch):
    monkeypatch.setattr(images_module.ray, "put", lambda value: value)
    image = PIL.Image.fromarray(np.random.default_rng(1).integers(0, 256, (30, 40, 3), dtype=np.uint8))
    out = io.BytesIO()
    image.save(out, format="PNG")
    controlnets = [{"name": "depth", "conditioning_scale": 0.5}, {"name": "canny", "image": b64(png())}]
    form = multipart({"prompt": "a house", "size": "64x64", "num_inference_steps": "5", "guidance_scale": "6.5",
                      "seed": "3", "controlnets": controlnets, "loras": [{"name": "papercut"}]},
                     {"controlnets.0.image": out.getvalue()})
    response = http.post("/v1/images/generations", **form)
    assert response.status_code == 200, response.text
    ((spec, (inputs,), _),) = router.submit.calls
    pixels = inputs.control
    assert (spec.num_inference_steps, spec.guidance_scale, spec.seed) == (5, 6.5, 3)
    assert spec.controlnets == (ControlNetUse("depth", 0.5), ControlNetUse("canny")) and spec.loras == (
        LoraUse("papercut"),)
    np.testing.assert_array_equal(pixels[0], np.array(image.resize((64, 64), PIL.Image.LANCZOS)))


@pytest.mark.parametrize("fields, files, status, code, param", [
    ({"controlnets": [{"name": "canny"}]}, {"controlnets.1.image": png()}, 400, "invalid_value",
     "controlnets.1.image"),  # no entry 1
    ({"controlnets": [{"name": "canny", "image": b64(png())}]}, {"controlnets.0.image": png()}, 400,
     "invalid_value", "controlnets.0.image"),  # twice
    ({"controlnets": [{"name": "canny"}]}, {"mask": png()}, 400, "unsupported_value", "mask"),
    ({"controlnets": "[{not json"}, {}, 400, "invalid_json", "controlnets"),
    ({"controlnets": [{"name": "canny"}]}, {}, 400, "invalid_value", "controlnets.0.image"),  # no image at all
    ({"controlnets": [{"name": "canny"}]}, {"controlnets.0.image": b"GIF89a" + bytes(64)}, 400, "invalid_image",
     "controlnets.0.image"),
    ({"controlnets": [{"name": "canny"}]}, {"controlnets.0.image": bomb()}, 400, "image_too_large",
     "controlnets.0.image"),
    ({"controlnets": [{"name": "canny"}]}, {"controlnets.0.image": bytes(70 << 10)}, 413, "image_too_large",
     "controlnets.0.image"),
    ({"num_inference_steps": "many"}, {}, 400, "invalid_value", "num_inference_steps"),
])
def test_bad_form_bodies_are_refused_before_anything_is_queued(http, router, fields, files, status, code, param):
    response = http.post("/v1/images/generations", **multipart({"prompt": "a house", "size": "64x64", **fields},
                                                               files))
    assert_error(response, status, code, param)
    assert router.submitted == []
    assert http.post("/v1/images/generations", json=body()).status_code == 200


def test_addon_config_is_checked():
    with pytest.raises(ValueError, match="model 'nope' is not served"):
        AppConfig.model_validate({**ADDONS, "loras": [{"name": "x", "model": "nope", "preset": "tiny"}]})
    with pytest.raises(ValueError, match="takes no ControlNets or LoRAs"):
        AppConfig.model_validate({**ADDONS, "loras": [{"name": "x", "model": "tiny-sd3", "preset": "tiny"}]})
    with pytest.raises(ValueError, match="does not fit model"):
        AppConfig.model_validate({**ADDONS, "loras": [{"name": "x", "model": "tiny-sd", "preset": "full"}]})
    with pytest.raises(ValueError, match="unique per model"):
        AppConfig.model_validate({**ADDONS, "loras": ADDONS["loras"] * 2})
    with pytest.raises(ValueError, match="exactly one of preset or path"):
        AppConfig.model_validate({**ADDONS, "loras": [{"name": "x", "model": "tiny-sd"}]})
