"""Shared builders for tests: the tiny model, request specs, and the plain-diffusers reference."""

import torch

from stepserve.engine.families import ModelSource, family_class
from stepserve.engine.sampler import Conditioning
from stepserve.engine.step_runner import Admission
from stepserve.engine.text_encoding import encode_conditioning
from stepserve.policies.types import RequestSpec

TINY = ModelSource(name="tiny-sd", family="sd15", preset="tiny", seed=0)
TINY_SDXL = ModelSource(name="tiny-sdxl", family="sdxl", preset="tiny", seed=0)
TINY_SD3 = ModelSource(name="tiny-sd3", family="sd3", preset="tiny", seed=0)
TINY_FLUX = ModelSource(name="tiny-flux", family="flux", preset="tiny", seed=0)


def _classifier_free_guidance(model: str) -> bool:
    """`RequestSpec.cfg` as the ingress sets it from the model's family (a model not named here uses CFG)."""
    source = {s.name: s for s in (TINY, TINY_SDXL, TINY_SD3, TINY_FLUX)}.get(model)
    return source is None or family_class(source.family).classifier_free_guidance


def make_spec(rid: str, steps: int = 6, seed: int = 0, guidance: float = 7.5, size: int = 64, prompt: str = "a red fox",
              negative: str = "", model: str = "tiny-sd") -> RequestSpec:
    return RequestSpec(request_id=rid, model=model, prompt=prompt, width=size, height=size,
                       num_inference_steps=steps, guidance_scale=guidance, seed=seed, negative_prompt=negative,
                       cfg=_classifier_free_guidance(model))


def conditioning_for(family, spec: RequestSpec) -> Conditioning:
    return encode_conditioning(family, spec)


def admission_for(family, spec: RequestSpec) -> Admission:
    """A fresh start: the spec and its text conditioning."""
    return Admission(spec, conditioning=conditioning_for(family, spec))


def solo_pipeline_image(family, spec: RequestSpec):
    """Plain diffusers: the pipeline alone, same components, same seed."""
    # Flux's pipeline pads T5 tokens to its `max_sequence_length` argument (512 unless told); the
    # family encodes to its own, shorter in tiny models.
    t5 = {"max_sequence_length": family.max_sequence_length} if hasattr(family, "max_sequence_length") else {}
    with torch.inference_mode():
        return family.pipe(
            spec.prompt, negative_prompt=spec.negative_prompt or None, height=spec.height, width=spec.width,
            num_inference_steps=spec.num_inference_steps, guidance_scale=spec.guidance_scale,
            generator=torch.Generator("cpu").manual_seed(spec.seed), output_type="np", **t5,
        ).images[0]
