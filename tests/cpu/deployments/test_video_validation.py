"""POST /v1/videos bodies: every bad input becomes a 4xx naming the field; good input an exact
`RequestSpec(kind=T2V)` on the frame and size grid its family declares."""

import math

import pytest

from stepserve.deployments.config import AppConfig
from stepserve.deployments.errors import APIError
from stepserve.deployments.validation import to_specs
from stepserve.deployments.video_validation import (
    VIDEO_ID,
    VideoCreateRequest,
    VideoGrid,
    to_video_spec,
    video_grid,
)
from stepserve.engine.families import DENOISER, FAMILIES, ModelSource, family_class, load_family
from stepserve.policies.types import RequestKind

IMAGE_MODEL = {"name": "tiny-sd", "preset": "tiny", "default_size": "128x128", "max_size": 512}
VIDEO_MODEL = {"name": "tiny-wan", "family": "wan", "preset": "tiny", "default_size": "64x48", "min_size": 16,
               "max_size": 256, "max_pixels": 256 * 128, "default_steps": 4, "max_steps": 50,
               "default_guidance_scale": 5.0, "default_num_frames": 9, "max_num_frames": 17, "default_fps": 8,
               "max_fps": 30}
# The SLO-aware co-serving policy, which needs a latency profile; video models run under any policy.
GENSERVE = {"policy": "genserve", "profiles": ["tiny-sd-cpu"]}
CONFIG = AppConfig.model_validate({"models": [IMAGE_MODEL, VIDEO_MODEL],
                                   "limits": {"max_prompt_chars": 100, "max_guidance_scale": 20}})


def spec(**body):
    return to_video_spec({"prompt": "a fox runs", **body}, CONFIG)


def rejects(param, status=400, **body):
    with pytest.raises(APIError) as info:
        spec(**body)
    err = info.value
    assert err.status == status, err
    assert err.param == param, err
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}
    return err


def test_defaults_come_from_the_first_video_model():
    out = spec()
    assert out.model == "tiny-wan" and VIDEO_ID.match(out.request_id)
    assert (out.width, out.height, out.num_frames, out.fps) == (64, 48, 9, 8)
    assert (out.num_inference_steps, out.guidance_scale, out.negative_prompt) == (4, 5.0, "")
    assert 0 <= out.seed < 2**31 and out.kind is RequestKind.T2V and out.is_video
    assert out.slo_s is None  # the model sets no SLO: best effort
    assert spec().request_id != out.request_id


def test_explicit_fields_pass_through():
    out = spec(model="tiny-wan", size="32x96", num_frames=13, fps=24, num_inference_steps=7, guidance_scale=1.0,
               negative_prompt="blurry", seed=123)
    assert (out.width, out.height, out.num_frames, out.fps) == (32, 96, 13, 24)
    assert (out.num_inference_steps, out.guidance_scale, out.negative_prompt, out.seed) == (7, 1.0, "blurry", 123)
    assert not out.uses_cfg


@pytest.mark.parametrize("seconds,fps,frames", [
    ("1", 8, 9),        # 8 frames → nearest 4k+1 is 9
    (2, 8, 17),         # 16 → 17
    (1.5, 8, 13),       # 12 → 13
    ("0.375", 8, 5),    # 3 is halfway between 1 and 5: ties go up
    (0.25, 8, 1),       # 2 → 1
    (0.01, 30, 1),      # never fewer than one frame
])
def test_seconds_round_to_frames_the_model_makes(seconds, fps, frames):
    assert spec(seconds=seconds, fps=fps).num_frames == frames


def test_odd_frame_count_is_refused_with_the_nearest_valid_ones():
    err = rejects("num_frames", num_frames=8)
    assert "5 and 9" in err.message


