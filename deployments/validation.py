"""Turns an API request into validated `RequestSpec`s, or a 4xx naming the field.

Pure: no Ray, no I/O, so every rule is unit-tested directly.
"""

from __future__ import annotations

import re
import secrets
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from ..policies.types import RequestSpec
from .config import AppConfig, LimitsConfig, ModelConfig
from .errors import APIError, invalid
from .protocol import ImageGenerationRequest

SIZE = re.compile(r"^(\d{1,5})x(\d{1,5})$")
MAX_SEED = 2**63 - 1
VAE_MULTIPLE = 8  # SD-class VAEs downscale 8x; sizes must divide evenly
Body = TypeVar("Body", bound=BaseModel)


def parse_request(payload: object) -> ImageGenerationRequest:
    return parse_body(payload, ImageGenerationRequest)


def parse_body(payload: object, schema: type[Body]) -> Body:
    """`payload` as the pydantic request type `schema`, or a 400 naming the first bad field."""
    if isinstance(payload, schema):
        return payload
    if not isinstance(payload, dict):
        raise invalid(None, "request body must be a JSON object", code="invalid_json")
    try:
        return schema.model_validate(payload)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        message = "unknown field" if first["type"] == "extra_forbidden" else first["msg"]
        raise invalid(param, f"{param}: {message}") from None


def parse_size(size: str | None, model: ModelConfig, multiple: int = VAE_MULTIPLE) -> tuple[int, int]:
    text = model.default_size if size in (None, "auto") else size
    match = SIZE.match(text)
    if not match:
        raise invalid("size", f"size must look like '512x512' or be 'auto', got {size!r}")
    width, height = int(match.group(1)), int(match.group(2))
    for side in (width, height):
        if side % multiple:
            raise invalid("size", f"width and height must be multiples of {multiple}, got {text}")
        if not model.min_size <= side <= model.max_size:
            raise invalid("size", f"{model.name} accepts sides from {model.min_size} to {model.max_size} px, got {text}")
    if width * height > model.max_pixels:
        raise invalid("size", f"{text} exceeds {model.name}'s limit of {model.max_pixels} pixels")
    return width, height


def check_prompts(req: Any, limits: LimitsConfig) -> None:
    """The prompt is not blank, and neither it nor the negative prompt is over the limit."""
    if not req.prompt.strip():
        raise invalid("prompt", "prompt must not be empty")
    for name, text in (("prompt", req.prompt), ("negative_prompt", req.negative_prompt or "")):
        if len(text) > limits.max_prompt_chars:
            raise invalid(name, f"{name} is longer than {limits.max_prompt_chars} characters")


def sampling_settings(req: Any, model: ModelConfig, limits: LimitsConfig) -> tuple[int, float]:
    """(num_inference_steps, guidance_scale): the request's or the model's defaults, in range."""
    steps = model.default_steps if req.num_inference_steps is None else req.num_inference_steps
    if not 1 <= steps <= model.max_steps:
        raise invalid("num_inference_steps", f"num_inference_steps must be between 1 and {model.max_steps}")
    guidance = model.default_guidance_scale if req.guidance_scale is None else req.guidance_scale
    if not 0 <= guidance <= limits.max_guidance_scale:  # also rejects NaN
        raise invalid("guidance_scale", f"guidance_scale must be between 0 and {limits.max_guidance_scale}")
    return steps, guidance


def to_specs(payload: object, config: AppConfig, request_id: str) -> list[RequestSpec]:
    req = parse_request(payload)
    limits = config.limits
    # Without `model`, the first image model: the first configured one may make videos.
    if req.model is None:
        model = next((m for m in config.models if not m.is_video), None)
    else:
        model = config.model(req.model)
    if model is None:
        what = "no image model is served" if req.model is None else f"model {req.model!r} does not exist"
        raise APIError(404, f"{what}; see GET /v1/models", param="model", code="model_not_found")
    if model.is_video:
        raise invalid("model", f"{model.name} makes videos; use POST /v1/videos", code="unsupported_model")
    if req.response_format != "b64_json":
        raise invalid("response_format", "only response_format='b64_json' is supported")
    check_prompts(req, limits)
    if not 1 <= req.n <= limits.max_n:
        raise invalid("n", f"n must be between 1 and {limits.max_n}")
    steps, guidance = sampling_settings(req, model, limits)
    seed = secrets.randbelow(2**31) if req.seed is None else req.seed
    if not 0 <= seed <= MAX_SEED - req.n:
        raise invalid("seed", f"seed must be between 0 and {MAX_SEED - req.n}")
    width, height = parse_size(req.size, model)
    return [
        RequestSpec(
            request_id=request_id if req.n == 1 else f"{request_id}-{i}", model=model.name, prompt=req.prompt,
            negative_prompt=req.negative_prompt or "", width=width, height=height, num_inference_steps=steps,
            guidance_scale=guidance, seed=seed + i,
        )
        for i in range(req.n)
    ]
