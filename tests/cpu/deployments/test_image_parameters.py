"""OpenAI's image parameters (`quality`, `output_format`, `output_compression`, `background`,
`moderation`, `style`, `input_fidelity`, `user`, `safety_identifier`): each accepted value has a
defined effect, each value this server cannot honour is a 400 naming it, and the official
`openai` client's calls work unchanged, for generations and edits alike."""

import asyncio
import base64
import io
import logging

import numpy as np
import PIL.Image
import pytest
from prometheus_client.parser import text_string_to_metric_families

from stepserve.deployments import images as images_module
from stepserve.deployments.config import AppConfig, ModelConfig
from stepserve.deployments.edit_validation import to_edit_specs
from stepserve.deployments.errors import APIError
from stepserve.deployments.image_output import ImageOutput, encode, output_for
from stepserve.deployments.protocol import ImageEditRequest, ImageGenerationRequest
from stepserve.deployments.validation import to_specs
from stepserve.engine.png import encode_png
from tests.cpu.deployments import fakes
from tests.cpu.deployments.fakes import assert_error, build, fake_png, http_client
from tests.cpu.deployments.test_addons_api import multipart
from tests.cpu.deployments.test_edits_api import EDITS, body as edit_body, mask_png, picture

CONFIG = AppConfig.model_validate({"models": [{"name": "tiny-sd", "preset": "tiny", "default_size": "64x64",
                                               "default_steps": 20, "max_steps": 30}]})
CAT = {"prompt": "a cat", "size": "64x96", "seed": 3}


def steps_of(**body) -> int:
    (spec,) = to_specs({"prompt": "a cat", **body}, CONFIG, "req")
    return spec.num_inference_steps


def refused(call, param: str, code: str = "invalid_value") -> APIError:
    with pytest.raises(APIError) as info:
        call()
    assert (info.value.status, info.value.param, info.value.code) == (400, param, code), info.value
    return info.value


def picture_png(width: int, height: int, seed: int = 0, noise: float = 0.0) -> bytes:
    """A PNG as the decoder writes it (`encode_png`): smooth shapes, plus uniform noise when asked."""
    y, x = np.mgrid[0:height, 0:width]
    image = np.stack([x / width, y / height, 0.5 + 0.25 * np.sin(x / 5 + seed) * np.cos(y / 7)], axis=-1)
    noisy = (1 - noise) * image + noise * np.random.default_rng(seed).random(image.shape)
    return encode_png(noisy.astype(np.float32))


def decoded(data: bytes) -> PIL.Image.Image:
    image = PIL.Image.open(io.BytesIO(data))
    image.load()
    return image


def pixels(data: bytes) -> np.ndarray:
    return np.asarray(decoded(data).convert("RGB"), dtype=np.float64)


# -- quality: a step preset per model -----------------------------------------------------------


def test_quality_presets_derive_from_default_steps():
    model = CONFIG.models[0]
    assert [model.quality_steps(p) for p in ("low", "medium", "high")] == [10, 20, 30]  # high: 2x capped at max
    odd = ModelConfig(name="m", preset="tiny", default_steps=5)
    assert [odd.quality_steps(p) for p in ("low", "medium", "high")] == [3, 5, 10]
    one = ModelConfig(name="m", preset="tiny", default_steps=1, max_steps=1)
    assert [one.quality_steps(p) for p in ("low", "medium", "high")] == [1, 1, 1]
    own = ModelConfig(name="m", preset="tiny", default_steps=20, low_quality_steps=4, high_quality_steps=50)
    assert [own.quality_steps(p) for p in ("low", "medium", "high")] == [4, 20, 50]


@pytest.mark.parametrize("fields", [
    {"low_quality_steps": 21},  # above medium
    {"high_quality_steps": 19},  # below medium
    {"high_quality_steps": 151},  # above max_steps
    {"default_steps": 160},  # medium itself above max_steps
    {"low_quality_steps": 0},
])
def test_quality_presets_are_checked(fields):
    with pytest.raises(ValueError):
        ModelConfig(name="m", preset="tiny", **{"default_steps": 20, **fields})


@pytest.mark.parametrize("quality, steps", [
    (None, 20), ("auto", 20), ("medium", 20), ("standard", 20), ("low", 10), ("high", 30), ("hd", 30),
])
def test_quality_picks_the_models_preset(quality, steps):
    assert steps_of(quality=quality) == steps


@pytest.mark.parametrize("quality", [None, "low", "high", "auto"])
def test_explicit_steps_win_over_quality(quality):
    assert steps_of(quality=quality, num_inference_steps=7) == 7


