"""Every bad input becomes a 4xx naming the field; good input becomes exact specs."""

import json
import math
import pickle

import pytest

from stepserve.deployments.config import AppConfig
from stepserve.deployments.errors import APIError
from stepserve.deployments.validation import to_specs

CONFIG = AppConfig.model_validate({
    "models": [{"name": "tiny-sd", "preset": "tiny", "default_size": "128x128", "max_size": 512,
                "max_pixels": 512 * 512, "default_steps": 20, "max_steps": 100}],
    "limits": {"max_n": 4, "max_prompt_chars": 100, "max_guidance_scale": 20},
})


def specs(**body):
    return to_specs({"prompt": "a cat", **body}, CONFIG, "req")


def rejects(param, status=400, **body):
    with pytest.raises(APIError) as info:
        specs(**body)
    assert info.value.status == status, info.value
    assert info.value.param == param, info.value
    return info.value


def test_defaults_come_from_the_model():
    (spec,) = specs()
    assert (spec.width, spec.height, spec.num_inference_steps, spec.guidance_scale) == (128, 128, 20, 7.5)
    assert spec.model == "tiny-sd" and spec.request_id == "req" and 0 <= spec.seed < 2**31


def test_n_images_get_consecutive_seeds_and_ids():
    out = specs(n=3, seed=10, size="64x128", num_inference_steps=5, guidance_scale=1.0, negative_prompt="x")
    assert [s.seed for s in out] == [10, 11, 12]
    assert [s.request_id for s in out] == ["req-0", "req-1", "req-2"]
    assert all((s.width, s.height) == (64, 128) and not s.uses_cfg for s in out)


@pytest.mark.parametrize("size", ["100x100", "64x60", "8x8", "1024x64", "512x513", "abc", "64*64", "-64x64",
                                  "6400000x64", ""])
def test_bad_sizes(size):
    rejects("size", size=size)


def test_pixel_budget():
    config = AppConfig.model_validate({"models": [{"name": "m", "preset": "tiny", "max_size": 512,
                                                   "max_pixels": 256 * 256, "default_size": "256x256"}]})
    with pytest.raises(APIError, match="pixels"):
        to_specs({"prompt": "x", "size": "512x256"}, config, "r")


@pytest.mark.parametrize("field,value", [
    ("num_inference_steps", 0), ("num_inference_steps", 101), ("num_inference_steps", -5),
    ("guidance_scale", -1), ("guidance_scale", 20.5), ("guidance_scale", math.nan), ("guidance_scale", math.inf),
    ("n", 0), ("n", 5), ("seed", -1), ("seed", 2**63),
])
def test_out_of_range(field, value):
    rejects(field, **{field: value})


@pytest.mark.parametrize("field,value", [
    ("num_inference_steps", "many"), ("n", 1.5), ("size", 512), ("prompt", None), ("prompt", ["a"]),
    ("seed", "x"), ("response_format", "jpeg"),
])
def test_wrong_types(field, value):
    rejects(field, **{field: value})


def test_prompts():
    rejects("prompt", prompt="   ")
    rejects("prompt", prompt="x" * 101)
    rejects("negative_prompt", negative_prompt="y" * 101)


@pytest.mark.parametrize("field", ["prompt", "negative_prompt"])
@pytest.mark.parametrize("raw", [r'"\ud800"', r'"a fox \udfff"', r'"\udc00\ud83e"', r'"ok \ud83e\ud83e\udd8a"'])
def test_unpaired_surrogates_are_refused(field, raw):
    # JSON may escape a lone surrogate; json.loads turns it into a str no UTF-8 tokenizer takes.
    err = rejects(field, **{field: json.loads(raw)})
    assert err.code == "invalid_value" and err.message.startswith(f"{field} contains an unpaired surrogate")


