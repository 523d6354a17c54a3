"""Per-video denoising state, which can leave its worker between steps and come back elsewhere.

`VideoSampler` replays exactly what `WanPipeline.__call__` does for one video, split at the
transformer call so a worker (or a sequence-parallel group of workers) runs the forward. Its
whole state — latents, the scheduler with its step counter and multistep history, the generator
and the text embeddings — exports to a picklable dict of CPU tensors (`state()`), and
`VideoSampler.from_state` rebuilds it on any worker. Nothing in the state depends on how many
ranks ran the forwards, so a video paused at SP degree d resumes at any other degree, and the
resumed video equals an uninterrupted run.
"""

from __future__ import annotations

from typing import Any

import torch

from ..policies.types import VideoSpec  # noqa: F401  (re-exported: the engine's callers build specs here)
from .sampler import Conditioning, StepProgress, export_state, import_state



class VideoSampler(StepProgress):
    """One video's sampler. `spec` is a `VideoSpec` or anything with the same fields."""

    def __init__(self, spec: Any, family: Any, conditioning: Conditioning):
        self.spec = spec
        self.device = family.device
        self.height, self.width, self.num_frames = family.video_shape(spec.height, spec.width, spec.num_frames)
        self.guidance_scale = float(spec.guidance_scale)
        self.scheduler = family.make_scheduler()
        self.scheduler.set_timesteps(spec.num_inference_steps, device=family.device)
        # As the pipeline: count steps from 0 instead of looking timesteps up.
        self.scheduler.set_begin_index(0)
        # The pipeline draws the initial noise from one CPU generator (the same on any device).
        self.generator = torch.Generator("cpu").manual_seed(spec.seed)
        self.latents = family.initial_latents(self.height, self.width, self.scheduler, self.generator, self.num_frames)
        cond = conditioning.prompt_embeds.to(device=family.device, dtype=family.dtype)
        if self.uses_cfg:
            if conditioning.negative_prompt_embeds is None:
                raise ValueError(f"request {spec.request_id}: CFG needs negative prompt embeddings")
            uncond = conditioning.negative_prompt_embeds.to(device=family.device, dtype=family.dtype)
            cond = torch.cat([uncond, cond])
        self.context = cond
        self.step_index = 0

    # ---- stepping -----------------------------------------------------------------------

    @property
    def uses_cfg(self) -> bool:
        return self.guidance_scale > 1.0

    @property
    def timesteps(self) -> torch.Tensor:
        return self.scheduler.timesteps

    def model_input(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sample, per-row timesteps, context) for this video's rows of the next forward:
        [uncond, cond] with CFG (the pipeline runs them as two forwards; rows are independent)."""
        if self.done:
            raise RuntimeError(f"request {self.spec.request_id}: all {self.steps_total} steps are done")
        t = self.timesteps[self.step_index]
        sample = torch.cat([self.latents] * self.rows) if self.uses_cfg else self.latents
        return sample, t.reshape(1).expand(self.rows), self.context

    def advance(self, noise_pred: torch.Tensor) -> None:
        if self.uses_cfg:
            uncond, cond = noise_pred.chunk(2)
            noise_pred = uncond + self.guidance_scale * (cond - uncond)
        t = self.timesteps[self.step_index]
        self.latents = self.scheduler.step(noise_pred, t, self.latents, return_dict=False)[0]
        self.step_index += 1

    @torch.inference_mode()
    def step(self, family: Any, sp_group: Any = None) -> None:
        """One step on its own: forward (sequence-parallel over `sp_group` if given), advance."""
        sample, timesteps, context = self.model_input()
        self.advance(family.denoise(sample, timesteps, context, sp_group=sp_group))

    # ---- pause / resume -----------------------------------------------------------------

    def state(self, device: str | torch.device = "cpu") -> dict[str, Any]:
        """Everything needed to continue this video, as copies on `device` (host memory by
        default). Picklable; independent of this sampler afterwards."""
        return {**export_state(self, device), "shape": (self.height, self.width, self.num_frames),
                "guidance_scale": self.guidance_scale}

    @classmethod
    def from_state(cls, state: dict[str, Any], family: Any) -> "VideoSampler":
        """Rebuild a sampler from `state()` on `family`'s device (any worker, any SP degree)."""
        self = cls.__new__(cls)
        import_state(self, state, family)
        self.device = family.device
        self.height, self.width, self.num_frames = state["shape"]
        self.guidance_scale = state["guidance_scale"]
        return self
