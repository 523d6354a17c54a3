"""Turns a `POST /v1/videos` body into a validated video `RequestSpec`, or a 4xx naming the field.

The body follows OpenAI's Videos API (`model`, `prompt`, `size`, `seconds`) plus the extensions
stepserve's image API has (`negative_prompt`, `num_inference_steps`, `guidance_scale`, `seed`)
and two of its own (`num_frames`, `fps`). Pure: no Ray, no I/O.

Frame counts: a video family generates exactly what it is asked only for some counts (Wan:
4k+1). A `num_frames` the caller names must be one of them, or the request is refused with the
nearest valid counts in the message; frames the server works out itself (`seconds` x `fps`, or
the model's default) are rounded to the nearest valid count, ties upward, and the video object
reports the resulting `num_frames` and `seconds`.
"""

from __future__ import annotations

import math
import re
import secrets
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from stepserve.deployments.config import AppConfig, ModelConfig
from stepserve.deployments.errors import APIError, invalid
from stepserve.deployments.validation import (MAX_SEED, check_prompts, parse_body, parse_size, request_slo,
                                               sampling_settings)
from stepserve.engine.families import family_class
from stepserve.policies.types import RequestKind, RequestSpec

VIDEO_ID = re.compile(r"^video_[0-9a-f]{32}$")


class VideoCreateRequest(BaseModel):
    # Unknown fields are an error, not silently ignored: a typo must not change the video.
    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(description="What the video shows.")
    model: str | None = Field(default=None, description="Served video model id; defaults to the first video model.")
    size: str | None = Field(
        default=None, description="'WIDTHxHEIGHT' (sides a multiple of the model's size multiple) or 'auto'."
    )
    seconds: float | None = Field(
        default=None,
        description="Clip length, as OpenAI sends it ('4') or a number; frames = seconds x fps, rounded to the "
                    "nearest count the model accepts. Excludes num_frames.",
    )
    num_frames: int | None = Field(
        default=None, description="Exact frame count (extension; Wan: 4k+1). Excludes seconds."
    )
    fps: int | None = Field(default=None, description="Frames per second of the video file (extension).")
    negative_prompt: str | None = Field(default=None, description="What to steer away from (needs CFG).")
    num_inference_steps: int | None = Field(default=None, description="Denoising steps.")
    guidance_scale: float | None = Field(default=None, description="Classifier-free guidance; <= 1 turns CFG off.")
    seed: int | None = Field(default=None, description="Noise seed; random when omitted (returned in `seed`).")
    slo_s: float | None = Field(default=None, description="Latency objective in seconds from arrival, for SLO-aware "
                                                          "policies; overrides the model's `slo_s` (extension).")
    input_reference: Any = Field(
        default=None, description="OpenAI's image-to-video reference; not supported, rejected with 400."
    )

    @field_validator("seconds", mode="before")
    @classmethod
    def _seconds_as_number(cls, value: Any) -> Any:
        # OpenAI's clients send seconds as a string ("4"); JSON callers may send a number. A
        # boolean is neither, although Python would count it as an int.
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise ValueError("must be a number of seconds such as '4' or 2.5")
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"must be a number of seconds such as '4' or 2.5, got {value!r}") from None


@dataclass(frozen=True)
class VideoGrid:
    """What a video family generates exactly as asked: sides divisible by `size_multiple`, and
    1 + k*`frame_step` frames (the VAE compresses time `frame_step`x and keeps frame 0 alone)."""

    size_multiple: int
    frame_step: int

    def accepts(self, num_frames: int) -> bool:
        return (num_frames - 1) % self.frame_step == 0

    def nearest(self, num_frames: float) -> int:
        """The valid count nearest to `num_frames` (ties upward), at least 1."""
        k = math.floor((num_frames - 1) / self.frame_step + 0.5)
        return 1 + self.frame_step * max(k, 0)


def video_grid(family: str) -> VideoGrid:
    """The frame and size grid a video family declares on its class (`size_multiple`, `frame_step`)."""
    cls = family_class(family)
    return VideoGrid(size_multiple=cls.size_multiple, frame_step=cls.frame_step)


def new_video_id() -> str:
    return f"video_{secrets.token_hex(16)}"


def video_model(name: str | None, config: AppConfig) -> ModelConfig:
    """The named video model, or the first one served; 404 if none, 400 for an image model."""
    if name is None:
        model = next((m for m in config.models if m.is_video), None)
    else:
        model = config.model(name)
    if model is None:
        what = "no video model is served" if name is None else f"model {name!r} does not exist"
        raise APIError(404, f"{what}; see GET /v1/models", param="model", code="model_not_found")
    if not model.is_video:
        raise invalid("model", f"{model.name} makes images; use POST /v1/images/generations or a video model",
                      code="unsupported_model")
    return model


def frame_count(req: VideoCreateRequest, model: ModelConfig, grid: VideoGrid, fps: int) -> int:
    limit = model.max_num_frames
    if req.num_frames is not None and req.seconds is not None:
        raise invalid("seconds", "give seconds or num_frames, not both")
    if req.num_frames is not None:
        n = req.num_frames
        if not 1 <= n <= limit:
            raise invalid("num_frames", f"num_frames must be between 1 and {limit} for {model.name}")
        if not grid.accepts(n):
            below = n - (n - 1) % grid.frame_step
            raise invalid("num_frames", f"{model.name} generates 1 + {grid.frame_step}k frames; "
                                        f"got {n}, nearest are {below} and {below + grid.frame_step}")
        return n
    if req.seconds is not None:
        if not 0 < req.seconds < math.inf:  # also rejects NaN
            raise invalid("seconds", "seconds must be a positive number")
        n = grid.nearest(req.seconds * fps)
        if n > limit:
            raise invalid("seconds", f"{req.seconds:g} s at {fps} fps is {n} frames; {model.name} makes at most "
                                     f"{limit} frames ({limit / fps:g} s at {fps} fps)")
        return n
    # The configured default, kept on the grid; a default above the limit fails config validation.
    n = grid.nearest(model.default_num_frames)
    return n if n <= limit else n - grid.frame_step


def to_video_spec(payload: object, config: AppConfig, video_id: str | None = None,
                  default_seed: int | None = None) -> RequestSpec:
    """`default_seed`: the seed when the body has none (an idempotent retry must draw the same)."""
    req = parse_body(payload, VideoCreateRequest)
    limits = config.limits
    model = video_model(req.model, config)
    grid = video_grid(model.family)
    if req.input_reference is not None:
        raise invalid("input_reference", "input_reference (image-to-video) is not supported", code="unsupported_value")
    check_prompts(req, limits)
    fps = model.default_fps if req.fps is None else req.fps
    if not 1 <= fps <= model.max_fps:
        raise invalid("fps", f"fps must be between 1 and {model.max_fps}")
    num_frames = frame_count(req, model, grid, fps)
    steps, guidance = sampling_settings(req, model, limits)
    if req.seed is not None:
        seed = req.seed
    else:
        seed = secrets.randbelow(2**31) if default_seed is None else default_seed
    if not 0 <= seed <= MAX_SEED:
        raise invalid("seed", f"seed must be between 0 and {MAX_SEED}")
    width, height = parse_size(req.size, model, multiple=grid.size_multiple)
    return RequestSpec(
        request_id=video_id or new_video_id(), model=model.name, prompt=req.prompt, width=width, height=height,
        num_inference_steps=steps, guidance_scale=guidance, seed=seed, negative_prompt=req.negative_prompt or "",
        kind=RequestKind.T2V, num_frames=num_frames, fps=fps, slo_s=request_slo(req, model),
    )
