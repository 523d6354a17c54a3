"""POST /v1/images/edits: OpenAI's multipart shape (and JSON, and the handle), the official
client's `images.edit`, and every bad image or mask refused with a 4xx before anything is queued."""

import asyncio
import base64
import io

import numpy as np
import PIL.Image
import pytest

from stepserve.deployments import images as images_module
from stepserve.deployments.config import AppConfig
from stepserve.deployments.edit_validation import template_identity, to_edit_specs
from stepserve.engine.families.sd3 import SD3Family
from stepserve.policies.types import LoraUse, RequestKind
from tests.cpu.deployments.fakes import CONFIG, assert_error, build, http_client
from tests.cpu.deployments.test_addons_api import bomb, multipart

EDITS = {
    "models": CONFIG["models"] + [{"name": "tiny-sd3", "family": "sd3", "preset": "tiny", "default_size": "64x64",
                                    "max_size": 256, "default_steps": 10},
                                   {"name": "tiny-flux", "family": "flux", "preset": "tiny", "default_size": "64x64"}],
    "loras": [{"name": "papercut", "model": "tiny-sd", "preset": "tiny", "seed": 11}],
    "limits": {"max_body_bytes": 1 << 20, "max_image_bytes": 64 << 10, "max_image_pixels": 512 * 512},
}


def encoded(image: PIL.Image.Image, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def picture(width: int = 64, height: int = 64) -> bytes:
    return encoded(PIL.Image.fromarray(np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)))


def mask_png(width: int = 64, height: int = 64, box=(16, 16, 40, 32), mode: str = "RGBA") -> bytes:
    """OpenAI's mask: opaque, with the edit area (`box`: left, top, right, bottom) fully transparent."""
    alpha = np.full((height, width), 255, dtype=np.uint8)
    left, top, right, bottom = box
    alpha[top:bottom, left:right] = 0
    rgba = np.dstack([np.zeros((height, width, 3), dtype=np.uint8), alpha])
    return encoded(PIL.Image.fromarray(rgba, mode="RGBA").convert(mode))


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def body(**extra):
    return {"prompt": "a cat on the sofa", "image": b64(picture()), "mask": b64(mask_png()), **extra}


@pytest.fixture
def app():
    return build(**EDITS)


@pytest.fixture
def http(app, monkeypatch):
    monkeypatch.setattr(images_module.ray, "put", lambda value: value)  # no object store in these tests
    with http_client(app.ingress, monkeypatch) as client:
        yield client


def test_a_form_body_reaches_the_router_as_an_edit_with_its_pixels(http, app):
    form = multipart({"prompt": "a cat", "model": "tiny-sd3", "n": "2", "strength": "0.6", "seed": "7",
                      "num_inference_steps": "10", "template_id": "sofa-v1", "response_format": "b64_json",
                      "slo_s": "2.5"},
                     {"image": picture(), "mask": mask_png()})
    response = http.post("/v1/images/edits", **form)
    assert response.status_code == 200, response.text
    assert [d["seed"] for d in response.json()["data"]] == [7, 8]
    (first, (inputs,), _), (second, _, _) = app.router.submit.calls
    assert (first.kind, first.model, first.strength) == (RequestKind.EDIT, "tiny-sd3", 0.6)
    assert first.template_id == second.template_id == template_identity("sofa-v1", inputs.image)
    assert (first.width, first.height) == (64, 64) and second.seed == 8 and first.slo_s == second.slo_s == 2.5
    # SD3's inpaint pipeline keeps the fraction of a step: 10 x 0.6 runs 6 steps, skipping 4.
    assert (first.skip_steps, first.steps_to_run) == (SD3Family.skipped_steps(10, 0.6), 6) == (4, 6)
    # The box is 24 x 16 pixels of 64 x 64: 3 x 2 of the 8 x 8 latents.
    assert first.mask_ratio == pytest.approx(6 / 64)
    assert inputs.image.shape == (64, 64, 3) and inputs.image.dtype == np.uint8
    assert inputs.mask.shape == (64, 64) and set(np.unique(inputs.mask)) == {0, 255}
    assert inputs.mask[16:32, 16:40].min() == 255 and inputs.mask.sum() == 255 * 24 * 16


def test_a_template_is_its_name_and_its_image():
    """Another image sent under a template's name is another template (it records anew): it never
    gets the first image's cached activations."""
    config = AppConfig.model_validate(EDITS)

    def template(image: bytes, name: str = "sofa") -> str:
        (spec,), _ = to_edit_specs({**body(template_id=name), "image": b64(image)}, config, "e")
        return spec.template_id

    other = encoded(PIL.Image.fromarray(np.full((64, 64, 3), 7, dtype=np.uint8)))
    assert template(picture()) == template(picture()) != template(other)
    assert template(picture()).startswith("sofa#") and template(picture(), "sofa2") != template(picture())