@pytest.mark.parametrize("field", ["prompt", "negative_prompt"])
@pytest.mark.parametrize("char", ["\x00", "\x01", "\x08", "\x0b", "\x0c", "\x1b", "\x1f"])
def test_control_characters_are_refused(field, char):
    err = rejects(field, **{field: f"a{char}b"})
    assert f"U+{ord(char):04X}" in err.message


def test_real_text_passes():
    # An escaped surrogate *pair* is one real character: JSON's way of writing the fox emoji.
    body = json.loads(r'{"prompt": "café 東京 🦊\tline\r\nnext", "negative_prompt": "\ud83e\udd8a e\u0301"}')
    (spec,) = specs(**body)
    assert spec.prompt == "café 東京 🦊\tline\r\nnext" and spec.negative_prompt == "🦊 e\u0301"


def test_slo_comes_from_the_model():
    config = AppConfig.model_validate({"models": [{"name": "fast", "preset": "tiny", "slo_s": 2.5},
                                                  {"name": "slow", "preset": "tiny"}]})
    assert [s.slo_s for s in to_specs({"prompt": "x", "model": "fast", "n": 2}, config, "r")] == [2.5, 2.5]
    assert to_specs({"prompt": "x", "model": "slow"}, config, "r")[0].slo_s is None


def test_guidance_is_classifier_free_only_where_the_family_says_so():
    config = AppConfig.model_validate({"models": [
        {"name": "sd3", "family": "sd3", "preset": "tiny", "default_size": "64x64", "max_size": 512},
        {"name": "flux", "family": "flux", "preset": "tiny", "default_size": "64x64", "default_guidance_scale": 3.5},
    ]})
    (sd3,) = to_specs({"prompt": "x", "model": "sd3"}, config, "r")
    (flux,) = to_specs({"prompt": "x", "model": "flux", "negative_prompt": "fog"}, config, "r")
    assert sd3.cfg and sd3.uses_cfg and sd3.rows == 2
    # Flux is guidance-distilled: the scale is kept (the model takes it as an input), in one row.
    assert not flux.cfg and flux.guidance_scale == 3.5 and not flux.uses_cfg and flux.rows == 1
    with pytest.raises(APIError, match="multiples of 16"):
        to_specs({"prompt": "x", "model": "flux", "size": "72x72"}, config, "r")


def test_unknown_model_is_404():
    err = rejects("model", status=404, model="sdxl")
    assert err.code == "model_not_found"


def test_url_response_format_is_refused():
    rejects("response_format", response_format="url")


def test_unknown_fields_are_named():
    err = rejects("quality_boost", quality_boost=True)
    assert "unknown field" in err.message


def test_body_must_be_an_object():
    with pytest.raises(APIError, match="JSON object"):
        to_specs(["prompt"], CONFIG, "r")


def test_error_shape_and_pickling():
    err = APIError(400, "bad size", param="size", code="invalid_value")
    assert err.body() == {"error": {"message": "bad size", "type": "invalid_request_error", "param": "size",
                                    "code": "invalid_value"}}
    again = pickle.loads(pickle.dumps(err))
    assert isinstance(again, APIError) and again.body() == err.body() and again.status == 400
    assert APIError(503, "x").type == "server_error"


def test_config_rejects_nonsense():
    with pytest.raises(ValueError, match="unique"):
        AppConfig.model_validate({"models": [{"name": "a", "preset": "tiny"}, {"name": "a", "preset": "tiny"}]})
    with pytest.raises(ValueError, match="exactly one"):
        AppConfig.model_validate({"models": [{"name": "a"}]})
    with pytest.raises(ValueError, match="family"):
        AppConfig.model_validate({"models": [{"name": "a", "preset": "tiny", "family": "nope"}]})
    with pytest.raises(ValueError):
        AppConfig.model_validate({"models": [{"name": "a", "preset": "tiny"}], "workers": {"num_workers": 0}})
    with pytest.raises(ValueError):
        AppConfig.model_validate({"models": [{"name": "a", "preset": "tiny"}], "typo": 1})
