"""An image's PNG bytes, rounded exactly as diffusers rounds: one function for every place that
encodes a finished image (the VAE decoder deployment, or the worker that holds it)."""

from __future__ import annotations

import io

import numpy as np
from diffusers.image_processor import VaeImageProcessor


def encode_png(image: np.ndarray) -> bytes:
    """float [H, W, 3] in [0, 1] → PNG, rounding exactly as diffusers' numpy_to_pil."""
    buffer = io.BytesIO()
    VaeImageProcessor.numpy_to_pil(image[None])[0].save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()
