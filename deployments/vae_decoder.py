"""VAE decoder deployment: latents → PNG bytes, off the denoising loop."""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np
import torch
from diffusers.image_processor import VaeImageProcessor

from ..actors.denoiser import resolve_device
from ..engine.families import VAE, ModelSource, load_family


def encode_png(image: np.ndarray) -> bytes:
    """float [H, W, 3] in [0, 1] → PNG, rounding exactly as diffusers' numpy_to_pil."""
    buffer = io.BytesIO()
    VaeImageProcessor.numpy_to_pil(image[None])[0].save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()


class VAEDecoder:
    def __init__(self, models: Sequence[ModelSource], device: str = "auto", torch_threads: int | None = None):
        if torch_threads:
            torch.set_num_threads(torch_threads)
        device = resolve_device(device)
        self.families = {m.name: load_family(m, {VAE}, device) for m in models}

    def decode_png(self, model: str, latents: np.ndarray) -> bytes:
        image = self.families[model].decode(torch.from_numpy(latents))[0]
        return encode_png(image)
