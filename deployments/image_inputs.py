"""Images that come with requests (ControlNet control images, an edit's image and mask): decoded only after their file size
and declared pixel count pass, so a decompression bomb or an oversized upload is refused before
it costs memory, and every failure is a 4xx naming the field.

Pure: no Ray, no I/O beyond the bytes given.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import re
import warnings
from typing import Any

import numpy as np
import PIL.Image

from stepserve.deployments.config import LimitsConfig
from stepserve.deployments.errors import APIError, invalid
from stepserve.deployments.forms import Form
from stepserve.deployments.protocol import ImageGenerationRequest
from stepserve.engine.addons.controlnet import control_pixels

FORMATS = ("PNG", "JPEG", "WEBP")
DATA_URL = re.compile(r"data:image/[A-Za-z0-9.+-]+;base64,")


def decode_base64_image(text: str, param: str, limits: LimitsConfig) -> PIL.Image.Image:
    """An image sent as base64 (or a `data:image/...;base64,` URL)."""
    match = DATA_URL.match(text)
    payload = text[match.end():] if match else text
    if len(payload) > (limits.max_image_bytes + 2) // 3 * 4:  # base64 of max_image_bytes, before decoding it
        raise _too_large(param, limits)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise invalid(param, f"{param} is not valid base64", code="invalid_image") from None
    return decode_image(data, param, limits)


def decode_image(data: bytes, param: str, limits: LimitsConfig) -> PIL.Image.Image:
    """A PNG, JPEG or WebP file's image, fully decoded."""
    if len(data) > limits.max_image_bytes:
        raise _too_large(param, limits)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", PIL.Image.DecompressionBombWarning)
            image = PIL.Image.open(io.BytesIO(data), formats=FORMATS)  # reads the header only
    except (PIL.Image.DecompressionBombError, PIL.Image.DecompressionBombWarning):
        raise _too_many_pixels(param, None, limits) from None
    except Exception:
        raise invalid(param, f"{param} is not a PNG, JPEG or WebP image", code="invalid_image") from None
    width, height = image.size
    if width * height > limits.max_image_pixels:
        raise _too_many_pixels(param, (width, height), limits)
    if width < 1 or height < 1:
        raise invalid(param, f"{param} has no pixels ({width}x{height})", code="invalid_image")
    try:
        image.load()
    except Exception:
        raise invalid(param, f"{param} is truncated or corrupt", code="invalid_image") from None
    return image


def control_image_parts(max_controlnets: int) -> tuple[str, ...]:
    """The file parts a form body of an image generation may carry: `controlnets.<i>.image`."""
    return tuple(f"controlnets.{i}.image" for i in range(max_controlnets))


def generation_payload(form: Form) -> dict[str, Any]:
    """A form body of POST /v1/images/generations as the JSON body it stands for: every field as
    in JSON (numbers as text), `controlnets` and `loras` as JSON text, and each ControlNet's image
    either in its entry (base64) or as the file part `controlnets.<i>.image`."""
    payload: dict[str, Any] = dict(form.fields)
    for key in ("controlnets", "loras"):
        if key in payload:
            try:
                payload[key] = json.loads(payload[key])
            except (ValueError, RecursionError):
                raise invalid(key, f"{key} must be a JSON list in a form body", code="invalid_json") from None
    for part, data in form.files.items():
        index = int(part.split(".")[1])  # the form reader let only `control_image_parts` through
        entries = payload.get("controlnets")
        if not isinstance(entries, list) or index >= len(entries) or not isinstance(entries[index], dict):
            raise invalid(part, f"{part}: the body has no controlnets[{index}] entry for this image")
        if "image" in entries[index]:
            raise invalid(part, f"{part}: controlnets[{index}] has an image already")
        # As base64, so the one path checks and decodes it (the body limit bounds the size).
        entries[index]["image"] = base64.b64encode(data).decode()
    return payload


# The file parts of an edit's form body: OpenAI's clients send one image as `image`, a list as `image[]`.
EDIT_FILE_PARTS = ("image", "image[]", "mask")


def edit_payload(form: Form) -> dict[str, Any]:
    """A form body of POST /v1/images/edits as the JSON body it stands for: the fields (numbers
    as text, `loras` as JSON text) and the image and mask file parts as base64, so one path
    checks and decodes them (the body limit bounds their size)."""
    payload: dict[str, Any] = dict(form.fields)
    if "loras" in payload:
        try:
            payload["loras"] = json.loads(payload["loras"])
        except (ValueError, RecursionError):
            raise invalid("loras", "loras must be a JSON list in a form body", code="invalid_json") from None
    if "image" in form.files and "image[]" in form.files:
        raise invalid("image", "one image per edit: send `image` or one `image[]`, not both")
    for part, data in form.files.items():
        name = part.removesuffix("[]")
        if name in payload:
            raise invalid(name, f"{name} is given both as a field and as a file")
        payload[name] = base64.b64encode(data).decode()
    return payload


def control_inputs(req: ImageGenerationRequest, width: int, height: int,
                   limits: LimitsConfig) -> tuple[np.ndarray, ...]:
    """Each ControlNet's control image, decoded and resized to the output size (uint8 [H, W, 3],
    `control_pixels`), in the request's order."""
    return tuple(
        control_pixels(decode_base64_image(c.image, f"controlnets.{i}.image", limits), height, width)
        for i, c in enumerate(req.controlnets or ())
    )


def _too_large(param: str, limits: LimitsConfig) -> APIError:
    return APIError(413, f"{param} exceeds {limits.max_image_bytes} bytes", param=param, code="image_too_large")


def _too_many_pixels(param: str, size: tuple[int, int] | None, limits: LimitsConfig) -> APIError:
    declared = "" if size is None else f" ({size[0]}x{size[1]})"
    return invalid(param, f"{param} declares more than {limits.max_image_pixels} pixels{declared}",
                   code="image_too_large")
