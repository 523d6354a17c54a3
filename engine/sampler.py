"""Per-request denoising state: its own scheduler, generator and latents.

diffusers schedulers keep a step counter (and some keep history), so requests that share a
forward cannot share a scheduler. Each `RequestSampler` replays exactly what
`StableDiffusionPipeline.__call__` does for one image, split at the model call so many
requests can share it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from ..policies.types import RequestSpec
from .families.base import DiffusionFamily


@dataclass(frozen=True)
class Conditioning:
    """Text embeddings for one request: [1, seq, dim] each; negative only when CFG is on."""

    prompt_embeds: torch.Tensor
    negative_prompt_embeds: torch.Tensor | None = None


class StepProgress:
    """Where a sampler stands, for any sampler with `timesteps`, `step_index` and `uses_cfg`."""

    @property
    def steps_total(self) -> int:
        return len(self.timesteps)

    @property
    def done(self) -> bool:
        return self.step_index >= self.steps_total

    @property
    def rows(self) -> int:
        return 2 if self.uses_cfg else 1


class RequestSampler(StepProgress):
    def __init__(self, spec: RequestSpec, family: DiffusionFamily, conditioning: Conditioning):
        self.spec = spec
        self.uses_cfg = spec.uses_cfg
        self.guidance_scale = spec.guidance_scale
        self.scheduler = family.make_scheduler()
        self.scheduler.set_timesteps(spec.num_inference_steps, device=family.device)
        self.timesteps = self.scheduler.timesteps
        # The pipeline draws the initial noise and every stochastic step from one CPU generator.
        self.generator = torch.Generator("cpu").manual_seed(spec.seed)
        self.latents = family.initial_latents(spec.height, spec.width, self.scheduler, self.generator)
        cond = conditioning.prompt_embeds.to(device=family.device, dtype=family.dtype)
        if self.uses_cfg:
            if conditioning.negative_prompt_embeds is None:
                raise ValueError(f"request {spec.request_id}: CFG needs negative prompt embeddings")
            uncond = conditioning.negative_prompt_embeds.to(device=family.device, dtype=family.dtype)
            cond = torch.cat([uncond, cond])  # the pipeline's [uncond, cond] order
        self.context = cond
        self.step_kwargs = _extra_step_kwargs(self.scheduler, self.generator)
        self.step_index = 0

    def model_input(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sample, per-row timesteps, context) for this request's rows of the next forward."""
        t = self.timesteps[self.step_index]
        sample = torch.cat([self.latents] * 2) if self.uses_cfg else self.latents
        sample = self.scheduler.scale_model_input(sample, t)
        return sample, t.reshape(1).expand(self.rows), self.context

    def advance(self, noise_pred: torch.Tensor) -> None:
        if self.uses_cfg:
            uncond, text = noise_pred.chunk(2)
            noise_pred = uncond + self.guidance_scale * (text - uncond)
        t = self.timesteps[self.step_index]
        self.latents = self.scheduler.step(noise_pred, t, self.latents, **self.step_kwargs, return_dict=False)[0]
        self.step_index += 1


def _extra_step_kwargs(scheduler, generator: torch.Generator) -> dict:
    # As `DiffusionPipeline.prepare_extra_step_kwargs`: only schedulers that take them get them.
    params = inspect.signature(scheduler.step).parameters
    kwargs: dict = {}
    if "eta" in params:
        kwargs["eta"] = 0.0
    if "generator" in params:
        kwargs["generator"] = generator
    return kwargs
