"""Shared builders for tests: the tiny model, request specs, and the plain-diffusers reference."""

import torch

from stepserve.engine.families import ModelSource
from stepserve.engine.sampler import Conditioning
from stepserve.engine.step_runner import Admission
from stepserve.engine.text_encoding import encode_conditioning
from stepserve.policies.types import RequestSpec

TINY = ModelSource(name="tiny-sd", family="sd15", preset="tiny", seed=0)
TINY_SDXL = ModelSource(name="tiny-sdxl", family="sdxl", preset="tiny", seed=0)


def make_spec(rid: str, steps: int = 6, seed: int = 0, guidance: float = 7.5, size: int = 64, prompt: str = "a red fox",
              negative: str = "", model: str = "tiny-sd") -> RequestSpec:
    return RequestSpec(request_id=rid, model=model, prompt=prompt, width=size, height=size,
                       num_inference_steps=steps, guidance_scale=guidance, seed=seed, negative_prompt=negative)


def conditioning_for(family, spec: RequestSpec) -> Conditioning:
    return encode_conditioning(family, spec)


def admission_for(family, spec: RequestSpec) -> Admission:
    """A fresh start: the spec and its text conditioning."""
    return Admission(spec, conditioning=conditioning_for(family, spec))


def solo_pipeline_image(family, spec: RequestSpec):
    """Plain diffusers: the pipeline alone, same components, same seed."""
    with torch.inference_mode():
        return family.pipe(
            spec.prompt, negative_prompt=spec.negative_prompt or None, height=spec.height, width=spec.width,
            num_inference_steps=spec.num_inference_steps, guidance_scale=spec.guidance_scale,
            generator=torch.Generator("cpu").manual_seed(spec.seed), output_type="np",
        ).images[0]
