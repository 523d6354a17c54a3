"""Masked editing (inpainting) as the diffusers inpaint pipelines do it with the base denoiser
(`StableDiffusionInpaintPipeline` with a 4-channel UNet, `StableDiffusion3InpaintPipeline` with a
16-channel transformer), split so each request carries its own part of the loop.

The image is encoded by the VAE and noised to the request's first timestep (or replaced by pure
noise at `strength` 1); after every scheduler step the latents outside the mask are put back to
the image noised to the next timestep (the image itself after the last step). The pipelines draw
from the request's generator in this order, and so does `start_edit`: the image's latent sample,
the initial noise, then the masked image's latent sample (a 4- or 16-channel denoiser does not use
it, but drawing it moves the generator before any stochastic scheduler step).

Pixels are prepared where requests are validated (`edit_pixels`, off the step loop) and made
tensors when a worker admits the request (`image_tensor`, `mask_tensor`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import PIL.Image
import torch
import torch.nn.functional as F
from diffusers.image_processor import VaeImageProcessor
from diffusers.utils.torch_utils import randn_tensor

from stepserve.policies.types import RequestSpec


def edit_pixels(image: PIL.Image.Image, mask: PIL.Image.Image, height: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """The first half of the pipelines' preprocessing, as their image and mask processors do it:
    the image resized to the output size, RGB uint8 [height, width, 3]; the mask (white: repaint)
    grayscale, resized, uint8 [height, width]. A quarter of the float tensors' bytes, to carry
    from the ingress to a worker."""
    images = VaeImageProcessor(vae_scale_factor=8)
    masks = VaeImageProcessor(vae_scale_factor=8, do_normalize=False, do_binarize=True, do_convert_grayscale=True)
    rgb = images.resize(image.convert("RGB"), height, width)
    gray = masks.resize(masks.convert_to_grayscale(mask), height, width)
    return np.array(rgb), np.array(gray)


def image_tensor(pixels: np.ndarray) -> torch.Tensor:
    """float32 [1, 3, H, W] in [-1, 1], as `pil_to_numpy` + `numpy_to_pt` + `normalize` make it."""
    unit = torch.from_numpy((pixels.astype(np.float32) / 255.0).transpose(2, 0, 1).copy()).unsqueeze(0)
    return 2.0 * unit - 1.0


def mask_tensor(pixels: np.ndarray) -> torch.Tensor:
    """float32 [1, 1, H, W] of 0 and 1 (1: repaint), binarized at 0.5 as the mask processor does."""
    unit = torch.from_numpy(pixels.astype(np.float32) / 255.0)[None, None]
    return (unit >= 0.5).to(torch.float32)


def mask_ratio(mask: np.ndarray, vae_scale_factor: int) -> float:
    """The fraction of the latent grid the mask covers: the pixels nearest-neighbour resizing to
    latents picks (`latent_mask`), binarized."""
    return float((mask[::vae_scale_factor, ::vae_scale_factor] >= 128).mean())


def latent_mask(mask: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The pixel mask on the latent grid, as `prepare_mask_latents` resizes it (nearest)."""
    return F.interpolate(mask, size=(height, width))


@dataclass
class EditLatents:
    """What an edit's every step needs besides its sampler: the image's latents, the noise its
    start was drawn with (the image outside the mask is re-noised with it), and the latent mask."""

    image: torch.Tensor
    noise: torch.Tensor
    mask: torch.Tensor

    def blend(self, noise_image: Callable, scheduler: Any, latents: torch.Tensor,
              next_t: torch.Tensor | None) -> torch.Tensor:
        """Latents after a step: the mask's part as denoised, the rest the image noised to the
        next timestep (`next_t`; None after the last step: the image itself) by the family's
        `noise_image`."""
        proper = self.image if next_t is None else noise_image(scheduler, self.image, self.noise, next_t.reshape(1))
        return (1 - self.mask) * proper + self.mask * latents

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"image": self.image, "noise": self.noise, "mask": self.mask}


def start_edit(family: Any, spec: RequestSpec, scheduler: Any, generator: torch.Generator, image: torch.Tensor,
               mask: torch.Tensor, timesteps: torch.Tensor) -> tuple[torch.Tensor, EditLatents]:
    """The request's first latents and its `EditLatents`, drawn from `generator` in the pipelines'
    order. `image`, `mask`: `image_tensor` and `mask_tensor` of its pixels; `timesteps`: the ones
    it runs (after `strength` cut the first ones off)."""
    mean, std = family.encode_image(image)
    sample = mean + std * randn_tensor(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
    image_latents = family.image_latents(sample).to(family.dtype)
    noise = randn_tensor(image_latents.shape, generator=generator, device=family.device, dtype=family.dtype)
    if spec.strength == 1.0:
        latents = noise * getattr(scheduler, "init_noise_sigma", 1.0)  # (flow matching starts at sigma 1)
    else:
        latents = family.noise_image(scheduler, image_latents, noise, timesteps[:1])
    randn_tensor(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)  # the masked image's sample
    small = latent_mask(mask, *image_latents.shape[-2:]).to(device=family.device, dtype=family.dtype)
    return latents, EditLatents(image_latents, noise, small)