@pytest.mark.parametrize("quality, code", [("xhigh", "unsupported_value"), ("max", "unsupported_value"),
                                           ("ultra", "invalid_value"), ("LOW", "invalid_value")])
def test_qualities_not_served_are_400_listing_the_served_ones(quality, code):
    for extra in ({}, {"num_inference_steps": 7}):  # refused even where the steps are explicit
        error = refused(lambda: steps_of(quality=quality, **extra), "quality", code)
        assert "low, medium, high, auto, standard, hd" in error.message


def test_an_edits_quality_sets_its_steps_before_strength_cuts_them():
    config = AppConfig.model_validate(EDITS)
    spec = to_edit_specs(edit_body(model="tiny-sd3", quality="low", strength=0.5), config, "e")[0][0]
    # tiny-sd3: default_steps 10, so 'low' is 5 steps, of which strength 0.5 runs the last half.
    assert (spec.num_inference_steps, spec.steps_to_run) == (5, 3)
    spec = to_edit_specs(edit_body(model="tiny-sd3", quality="high", num_inference_steps=4), config, "e")[0][0]
    assert spec.num_inference_steps == 4


# -- output_format, output_compression, background ----------------------------------------------


@pytest.mark.parametrize("fields, output", [
    ({}, ("png", 100, "medium")),
    ({"output_format": "png", "output_compression": 100, "background": "opaque"}, ("png", 100, "medium")),
    ({"output_format": "jpeg", "quality": "low"}, ("jpeg", 100, "low")),  # OpenAI's default compression: 100
    ({"output_format": "webp", "output_compression": 0, "background": "auto"}, ("webp", 0, "medium")),
    ({"output_format": "jpeg", "num_inference_steps": 5, "quality": "hd"}, ("jpeg", 100, None)),  # steps ran
])
def test_output_settings(fields, output):
    assert output_for(ImageGenerationRequest(prompt="x", **fields)) == ImageOutput(*output)


@pytest.mark.parametrize("fields, param, code", [
    ({"output_format": "gif"}, "output_format", "unsupported_value"),
    ({"output_format": "svg"}, "output_format", "unsupported_value"),
    ({"output_format": "bmp"}, "output_format", "invalid_value"),
    ({"output_format": "jpeg", "output_compression": 101}, "output_compression", "invalid_value"),
    ({"output_format": "webp", "output_compression": -1}, "output_compression", "invalid_value"),
    ({"output_compression": 80}, "output_compression", "unsupported_value"),  # png is lossless
    ({"output_format": "png", "output_compression": 0}, "output_compression", "unsupported_value"),
    ({"background": "transparent"}, "background", "unsupported_value"),
    ({"background": "transparent", "output_format": "webp"}, "background", "unsupported_value"),
    ({"background": "black"}, "background", "invalid_value"),
])
def test_outputs_not_served_are_400(fields, param, code):
    error = refused(lambda: output_for(ImageGenerationRequest(prompt="x", **fields)), param, code)
    if fields.get("background") == "transparent":
        assert "alpha channel" in error.message


def test_png_is_the_decoders_own_bytes():
    png = picture_png(64, 48)
    assert encode(png, ImageOutput("png", 100, "medium")) is png
    not_even_a_png = b"\x89PNG\r\n\x1a\nnot decoded"  # nothing reads it
    assert encode(not_even_a_png, ImageOutput("png", 100, "medium")) == not_even_a_png


@pytest.mark.parametrize("fmt, pil_format", [("jpeg", "JPEG"), ("webp", "WEBP")])
def test_lossy_formats_decode_to_the_same_picture(fmt, pil_format):
    png = picture_png(96, 64)
    for compression, tolerance in ((100, 2.0), (50, 4.0)):
        data = encode(png, ImageOutput(fmt, compression, "medium"))
        image = decoded(data)
        assert (image.format, image.size, image.mode) == (pil_format, (96, 64), "RGB")
        assert np.abs(pixels(data) - pixels(png)).mean() < tolerance


@pytest.mark.parametrize("fmt", ["jpeg", "webp"])
def test_higher_output_compression_keeps_more(fmt):
    # OpenAI's output_compression defaults to 100, its best: higher keeps more (bigger, closer files).
    png = picture_png(96, 64, noise=0.3)
    files = [encode(png, ImageOutput(fmt, c, "medium")) for c in (0, 10, 50, 90, 100)]
    sizes = [len(f) for f in files]
    assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes), sizes
    errors = [np.abs(pixels(f) - pixels(png)).mean() for f in files]
    assert errors == sorted(errors, reverse=True), errors


