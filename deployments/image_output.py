"""The image files a response carries, in the format OpenAI's `output_format` asks for, and the
fields with which OpenAI's images response describes them.

The decoder always hands back a lossless PNG (`engine.png.encode_png`): `png` returns those bytes
untouched (exactness tests compare them), `jpeg` and `webp` transcode them here, in the ingress.
Pure: no Ray, no I/O beyond the bytes given; callers run `encode_all` off the event loop.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import PIL.Image

from stepserve.deployments.errors import invalid
from stepserve.deployments.protocol import ImageOptions
from stepserve.deployments.validation import quality_preset
from stepserve.policies.types import RequestSpec

# OpenAI's output formats this server writes, as Pillow names them.
PIL_FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}
# OpenAI's output_compression defaults to 100: the least lossy setting, a lossless PNG's only one.
DEFAULT_COMPRESSION = 100


@dataclass(frozen=True)
class ImageOutput:
    format: str  # a key of PIL_FORMATS
    compression: int  # OpenAI's output_compression, 0-100: Pillow's `quality` for jpeg and webp
    quality: str | None  # the step preset the request ran ('low', 'medium', 'high'); None: its own steps

    def fields(self, spec: RequestSpec) -> dict[str, Any]:
        """OpenAI's description of a response's images (all of a request's share `spec`'s size)."""
        return {"output_format": self.format, "quality": self.quality, "size": f"{spec.width}x{spec.height}",
                "background": "opaque"}


def output_for(req: ImageOptions) -> ImageOutput:
    """The output an image request (generation or edit) asks for, or a 400 naming the parameter
    whose value this server cannot honour (never silently ignored)."""
    fmt = "png" if req.output_format is None else req.output_format
    if fmt not in PIL_FORMATS:
        code = "unsupported_value" if fmt in ("gif", "svg") else "invalid_value"
        raise invalid("output_format", f"output_format {fmt!r} is not served; use png, jpeg or webp", code=code)
    compression = DEFAULT_COMPRESSION if req.output_compression is None else req.output_compression
    if not 0 <= compression <= 100:
        raise invalid("output_compression", "output_compression must be between 0 and 100")
    if fmt == "png" and compression != DEFAULT_COMPRESSION:
        raise invalid("output_compression", "output_compression below 100 needs output_format jpeg or webp: png is "
                                            "lossless", code="unsupported_value")
    if req.background == "transparent":
        raise invalid("background", "background 'transparent' is not served: no served model draws an alpha "
                                    "channel; use 'opaque' or 'auto'", code="unsupported_value")
    if req.background not in (None, "auto", "opaque"):
        raise invalid("background", f"background {req.background!r} is not one of auto, opaque")
    return ImageOutput(fmt, compression, quality_preset(req))


def encode_all(pngs: list[bytes], output: ImageOutput) -> list[bytes]:
    return [encode(png, output) for png in pngs]


def encode(png: bytes, output: ImageOutput) -> bytes:
    """A decoded image's file in `output`'s format."""
    if output.format == "png":
        return png  # the decoder's own bytes: exact, and no second encode
    with PIL.Image.open(io.BytesIO(png)) as image:
        pixels = image.convert("RGB")  # JPEG has no alpha; the decoder writes RGB already
    buffer = io.BytesIO()
    pixels.save(buffer, format=PIL_FORMATS[output.format], quality=output.compression)
    return buffer.getvalue()