def test_json_bodies_and_handle_callers_send_base64(http, app):
    response = http.post("/v1/images/edits", json=body(size="128x128", loras=[{"name": "papercut", "scale": 0.5}]))
    assert response.status_code == 200, response.text
    spec, (inputs,), _ = app.router.submit.calls[-1]
    # Without `model`, the first model that edits; resized to the size asked for, mask and all.
    assert (spec.model, spec.width, spec.skip_steps, spec.loras) == ("tiny-sd", 128, 0, (LoraUse("papercut", 0.5),))
    assert inputs.image.shape == (128, 128, 3) and inputs.mask.shape == (128, 128)
    answer = asyncio.run(app.ingress.edit(body(model="tiny-sd3")))  # a DeploymentHandle caller's call
    assert len(answer["data"]) == 1 and app.router.submit.calls[-1][0].model == "tiny-sd3"


def test_openai_client_images_edit(http, app):
    from openai import OpenAI

    client = OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http)
    result = client.images.edit(image=("photo.png", picture(), "image/png"), mask=("mask.png", mask_png(), "image/png"),
                                prompt="a cat", model="tiny-sd3", n=1, size="64x64",
                                extra_body={"strength": 0.5, "seed": 3, "num_inference_steps": 4})
    assert result.data[0].b64_json
    spec, *_ = app.router.submit.calls[-1]
    assert (spec.kind, spec.strength, spec.seed, spec.steps_to_run) == (RequestKind.EDIT, 0.5, 3, 2)
    with pytest.raises(Exception) as error:  # a bad mask is the client's BadRequestError, OpenAI-shaped
        client.images.edit(image=("photo.png", picture(), "image/png"), prompt="a cat",
                           mask=("mask.png", mask_png(mode="RGB"), "image/png"))
    assert error.value.status_code == 400 and error.value.body["param"] == "mask"


@pytest.mark.parametrize("extra, status, code, param", [
    (dict(mask=b64(mask_png(mode="RGB"))), 400, "invalid_mask", "mask"),  # no alpha channel
    (dict(mask=b64(encoded(PIL.Image.new("RGBA", (64, 64)), "WEBP"))), 400, "invalid_mask", "mask"),  # not a PNG
    (dict(mask=b64(mask_png(width=48))), 400, "invalid_mask", "mask"),  # not the image's size
    (dict(mask=b64(mask_png(box=(0, 0, 0, 0)))), 400, "invalid_value", "mask"),  # nothing to edit
    (dict(mask=b64(mask_png(box=(3, 3, 5, 5))), size="64x64"), 400, "invalid_value", "mask"),  # gone at latents
    (dict(mask="%%% not base64"), 400, "invalid_image", "mask"),
    (dict(image=b64(bomb())), 400, "image_too_large", "image"),
    (dict(image=b64(bytes(70 << 10))), 413, "image_too_large", "image"),
    (dict(image=b64(encoded(PIL.Image.new("RGB", (600, 600))))), 400, "image_too_large", "image"),
    (dict(image=b64(picture(60, 60)), mask=b64(mask_png(60, 60))), 400, "invalid_value", "size"),  # not a multiple
    (dict(model="tiny-flux"), 400, "unsupported_model", "model"),
    (dict(model="tiny-wan"), 400, "unsupported_model", "model"),
    (dict(model="dall-e-2"), 404, "model_not_found", "model"),
    (dict(strength=0), 400, "invalid_value", "strength"),
    (dict(strength=1.5), 400, "invalid_value", "strength"),
    (dict(strength=0.05, num_inference_steps=10), 400, "invalid_value", "strength"),  # no step left
    (dict(template_id="../etc/passwd"), 400, "invalid_value", "template_id"),
    (dict(controlnets=[]), 400, "invalid_value", "controlnets"),
    (dict(loras=[{"name": "watercolor"}]), 404, "lora_not_found", "loras.0.name"),
    (dict(response_format="url"), 400, "invalid_value", "response_format"),
])
def test_bad_edits_are_refused_before_anything_is_queued(http, app, extra, status, code, param):
    assert_error(http.post("/v1/images/edits", json=body(**extra)), status, code, param)
    assert app.router.submitted == []
    assert http.post("/v1/images/edits", json=body()).status_code == 200  # nothing else disturbed


@pytest.mark.parametrize("fields, files, param", [
    ({}, {"image": picture()}, "mask"),  # no mask
    ({}, {"image": picture(), "image[]": picture(), "mask": mask_png()}, "image"),  # two images
    ({"mask": b64(mask_png())}, {"image": picture(), "mask": mask_png()}, "mask"),  # a field and a file
    ({"loras": "[{not json"}, {"image": picture(), "mask": mask_png()}, "loras"),
    ({}, {"image": picture(), "mask": mask_png(), "extra": picture()}, "extra"),
])
def test_bad_form_bodies_are_refused(http, app, fields, files, param):
    response = http.post("/v1/images/edits", **multipart({"prompt": "a cat", **fields}, files))
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert app.router.submitted == []
