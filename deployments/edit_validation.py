"""Turns a POST /v1/images/edits body into validated `RequestSpec`s and the pixels a worker needs,
or a 4xx naming the field.

The image and mask are decoded under the same size and bomb checks as every input image
(`image_inputs`); the mask must be OpenAI's: a PNG with an alpha channel, as large as the image,
whose fully transparent pixels mark the area to edit. Pure: no Ray, no I/O.
"""

from __future__ import annotations

import hashlib
import re

import numpy as np
import PIL.Image

from stepserve.deployments.config import AppConfig, LimitsConfig, check_size
from stepserve.deployments.errors import invalid
from stepserve.deployments.image_inputs import decode_base64_image
from stepserve.deployments.protocol import ImageEditRequest
from stepserve.deployments.validation import (
    addon_uses, image_settings, parse_body, request_skip_cfg, request_slo, request_step_cache, served_model,
)
from stepserve.engine.families import family_class
from stepserve.engine.inpaint import edit_pixels, mask_ratio
from stepserve.engine.sampler import RequestInputs
from stepserve.policies.types import RequestKind, RequestSpec

TEMPLATE_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")


def template_identity(template_id: str, pixels: np.ndarray, owner: str | None = None) -> str:
    """What an edit's cached activations are kept under: the template's name, a digest of its
    image as it is denoised (at the edit's size) and its tenant. Another image sent under the same
    name is then another template, recorded anew, never the first image's activations applied to
    it; and no tenant reuses another's record (made with the other's prompt). ('#' is not a name's
    character: no name can take another's place.)"""
    digest = hashlib.sha256(np.ascontiguousarray(pixels).tobytes()).hexdigest()[:32]
    return f"{template_id}#{digest}" if owner is None else f"{template_id}#{digest}#{owner}"


def parse_edit(payload: object) -> ImageEditRequest:
    return parse_body(payload, ImageEditRequest)


def to_edit_specs(payload: object, config: AppConfig, request_id: str, default_seed: int | None = None,
                  owner: str | None = None) -> tuple[list[RequestSpec], RequestInputs]:
    """The request's specs (one per image of `n`) and the pixels they share; `owner`: the caller's
    tenant (None: the one tenant there is), whose templates are its own."""
    req = parse_edit(payload)
    limits = config.limits
    model = served_model(config, req.model, lambda m: family_class(m.family).edits, "no served model edits images")
    family = family_class(model.family)
    if not family.edits:
        raise invalid("model", f"{model.name} ({model.family}) does not edit images", code="unsupported_model")
    steps, guidance, seed = image_settings(req, model, limits, default_seed)
    if not 0 < req.strength <= 1:  # also rejects NaN
        raise invalid("strength", "strength must be in (0, 1]")
    skip = family.skipped_steps(steps, req.strength)
    if skip >= steps:
        raise invalid("strength", f"strength {req.strength} of {steps} steps leaves no step to run")
    if req.template_id is not None and not TEMPLATE_ID.fullmatch(req.template_id):
        raise invalid("template_id", "template_id must be 1 to 128 letters, digits, '.', '_' or '-'")
    _, loras = addon_uses([], req.loras or [], model, config)
    image = decode_base64_image(req.image, "image", limits)
    edit_area = decode_mask(req.mask, image.size, limits)
    try:
        width, height = check_size(f"{image.width}x{image.height}" if req.size in (None, "auto") else req.size,
                                   model, family.size_multiple)
    except ValueError as exc:
        raise invalid("size", f"{exc} (without size, the image's own size is used)") from None
    pixels, mask = edit_pixels(image, edit_area, height, width)
    # The vae scale factor of every editing family is 8 (SD's VAE); the worker checks the mask's shape.
    ratio = mask_ratio(mask, 8)
    if ratio == 0.0:
        raise invalid("mask", "the mask leaves nothing to edit at this size (no transparent pixel survives resizing)")
    step_cache, step_cache_method = request_step_cache(req, model)
    skip_cfg_from, skip_cfg_floor_from = request_skip_cfg(req, model)
    template = None if req.template_id is None else template_identity(req.template_id, pixels, owner)
    specs = [
        RequestSpec(
            request_id=request_id if req.n == 1 else f"{request_id}-{i}", model=model.name, prompt=req.prompt,
            negative_prompt=req.negative_prompt or "", width=width, height=height, num_inference_steps=steps,
            guidance_scale=guidance, seed=seed + i, slo_s=request_slo(req, model), cfg=family.classifier_free_guidance,
            loras=loras, kind=RequestKind.EDIT, strength=req.strength, skip_steps=skip, mask_ratio=ratio,
            template_id=template, step_cache=step_cache, step_cache_method=step_cache_method,
            skip_cfg_from=skip_cfg_from, skip_cfg_floor_from=skip_cfg_floor_from,
        )
        for i in range(req.n)
    ]
    return specs, RequestInputs(image=pixels, mask=mask)


def decode_mask(text: str, size: tuple[int, int], limits: LimitsConfig) -> PIL.Image.Image:
    """The edit area (white where the mask is fully transparent) of an OpenAI mask."""
    mask = decode_base64_image(text, "mask", limits)
    if mask.format != "PNG" or "A" not in mask.getbands() and "transparency" not in mask.info:
        raise invalid("mask", "mask must be a PNG with an alpha channel (transparent: the area to edit)",
                      code="invalid_mask")
    if mask.size != size:
        raise invalid("mask", f"mask is {mask.width}x{mask.height} but the image is {size[0]}x{size[1]}: they must "
                              "be the same size", code="invalid_mask")
    alpha = np.array(mask.convert("RGBA").getchannel("A"))
    return PIL.Image.fromarray(np.where(alpha == 0, 255, 0).astype(np.uint8), mode="L")