# -- over HTTP and through handles ---------------------------------------------------------------


@pytest.fixture
def real_pngs(monkeypatch):
    """The fake router answers with real PNGs of each spec's size, as the decoder writes them."""
    monkeypatch.setattr(fakes, "fake_png", lambda spec: picture_png(spec.width, spec.height, spec.seed))


def images_of(response) -> list[bytes]:
    assert response.status_code == 200, response.text
    return [base64.b64decode(item["b64_json"]) for item in response.json()["data"]]


def test_a_generation_answers_in_the_format_asked_for(http, router, real_pngs):
    for fmt, pil_format in (("jpeg", "JPEG"), ("webp", "WEBP"), ("png", "PNG")):
        response = http.post("/v1/images/generations", json={**CAT, "n": 2, "output_format": fmt, "quality": "low"})
        files = images_of(response)
        assert [decoded(f).format for f in files] == [pil_format, pil_format]
        assert all(decoded(f).size == (64, 96) for f in files)
        body = response.json()
        assert {k: body[k] for k in ("output_format", "quality", "size", "background")} == {
            "output_format": fmt, "quality": "low", "size": "64x96", "background": "opaque"}
        spec = router.specs[router.submitted[-1]]
        assert spec.num_inference_steps == 15  # tiny-sd's default_steps 30: low is half
        reference = picture_png(64, 96, spec.seed)
        assert np.abs(pixels(files[-1]) - pixels(reference)).mean() < 2.0


def test_the_png_path_returns_the_routers_bytes_unchanged(http, router):
    # The fake router's "PNG" is not even an image: a decode or re-encode anywhere would fail.
    response = http.post("/v1/images/generations", json={**CAT, "output_format": "png", "background": "auto"})
    (image,) = images_of(response)
    assert image == fake_png(router.specs[router.submitted[0]])
    assert response.json()["output_format"] == "png" and response.json()["quality"] == "medium"


def test_explicit_steps_report_no_quality_preset(http, router):
    response = http.post("/v1/images/generations", json={**CAT, "quality": "high", "num_inference_steps": 4})
    assert response.status_code == 200 and response.json()["quality"] is None
    assert router.specs[router.submitted[0]].num_inference_steps == 4


@pytest.mark.parametrize("fields, param, code", [
    ({"output_format": "gif"}, "output_format", "unsupported_value"),
    ({"background": "transparent"}, "background", "unsupported_value"),
    ({"output_compression": 50}, "output_compression", "unsupported_value"),
    ({"output_format": "jpeg", "output_compression": 150}, "output_compression", "invalid_value"),
    ({"output_format": "jpeg", "output_compression": 50.5}, "output_compression", "invalid_value"),
    ({"quality": "xhigh"}, "quality", "unsupported_value"),
    ({"moderation": "high"}, "moderation", "invalid_value"),
    ({"style": "cartoon"}, "style", "invalid_value"),
    ({"user": "u" * 257}, "user", "invalid_value"),
    ({"user": "u\x00"}, "user", "invalid_value"),
    ({"safety_identifier": "s" * 257}, "safety_identifier", "invalid_value"),
    ({"input_fidelity": "high"}, "input_fidelity", "invalid_value"),  # an edit parameter: unknown here
    ({"partial_images": 2}, "partial_images", "invalid_value"),  # OpenAI's, but not served: unknown
])
def test_bad_parameters_are_400_before_anything_is_queued(http, router, fields, param, code):
    assert_error(http.post("/v1/images/generations", json={**CAT, **fields}), 400, code, param)
    assert router.submitted == []


def test_hints_are_logged_with_the_request_id_and_counted(app, monkeypatch, caplog):
    with http_client(app.ingress, monkeypatch) as http, caplog.at_level(logging.INFO, logger="stepserve.images"):
        for _ in range(2):
            http.post("/v1/images/generations", json={**CAT, "moderation": "low", "style": "vivid", "user": "u1\nx"})
        http.post("/v1/images/generations", json={**CAT, "style": "natural"})
        http.post("/v1/images/generations", json=CAT)  # gives none: logs nothing
        text = http.get("/metrics").text
    counts = {(s.labels["param"], s.labels["value"]): s.value for family in text_string_to_metric_families(text)
              for s in family.samples if s.name == "stepserve_image_hints_total"}
    assert counts == {("moderation", "low"): 2, ("style", "vivid"): 2, ("style", "natural"): 1}
    lines = [r.getMessage() for r in caplog.records if r.name == "stepserve.images"]
    assert len(lines) == 3 and all(line.startswith("image request img-") for line in lines)
    assert lines[0].endswith("moderation='low' style='vivid' user='u1\\nx'")  # one line, whatever the text


