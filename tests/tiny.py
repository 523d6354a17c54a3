"""Shared builders for tests: the tiny model, request specs, and the plain-diffusers reference."""

import numpy as np
import PIL.Image
import torch

from stepserve.engine.families import ModelSource, family_class
from stepserve.engine.mode_settings import ModeSettings
from stepserve.engine.sampler import Conditioning
from stepserve.engine.step_runner import Admission, StepRunner
from stepserve.engine.text_encoding import encode_conditioning
from stepserve.policies.types import RequestSpec, StepGroup, WorkerPlan

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


def run_continuous_batch(family, arrivals: dict[int, list], rounds: int = 100, admit=None,
                         modes: ModeSettings = ModeSettings()) -> dict[str, np.ndarray]:
    """Drive a StepRunner like continuous batching does: everyone resident steps each round,
    newcomers join at step boundaries, and a request finishes in the plan of its last step.
    `arrivals` maps a round to the specs arriving then; `admit(spec)` gives each one's admission
    (default: a fresh start with its text conditioning); `modes`: the runner's mode settings.
    Returns the finished latents by id."""
    admit = admit or (lambda spec: admission_for(family, spec))
    runner = StepRunner("w0", {family.source.name: family}, modes=modes)
    left: dict[str, int] = {}
    done = {}
    for rnd in range(rounds):
        new = arrivals.get(rnd, [])
        admissions = {s.request_id: admit(s) for s in new}
        left.update({s.request_id: s.steps_to_run for s in new})
        if not left:
            if rnd > max(arrivals):
                break
            continue
        stepping = tuple(left)
        finish = tuple(rid for rid in stepping if left[rid] == 1)
        plan = WorkerPlan("w0", admit=tuple(admissions), groups=(StepGroup(stepping),), finish=finish, plan_id=rnd)
        report, payloads = runner.execute(plan, admissions)
        assert not report.failed, report.failed
        assert (report.plan_id, report.batch_size) == (rnd, len(stepping))
        for rid in stepping:
            left[rid] -= 1
        assert {p.request_id: p.steps_total - p.steps_done for p in report.progress} == {
            rid: left[rid] for rid in stepping
        }
        for rid, latents in zip(finish, payloads):
            assert latents.dtype == np.float32 and latents.shape[:2] == (1, family.latent_channels)
            done[rid] = latents
            del left[rid]
        assert runner.resident == tuple(left)
    return done


def run_together(runner: StepRunner, family, specs, steps: int, groups=None) -> tuple[dict, dict]:
    """`specs` admitted together and stepped to the end by `runner`, in one group each unless
    `groups` says: the finished payloads, and the forward-mode state each request got at
    admission (`Sampler.mode_state`; they outlive the requests), by id."""
    admissions = {s.request_id: admission_for(family, s) for s in specs}
    groups = groups or tuple(StepGroup((s.request_id,)) for s in specs)
    done, states = {}, {}
    for step in range(steps):
        finish = tuple(admissions) if step == steps - 1 else ()
        plan = WorkerPlan(runner.worker_id, admit=tuple(admissions) if step == 0 else (), groups=groups,
                          finish=finish, plan_id=step)
        report, payloads = runner.execute(plan, admissions if step == 0 else {})
        assert not report.failed, report.failed
        if step == 0:
            states = {rid: s.mode_state for rid, s in runner.samplers.items() if s.mode is not None}
        done.update(zip(finish, payloads))
    return done, states


def control_image(seed: int, size: int = 64) -> PIL.Image.Image:
    """A random RGB image, deterministic by seed (what a ControlNet is conditioned on in tests)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    return PIL.Image.fromarray(pixels)
