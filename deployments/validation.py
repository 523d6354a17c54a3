"""Turns an API request into validated `RequestSpec`s, or a 4xx naming the field.

Pure: no Ray, no I/O, so every rule is unit-tested directly.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from stepserve.deployments.config import AppConfig, LimitsConfig, ModelConfig, check_size
from stepserve.deployments.errors import APIError, invalid
from stepserve.deployments.protocol import ControlNetInput, ImageGenerationRequest, LoraInput
from stepserve.engine.addons.source import AddonKind
from stepserve.engine.families import family_class
from stepserve.engine.forward_modes.base import ModeName
from stepserve.policies.types import ControlNetUse, LoraUse, RequestSpec, StepCacheMethod

MAX_SEED = 2**63 - 1
MAX_SLO_S = 24 * 3600.0  # a day: beyond it an objective schedules nothing differently from none
MAX_USER_CHARS = 256  # `user` and `safety_identifier` go into the log: bounded
# OpenAI's `quality` values this server honours, and the step preset each names.
QUALITY_PRESETS = {"low": "low", "medium": "medium", "high": "high", "auto": "medium", "standard": "medium",
                   "hd": "high"}
# C0 controls but tab, LF and CR: invisible, never part of a real prompt, and NUL cuts text short
# wherever it reaches C strings (native libraries, log pipelines).
CONTROL_CHARS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f]")
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
        raise invalid(param, f"{param}: {message}" if param else message) from None


def parse_size(size: str | None, model: ModelConfig, multiple: int) -> tuple[int, int]:
    """`multiple`: the family's `size_multiple` (its VAE downscale, times its patch size for DiTs)."""
    try:
        return check_size(model.default_size if size in (None, "auto") else size, model, multiple)
    except ValueError as exc:
        raise invalid("size", str(exc)) from None


def check_prompts(req: Any, limits: LimitsConfig) -> None:
    """The prompt is not blank; it and the negative prompt are within the limit and clean text."""
    if not req.prompt.strip():
        raise invalid("prompt", "prompt must not be empty")
    for name, text in (("prompt", req.prompt), ("negative_prompt", req.negative_prompt or "")):
        if len(text) > limits.max_prompt_chars:
            raise invalid(name, f"{name} is longer than {limits.max_prompt_chars} characters")
        check_text(name, text)