@pytest.mark.parametrize("body,param", [
    ({"num_frames": 9, "seconds": "1"}, "seconds"),      # ambiguous
    ({"seconds": "3"}, "seconds"),                        # 24 frames → 25 > max_num_frames 17
    ({"seconds": 0}, "seconds"), ({"seconds": -1}, "seconds"), ({"seconds": "nan"}, "seconds"),
    ({"seconds": "inf"}, "seconds"), ({"seconds": "4s"}, "seconds"), ({"seconds": True}, "seconds"),
    ({"seconds": [4]}, "seconds"), ({"seconds": ""}, "seconds"),
    ({"num_frames": 0}, "num_frames"), ({"num_frames": -3}, "num_frames"), ({"num_frames": 21}, "num_frames"),
    ({"num_frames": 10**9}, "num_frames"), ({"num_frames": "many"}, "num_frames"), ({"num_frames": 9.5}, "num_frames"),
    ({"fps": 0}, "fps"), ({"fps": 31}, "fps"), ({"fps": 2.5}, "fps"), ({"fps": "fast"}, "fps"),
    ({"size": "72x72"}, "size"), ({"size": "64x50"}, "size"), ({"size": "0x0"}, "size"), ({"size": "8x16"}, "size"),
    ({"size": "512x16"}, "size"), ({"size": "256x256"}, "size"), ({"size": "99999x99999"}, "size"),
    ({"size": "64*64"}, "size"), ({"size": ""}, "size"), ({"size": 64}, "size"), ({"size": "-64x64"}, "size"),
    ({"num_inference_steps": 0}, "num_inference_steps"), ({"num_inference_steps": 51}, "num_inference_steps"),
    ({"num_inference_steps": "x"}, "num_inference_steps"),
    ({"guidance_scale": -1}, "guidance_scale"), ({"guidance_scale": 20.5}, "guidance_scale"),
    ({"guidance_scale": math.nan}, "guidance_scale"), ({"guidance_scale": math.inf}, "guidance_scale"),
    ({"seed": -1}, "seed"), ({"seed": 2**63}, "seed"), ({"seed": "x"}, "seed"),
    ({"prompt": "   "}, "prompt"), ({"prompt": "x" * 101}, "prompt"), ({"prompt": None}, "prompt"),
    ({"prompt": ["a"]}, "prompt"), ({"negative_prompt": "y" * 101}, "negative_prompt"),
    ({"input_reference": "data:image/png;base64,AAAA"}, "input_reference"),
    ({"quality": "hd"}, "quality"),
])
def test_bad_inputs_are_400_naming_the_field(body, param):
    rejects(param, **body)


def test_unknown_model_is_404():
    err = rejects("model", status=404, model="sora-2")
    assert err.code == "model_not_found"


def test_image_model_is_refused_for_video_and_video_model_for_images():
    err = rejects("model", model="tiny-sd")
    assert err.code == "unsupported_model" and "/v1/images/generations" in err.message
    with pytest.raises(APIError) as info:
        to_specs({"prompt": "a cat", "model": "tiny-wan"}, CONFIG, "r")
    assert (info.value.status, info.value.param, info.value.code) == (400, "model", "unsupported_model")
    assert "/v1/videos" in info.value.message


def test_each_api_defaults_to_its_own_kind_of_model():
    video_first = AppConfig.model_validate({"models": [VIDEO_MODEL, IMAGE_MODEL]})
    (image,) = to_specs({"prompt": "a cat"}, video_first, "r")
    assert image.model == "tiny-sd"
    assert to_video_spec({"prompt": "a fox"}, video_first).model == "tiny-wan"


def test_no_video_model_served_is_404():
    images_only = AppConfig.model_validate({"models": [IMAGE_MODEL]})
    with pytest.raises(APIError) as info:
        to_video_spec({"prompt": "a fox"}, images_only)
    assert (info.value.status, info.value.code) == (404, "model_not_found")
    assert "no video model" in info.value.message


def test_body_must_be_an_object_and_typed_requests_pass():
    with pytest.raises(APIError, match="JSON object"):
        to_video_spec(["prompt"], CONFIG)
    out = to_video_spec(VideoCreateRequest(prompt="a fox", seconds="2", fps=8, seed=1), CONFIG, "video_given")
    assert (out.request_id, out.num_frames, out.seed) == ("video_given", 17, 1)


def test_form_strings_are_accepted():
    # OpenAI's clients post multipart forms, where every value is a string.
    out = spec(seconds="2", fps="8", num_inference_steps="3", guidance_scale="4.5", seed="9", size="32x32")
    assert (out.num_frames, out.fps, out.num_inference_steps, out.guidance_scale, out.seed) == (17, 8, 3, 4.5, 9)


def test_default_frames_off_the_grid_are_rounded_within_the_limit():
    config = AppConfig.model_validate({"models": [{**VIDEO_MODEL, "default_num_frames": 16, "max_num_frames": 16}]})
    assert to_video_spec({"prompt": "a fox"}, config).num_frames == 13


def test_config_rejects_defaults_above_limits():
    with pytest.raises(ValueError, match="default_num_frames"):
        AppConfig.model_validate({"models": [{**VIDEO_MODEL, "default_num_frames": 33}]})
    with pytest.raises(ValueError, match="default_fps"):
        AppConfig.model_validate({"models": [{**VIDEO_MODEL, "default_fps": 31}]})


def test_grid_rounding():
    grid = VideoGrid(size_multiple=16, frame_step=4)
    assert [grid.nearest(n) for n in (0, 1, 2, 3, 4, 5, 6, 7, 81, 83)] == [1, 1, 1, 5, 5, 5, 5, 9, 81, 85]
    assert grid.accepts(81) and not grid.accepts(80)


