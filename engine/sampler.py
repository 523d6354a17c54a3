"""Per-request denoising state: its own scheduler, generator and latents.

diffusers schedulers keep a step counter (and some keep history), so requests that share a
forward cannot share a scheduler. Each `RequestSampler` replays exactly what
`StableDiffusionPipeline.__call__` does for one image, split at the model call so many
requests can share it.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import Any

import diffusers
from diffusers.configuration_utils import FrozenDict

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

    # ---- moving between workers -----------------------------------------------------------

    def state(self, device: str | torch.device = "cpu") -> dict[str, Any]:
        """Everything needed to continue this image on another worker, as copies on `device`
        (host memory by default): the co-serving router moves a queued-up image to whichever
        worker its batch runs on. Picklable; independent of this sampler afterwards."""
        return export_state(self, device)

    @classmethod
    def from_state(cls, state: dict[str, Any], family: DiffusionFamily) -> "RequestSampler":
        """Rebuild a sampler from `state()` on `family`'s device; it continues exactly where the
        exported one stopped (same scheduler history, same generator position)."""
        self = cls.__new__(cls)
        import_state(self, state, family)
        self.uses_cfg = self.spec.uses_cfg
        self.guidance_scale = self.spec.guidance_scale
        self.timesteps = self.scheduler.timesteps
        self.step_kwargs = _extra_step_kwargs(self.scheduler, self.generator)
        return self


STATE_FORMAT = 2  # 2: schedulers restore from their instance dict (no set_timesteps)


def export_state(sampler: Any, device: str | torch.device) -> dict[str, Any]:
    """What every sampler needs to continue elsewhere (image and video samplers add their own
    fields): spec, step, latents, text context, generator position and scheduler, as copies."""
    device = torch.device(device)
    return {
        "format": STATE_FORMAT,
        "spec": sampler.spec,
        "step_index": sampler.step_index,
        "latents": copy_to(sampler.latents, device),
        "context": copy_to(sampler.context, device),
        "generator_state": sampler.generator.get_state(),
        "scheduler": scheduler_state(sampler.scheduler, device, sampler.latents.device),
    }


def import_state(sampler: Any, state: dict[str, Any], family: Any) -> None:
    """Set what `export_state` saved on a bare sampler (`cls.__new__`), on `family`'s device."""
    if state.get("format") != STATE_FORMAT:
        raise ValueError(f"unsupported sampler state format {state.get('format')!r}")
    sampler.spec = state["spec"]
    sampler.step_index = state["step_index"]
    sampler.latents = copy_to(state["latents"], family.device)
    sampler.context = state["context"].to(device=family.device, dtype=family.dtype, copy=True)
    sampler.generator = torch.Generator("cpu")
    sampler.generator.set_state(state["generator_state"])
    sampler.scheduler = restore_scheduler(state["scheduler"], family.device)


def scheduler_state(scheduler: Any, device: torch.device, home: torch.device) -> dict[str, Any]:
    """A scheduler's whole state as copies on `device`. `home` is the device its sampler runs
    on: tensors kept elsewhere on purpose (UniPC keeps its sigmas on the host to avoid syncs)
    are remembered, so a restore puts every tensor back where its kind belongs."""
    attrs = {k: v for k, v in vars(scheduler).items() if k != "_internal_dict"}
    return {
        "class": type(scheduler).__name__,
        "config": dict(scheduler.config),
        # The whole instance dict: step counter, sigmas/timesteps, and any multistep history
        # (UniPC's model_outputs, timestep_list, last_sample, lower_order_nums...).
        "attrs": {k: copy_to(v, device) for k, v in attrs.items()},
        "off_home": sorted(k for k, v in attrs.items() if isinstance(v, torch.Tensor) and v.device != home),
    }


def _extra_step_kwargs(scheduler, generator: torch.Generator) -> dict:
    # As `DiffusionPipeline.prepare_extra_step_kwargs`: only schedulers that take them get them.
    params = inspect.signature(scheduler.step).parameters
    kwargs: dict = {}
    if "eta" in params:
        kwargs["eta"] = 0.0
    if "generator" in params:
        kwargs["generator"] = generator
    return kwargs


def copy_to(value: Any, device: torch.device | str) -> Any:
    """A deep copy with every tensor moved to `device`."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device, copy=True)
    if isinstance(value, (list, tuple)):
        return type(value)(copy_to(v, device) for v in value)
    if isinstance(value, dict):
        return {k: copy_to(v, device) for k, v in value.items()}
    return copy.deepcopy(value)


def restore_scheduler(saved: dict[str, Any], device: torch.device) -> Any:
    """The scheduler `scheduler_state` saved, for a sampler on `device`.

    Rebuilt from its saved instance dict rather than `from_config` + `set_timesteps`: every
    attribute is in the state, and parsing a diffusers config costs milliseconds, which would
    dominate a resume (GenServe budgets it at a small fraction of one step).
    """
    scheduler_cls = getattr(diffusers, saved["class"], None)
    if scheduler_cls is None:
        raise ValueError(f"unknown scheduler class {saved['class']!r} in sampler state")
    scheduler = scheduler_cls.__new__(scheduler_cls)
    scheduler._internal_dict = FrozenDict(saved["config"])
    off_home = set(saved["off_home"])
    for name, value in saved["attrs"].items():
        vars(scheduler)[name] = copy_to(value, "cpu" if name in off_home else device)
    return scheduler