def check_text(name: str, text: str) -> None:
    """`text` encodes as UTF-8 and holds no control character but tab, newline and CR.

    JSON's "\\ud800" parses to a str with a lone surrogate, which passes pydantic but makes the
    text encoder's tokenizer raise, failing every request batched with it; it must stop here.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # UTF-8 encodes every code point but the surrogates
        raise invalid(name, f"{name} contains an unpaired surrogate (U+{ord(text[exc.start]):04X}) at "
                            f"character {exc.start}; send valid Unicode text") from None
    control = CONTROL_CHARS.search(text)
    if control:
        raise invalid(name, f"{name} contains the control character U+{ord(control.group()):04X} at character "
                            f"{control.start()}; only tab, newline and carriage return are allowed")


def sampling_settings(req: Any, model: ModelConfig, limits: LimitsConfig,
                      preset_steps: int | None = None) -> tuple[int, float]:
    """(num_inference_steps, guidance_scale): the request's or the defaults, in range. `preset_steps`:
    the steps when the request gives none (an image's quality preset); None: the model's default_steps."""
    default_steps = model.default_steps if preset_steps is None else preset_steps
    steps = default_steps if req.num_inference_steps is None else req.num_inference_steps
    if not 1 <= steps <= model.max_steps:
        raise invalid("num_inference_steps", f"num_inference_steps must be between 1 and {model.max_steps}")
    guidance = model.default_guidance_scale if req.guidance_scale is None else req.guidance_scale
    if not 0 <= guidance <= limits.max_guidance_scale:  # also rejects NaN
        raise invalid("guidance_scale", f"guidance_scale must be between 0 and {limits.max_guidance_scale}")
    return steps, guidance


def quality_preset(req: Any) -> str | None:
    """The step preset ('low', 'medium', 'high') an image request's `quality` names, or None when its
    num_inference_steps decides (explicit steps win). A value this server cannot honour is a 400
    even then: a request must not look as if it ran at a quality it did not."""
    preset = QUALITY_PRESETS.get("auto" if req.quality is None else req.quality)
    if preset is None:
        code = "unsupported_value" if req.quality in ("xhigh", "max") else "invalid_value"
        raise invalid("quality", f"quality {req.quality!r} is not served; use one of {', '.join(QUALITY_PRESETS)} "
                                 "('auto' and 'standard' are 'medium', 'hd' is 'high')", code=code)
    return None if req.num_inference_steps is not None else preset


def check_end_user(req: Any) -> None:
    """`user` and `safety_identifier` are logged: bounded, and text that cannot break a log line's encoding."""
    for name in ("user", "safety_identifier"):
        text = getattr(req, name)
        if text is None:
            continue
        if len(text) > MAX_USER_CHARS:
            raise invalid(name, f"{name} is longer than {MAX_USER_CHARS} characters")
        check_text(name, text)


def request_slo(req: Any, model: ModelConfig) -> float | None:
    """The request's latency objective (seconds from arrival) or, without one, the model's: a
    workload whose requests differ in size holds each to its own (PatchedServe: 5x its solo latency)."""
    if req.slo_s is None:
        return model.slo_s
    if not 0 < req.slo_s <= MAX_SLO_S:  # also rejects NaN and infinities
        raise invalid("slo_s", f"slo_s must be a number of seconds in (0, {MAX_SLO_S:g}]")
    return req.slo_s


def request_step_cache(req: Any, model: ModelConfig) -> tuple[float, StepCacheMethod]:
    """The request's step-cache threshold and method or, without them, the model's; the threshold
    within the model's fidelity floor, and only where its family has the step cache."""
    method = model.step_cache_method if req.step_cache_method is None else StepCacheMethod(req.step_cache_method)
    if req.step_cache is None:
        return model.step_cache, method
    if not 0 <= req.step_cache <= model.max_step_cache:  # also rejects NaN and infinities
        raise invalid("step_cache", f"step_cache must be in [0, {model.max_step_cache:g}] for model {model.name} "
                                    "(its max_step_cache)")
    if req.step_cache and ModeName.STEP_CACHE not in family_class(model.family).forward_modes:
        raise invalid("step_cache", f"model {model.name} ({model.family}) has no step cache; send 0 or omit it",
                      code="unsupported_value")
    return req.step_cache, method


def request_skip_cfg(req: Any, model: ModelConfig) -> tuple[float, float | None]:
    """The fraction of the request's steps from which it skips CFG, by its own quality S or, without
    one, its model's; S within the model's fidelity floor, and below 1 only where the model has a
    measured curve. Then the earliest a worker's load controller may move that start to: where the
    curve keeps the floor (`min_skip_cfg_quality`); None for S = 1 (exact stays exact)."""
    quality = model.skip_cfg_quality if req.skip_cfg_quality is None else req.skip_cfg_quality
    if req.skip_cfg_quality is not None:
        if not model.min_skip_cfg_quality <= quality <= 1:  # also rejects NaN
            raise invalid("skip_cfg_quality", f"skip_cfg_quality must be in [{model.min_skip_cfg_quality:g}, 1] for "
                                              f"model {model.name} (its min_skip_cfg_quality)")
        if quality < 1 and not model.skip_cfg_curve:
            raise invalid("skip_cfg_quality", f"model {model.name} has no measured skip_cfg_curve; send 1 or omit it",
                          code="unsupported_value")
    start = model.skip_cfg_from(quality)
    return start, None if quality == 1 else min(start, model.skip_cfg_from(model.min_skip_cfg_quality))


def served_model(config: AppConfig, name: str | None, default: Callable[[ModelConfig], bool],
                 nothing: str) -> ModelConfig:
    """The model a request names, or without a name the first that `default` accepts; 404 when
    there is none (`nothing` says what is missing then)."""
    model = next((m for m in config.models if default(m)), None) if name is None else config.model(name)
    if model is None:
        what = nothing if name is None else f"model {name!r} does not exist"
        raise APIError(404, f"{what}; see GET /v1/models", param="model", code="model_not_found")
    return model


def image_settings(req: Any, model: ModelConfig, limits: LimitsConfig,
                   default_seed: int | None) -> tuple[int, float, int]:
    """(steps, guidance, seed) of an image request, generation or edit, after the checks they
    share: response format, prompts, end-user ids, n, sampling settings (the quality preset's
    steps unless num_inference_steps is given) and seed (`default_seed` when the body has none: an
    idempotent retry must draw the same)."""
    if req.response_format != "b64_json":
        raise invalid("response_format", "only response_format='b64_json' is supported")
    check_prompts(req, limits)
    check_end_user(req)
    if not 1 <= req.n <= limits.max_n:
        raise invalid("n", f"n must be between 1 and {limits.max_n}")
    preset = quality_preset(req)
    steps, guidance = sampling_settings(req, model, limits, None if preset is None else model.quality_steps(preset))
    if req.seed is not None:
        seed = req.seed
    else:
        seed = secrets.randbelow(2**31) if default_seed is None else default_seed
    if not 0 <= seed <= MAX_SEED - req.n:
        raise invalid("seed", f"seed must be between 0 and {MAX_SEED - req.n}")
    return steps, guidance, seed


def to_specs(payload: object, config: AppConfig, request_id: str, default_seed: int | None = None) -> list[RequestSpec]:
    """`default_seed`: the seed when the body has none (an idempotent retry must draw the same)."""
    req = parse_request(payload)
    # Without `model`, the first image model: the first configured one may make videos.
    model = served_model(config, req.model, lambda m: not m.is_video, "no image model is served")
    if model.is_video:
        raise invalid("model", f"{model.name} makes videos; use POST /v1/videos", code="unsupported_model")
    steps, guidance, seed = image_settings(req, model, config.limits, default_seed)
    family = family_class(model.family)
    width, height = parse_size(req.size, model, family.size_multiple)
    controlnets, loras = addon_uses(req.controlnets or [], req.loras or [], model, config)
    slo = request_slo(req, model)
    step_cache, step_cache_method = request_step_cache(req, model)
    skip_cfg_from, skip_cfg_floor_from = request_skip_cfg(req, model)
    return [
        RequestSpec(
            request_id=request_id if req.n == 1 else f"{request_id}-{i}", model=model.name, prompt=req.prompt,
            negative_prompt=req.negative_prompt or "", width=width, height=height, num_inference_steps=steps,
            guidance_scale=guidance, seed=seed + i, slo_s=slo, cfg=family.classifier_free_guidance,
            controlnets=controlnets, loras=loras, step_cache=step_cache, step_cache_method=step_cache_method,
            skip_cfg_from=skip_cfg_from, skip_cfg_floor_from=skip_cfg_floor_from,
        )
        for i in range(req.n)
    ]


def addon_uses(controlnet_inputs: list[ControlNetInput], lora_inputs: list[LoraInput], model: ModelConfig,
               config: AppConfig) -> tuple[tuple[ControlNetUse, ...], tuple[LoraUse, ...]]:
    """A request's ControlNets and LoRAs (not yet their images): served for `model` (404
    otherwise), within the limits."""
    limits = config.limits
    requested = (("controlnets", AddonKind.CONTROLNET, controlnet_inputs, limits.max_controlnets),
                 ("loras", AddonKind.LORA, lora_inputs, limits.max_loras))
    for field, kind, items, most in requested:
        if items and not family_class(model.family).takes_addons:
            raise invalid(field, f"{model.name} ({model.family}) takes no ControlNets or LoRAs")
        if len(items) > most:
            raise invalid(field, f"at most {most} {field} per request, got {len(items)}")
        for i, item in enumerate(items):
            if config.addon(kind, model.name, item.name) is None:
                raise APIError(404, f"{kind.value} {item.name!r} is not served for {model.name}; see GET /v1/models",
                               param=f"{field}.{i}.name", code=f"{kind.value}_not_found")
    bound = limits.max_addon_scale
    controlnets = []
    for i, c in enumerate(controlnet_inputs):
        if not 0 <= c.conditioning_scale <= bound:  # also rejects NaN
            raise invalid(f"controlnets.{i}.conditioning_scale", f"conditioning_scale must be between 0 and {bound}")
        if not 0 <= c.start < c.end <= 1:
            raise invalid(f"controlnets.{i}.start", "need 0 <= start < end <= 1")
        controlnets.append(ControlNetUse(c.name, c.conditioning_scale, c.start, c.end))
    for i, lora in enumerate(lora_inputs):
        if not -bound <= lora.scale <= bound:
            raise invalid(f"loras.{i}.scale", f"scale must be between {-bound} and {bound}")
    names = [lora.name for lora in lora_inputs]
    if len(set(names)) != len(names):
        raise invalid("loras", f"a LoRA is named twice in {names}")
    return tuple(controlnets), tuple(LoraUse(lora.name, lora.scale) for lora in lora_inputs)