def test_the_grid_comes_from_the_family_class():
    assert video_grid("wan") == VideoGrid(size_multiple=16, frame_step=4)
    with pytest.raises(ValueError, match="unknown model family"):
        video_grid("sora")


def test_every_video_family_has_a_grid_and_it_matches_the_model():
    video_families = {name for name, cls in FAMILIES.items() if cls.kind is RequestKind.T2V}
    assert "wan" in video_families
    for name in video_families:
        cls = family_class(name)
        assert video_grid(name) == VideoGrid(cls.size_multiple, cls.frame_step)
    wan = load_family(ModelSource(name="tiny-wan", family="wan", preset="tiny"), {DENOISER})
    grid = video_grid("wan")
    assert (wan.vae_scale_factor * wan.transformer.config.patch_size[1], wan.vae_scale_factor_temporal) == (
        grid.size_multiple, grid.frame_step)
    # What validation accepts, the family generates unchanged.
    out = spec(size="32x96", num_frames=13)
    assert wan.video_shape(out.height, out.width, out.num_frames) == (96, 32, 13)


def test_sizes_follow_the_family_grid():
    assert (spec(size="16x16").width, spec(size="128x32").height) == (16, 32)
    err = rejects("size", size="24x24")  # a multiple of 8 (SD's grid) but not of Wan's 16
    assert "multiples of 16" in err.message


def test_slo_comes_from_the_model_config():
    config = AppConfig.model_validate({"models": [{**VIDEO_MODEL, "slo_s": 45.0},
                                                  {**VIDEO_MODEL, "name": "wan-best-effort"}]})
    assert to_video_spec({"prompt": "a fox"}, config).slo_s == 45.0
    assert to_video_spec({"prompt": "a fox", "model": "wan-best-effort"}, config).slo_s is None
    with pytest.raises(ValueError, match="slo_s"):
        AppConfig.model_validate({"models": [{**VIDEO_MODEL, "slo_s": 0}]})


def test_a_request_slo_overrides_the_model_slo():
    """As for images (`test_request_slo`): a video's own `slo_s`, or a 400 naming it."""
    config = AppConfig.model_validate({"models": [{**VIDEO_MODEL, "slo_s": 45.0}]})
    assert to_video_spec({"prompt": "a fox", "slo_s": 12.5}, config).slo_s == 12.5
    for bad in (0, -1.0, math.inf, "soon"):
        with pytest.raises(APIError) as info:
            to_video_spec({"prompt": "a fox", "slo_s": bad}, config)
        assert (info.value.status, info.value.param) == (400, "slo_s")


def test_default_seed_is_used_only_when_the_body_has_none():
    # An idempotent retry of a seedless body passes the key's seed: both attempts draw the same.
    assert to_video_spec({"prompt": "a fox"}, CONFIG, default_seed=77).seed == 77
    assert to_video_spec({"prompt": "a fox", "seed": 5}, CONFIG, default_seed=77).seed == 5
    assert to_video_spec({"prompt": "a fox", "seed": 0}, CONFIG, default_seed=77).seed == 0  # 0 is a seed
    drawn = {to_video_spec({"prompt": "a fox"}, CONFIG).seed for _ in range(8)}
    assert len(drawn) > 1 and all(0 <= s < 2**31 for s in drawn)  # without either: random


def test_video_models_run_under_any_policy_and_policy_options_are_checked():
    for router in ({}, {"policy": "continuous"}, {"policy": "static_fcfs"}, GENSERVE):
        config = AppConfig.model_validate({"models": [IMAGE_MODEL, VIDEO_MODEL], "router": router})
        assert [m.is_video for m in config.models] == [False, True]
    with pytest.raises(ValueError, match="router.profiles"):
        AppConfig.model_validate({"models": [VIDEO_MODEL], "router": {"policy": "genserve"}})
    with pytest.raises(ValueError, match="sp_degrees"):
        AppConfig.model_validate({"models": [VIDEO_MODEL], "router": {**GENSERVE,
                                                                      "policy_options": {"sp_degrees": [2, 1]}}})
    with pytest.raises(ValueError, match="bogus"):
        AppConfig.model_validate({"models": [VIDEO_MODEL], "router": {**GENSERVE, "policy_options": {"bogus": 1}}})
    config = AppConfig.model_validate({"models": [VIDEO_MODEL], "workers": {"max_batch_size": 3},
                                       "router": {**GENSERVE, "policy_options": {"sp_degrees": [1, 2]}}})
    assert config.policy_options() == {"sp_degrees": (1, 2), "image_max_batch": 3, "pack_resolutions": False}