def test_edit_form_fields_parse_as_openai_clients_send_them(monkeypatch, real_pngs):
    monkeypatch.setattr(images_module.ray, "put", lambda value: value)
    with http_client(build(**EDITS).ingress, monkeypatch) as http:
        form = multipart({"prompt": "a cat", "model": "tiny-sd3", "output_format": "webp", "output_compression": "40",
                          "quality": "high", "background": "opaque", "input_fidelity": "low", "user": "u2"},
                         {"image": picture(), "mask": mask_png()})
        response = http.post("/v1/images/edits", **form)
        (image,) = images_of(response)
        assert decoded(image).format == "WEBP" and response.json()["quality"] == "high"
        bad = multipart({"prompt": "a cat", "output_compression": "lots"}, {"image": picture(), "mask": mask_png()})
        assert_error(http.post("/v1/images/edits", **bad), 400, "invalid_value", "output_compression")
        for field in ({"moderation": "low"}, {"style": "vivid"}):  # not edit parameters in OpenAI's API either
            form = multipart({"prompt": "a cat", **field}, {"image": picture(), "mask": mask_png()})
            assert_error(http.post("/v1/images/edits", **form), 400, "invalid_value", next(iter(field)))


def test_handle_callers_get_the_same_outputs(real_pngs, monkeypatch):
    monkeypatch.setattr(images_module.ray, "put", lambda value: value)
    app = build(**EDITS)

    async def scenario():
        made = await app.ingress.generate(ImageGenerationRequest(prompt="a cat", output_format="jpeg",
                                                                 output_compression=60, quality="hd"))
        edited = await app.ingress.edit(ImageEditRequest(**edit_body(output_format="webp", quality="low")))
        with pytest.raises(APIError) as info:
            await app.ingress.edit(edit_body(background="transparent"))
        return made, edited, info.value

    made, edited, error = asyncio.run(scenario())
    assert decoded(base64.b64decode(made["data"][0]["b64_json"])).format == "JPEG" and made["quality"] == "high"
    assert decoded(base64.b64decode(edited["data"][0]["b64_json"])).format == "WEBP" and edited["size"] == "64x64"
    assert (error.status, error.param) == (400, "background")


def test_the_stored_answer_of_a_retry_keeps_its_format(http, router, real_pngs):
    key = {"Idempotency-Key": "jpeg-1"}
    first = http.post("/v1/images/generations", json={**CAT, "output_format": "jpeg"}, headers=key)
    again = http.post("/v1/images/generations", json={**CAT, "output_format": "jpeg"}, headers=key)
    assert again.json() == first.json() and len(router.submitted) == 1
    # Another format is another request body: not a retry.
    other = http.post("/v1/images/generations", json={**CAT, "output_format": "webp"}, headers=key)
    assert_error(other, 409, "idempotency_key_reused")


def test_the_openai_client(monkeypatch, real_pngs):
    from openai import OpenAI

    monkeypatch.setattr(images_module.ray, "put", lambda value: value)
    app = build(**EDITS)
    with http_client(app.ingress, monkeypatch) as http:
        client = OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http)
        for fmt, pil_format in (("jpeg", "JPEG"), ("webp", "WEBP"), ("png", "PNG")):
            result = client.images.generate(prompt="a cat", model="tiny-sd", size="64x64", quality="high",
                                            output_format=fmt, background="opaque", moderation="low", style="vivid",
                                            user="u1", extra_body={"seed": 1})
            assert decoded(base64.b64decode(result.data[0].b64_json)).format == pil_format
            assert (result.output_format, result.quality, result.size, result.background) == (
                fmt, "high", "64x64", "opaque")
            assert app.router.specs[app.router.submitted[-1]].num_inference_steps == 60  # 2 x tiny-sd's 30
        result = client.images.edit(image=("photo.png", picture(), "image/png"),
                                    mask=("mask.png", mask_png(), "image/png"), prompt="a cat", model="tiny-sd3",
                                    output_format="jpeg", output_compression=70, quality="low", background="auto",
                                    input_fidelity="high", user="u1")
        assert decoded(base64.b64decode(result.data[0].b64_json)).format == "JPEG"
        assert (result.output_format, result.quality) == ("jpeg", "low")
        with pytest.raises(Exception) as error:  # the client's BadRequestError, OpenAI-shaped
            client.images.generate(prompt="a cat", output_format="gif")
        assert error.value.status_code == 400 and error.value.body["param"] == "output_format"
