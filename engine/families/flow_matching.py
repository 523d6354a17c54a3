"""What the flow-matching image families (SD3, Flux) share on top of SD1.5's loading: how their
pipelines sample and decode.

Flow matching starts from plain noise at sigma 1 and feeds the latents to the model as they are;
the pipelines pass `scheduler.step` nothing extra; their VAEs (16 latent channels) shift as well
as scale the latents. Both denoisers are transformers over 2x2 latent patches, so sides are
multiples of the VAE's 8x times 2.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from stepserve.engine.families.sd15 import SD15Family


class FlowMatchingImageFamily(SD15Family):
    size_multiple = 16
    xformers_attention = False  # joint attention has its own processors
    takes_addons = False  # their ControlNets (SD3ControlNetModel, FluxControlNetModel) are not served yet
    forward_modes = frozenset()  # DiTs, not the UNet `engine.patched` cuts: SD3 and Flux pack their tokens instead

    @classmethod
    def skipped_steps(cls, num_inference_steps: int, strength: float) -> int:
        # `StableDiffusion3InpaintPipeline.get_timesteps` rounds the other way: it keeps the
        # fraction of a step that `int(n * strength)` drops.
        return int(max(num_inference_steps - min(num_inference_steps * strength, num_inference_steps), 0))

    def image_latents(self, sample: torch.Tensor) -> torch.Tensor:
        return (sample - self.vae.config.shift_factor) * self.vae.config.scaling_factor

    def noise_image(self, scheduler: Any, image_latents: torch.Tensor, noise: torch.Tensor,
                    t: torch.Tensor) -> torch.Tensor:
        return scheduler.scale_noise(image_latents, t, noise)

    def scale_model_input(self, scheduler: Any, sample: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return sample

    def step_kwargs(self, scheduler: Any, generator: torch.Generator) -> dict[str, Any]:
        return {}

    def vae_input(self, latents: torch.Tensor) -> torch.Tensor:
        config = self.vae.config
        return latents.to(device=self.device, dtype=self.vae.dtype) / config.scaling_factor + config.shift_factor

    def decoded_pixels(self, image: torch.Tensor) -> np.ndarray:
        return self.pipe.image_processor.postprocess(image, output_type="np")
