"""VAE decoder deployment: latents → PNG bytes, off the denoising loop (unless
`vae_decoder.on_workers`: then the worker that denoised an image decodes it, and this
deployment is not built)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from stepserve.engine.families import resolve_device
from stepserve.engine.families import VAE, ModelSource, load_family
from stepserve.engine.png import encode_png


class VAEDecoder:
    def __init__(self, models: Sequence[ModelSource], device: str = "auto", torch_threads: int | None = None):
        if torch_threads:
            torch.set_num_threads(torch_threads)
        device = resolve_device(device)
        self.families = {m.name: load_family(m, {VAE}, device) for m in models}

    def decode_png(self, model: str, latents: np.ndarray) -> bytes:
        image = self.families[model].decode(torch.from_numpy(latents))[0]
        return encode_png(image)
