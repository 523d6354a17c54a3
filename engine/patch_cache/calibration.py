"""Recording what the reuse predictor learns from (PatchedServe §7): whole exact generations of
an SD3 family's requests, every block's input and output change per patch and step, against
each of the last few steps (a cached forward compares with inputs as old as the patch's last
recomputation, so the predictor must know what older caches do).

The paper records 1K requests offline; this records whichever requests the caller gives, with
their own seeds, so a predictor can be fitted at startup (`calibrate`: what a worker serving
the patch cache runs) or in a benchmark from a calibration run that is the same every time.
The generations are the served ones: each request's `Sampler` makes its inputs and takes its
steps, all requests stepping together in one forward a step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from stepserve.engine.editing.masked_sd3 import SD3Inputs
from stepserve.engine.patch_cache.cache import PatchCache
from stepserve.engine.patch_cache.cached_sd3 import PatchReuse, statistics_forward
from stepserve.engine.patch_cache.predictor import fit_predictor
from stepserve.engine.patch_cache.statistics import ReuseStatistics
from stepserve.engine.sampler import Sampler
from stepserve.engine.text_encoding import encode_conditioning
from stepserve.policies.types import RequestSpec


@torch.inference_mode()
def record_generations(family: Any, samplers: Sequence[Any], side: int, ages: int = 3) -> ReuseStatistics:
    """Run `samplers` (fresh requests of one latent size, on an SD3 family) to their last step,
    exact, and return the statistics of every step after each one's first against each of its
    `ages` previous steps, for patches of `side` image tokens. The samplers end done, their
    latents those of the exact generations."""
    if ages < 1:
        raise ValueError(f"need at least one previous step to compare with, got {ages}")
    history: list[deque[PatchCache]] = [deque(maxlen=ages) for _ in samplers]  # newest first
    statistics = ReuseStatistics()
    while True:
        members = [(sampler, earlier) for sampler, earlier in zip(samplers, history) if not sampler.done]
        if not members:
            return statistics
        inputs = [sampler.model_input() for sampler, _ in members]
        sample, timesteps = (torch.cat([x[i] for x in inputs]) for i in (0, 1))
        cond = {name: torch.cat([x[2][name] for x in inputs]) for name in inputs[0][2]}
        caches = [PatchCache(sampler.rows) for sampler, _ in members]
        # SD3's row conditioning (`SD3Family.row_conditioning`): T5-joined context, pooled CLIP.
        noise_pred = statistics_forward(family.denoiser, SD3Inputs(sample, cond["context"], cond["pooled"], timesteps),
                                        caches, [list(earlier) for _, earlier in members], side, statistics)
        for (sampler, earlier), cache, rows in zip(members, caches,
                                                    noise_pred.split([sampler.rows for sampler, _ in members])):
            sampler.advance(rows)
            earlier.appendleft(cache)


# The calibration a worker runs at startup: fixed prompts and seeds, so every worker of a model
# fits the same predictor from the same generations.
CALIBRATION_PROMPTS = (("a red fox in the snow", 11), ("a city street at night", 12))


@dataclass(frozen=True)
class PatchCacheSpec:
    """How a worker serves the patch cache (`patch_cache` in the app config): a reuse is right
    where the output it reuses is within `tolerance` (relative MSE) of the exact one; patches of
    `side` x `side` tokens; each request's first `full_steps` steps computed in full; the
    predictor calibrated on generations of `size` px and `steps` steps."""

    tolerance: float = 1e-2
    side: int = 4
    full_steps: int = 1
    size: int = 256
    steps: int = 8


@torch.inference_mode()
def calibrate(family: Any, model: str, spec: PatchCacheSpec) -> PatchReuse:
    """The `PatchReuse` a worker serves `model` with: its predictor fitted to the exact
    generations of `CALIBRATION_PROMPTS` (CFG, guidance 5) as `spec` says. Needs the family's
    text encoders (the prompts are encoded here)."""
    requests = [RequestSpec(request_id=f"calibration-{i}", model=model, prompt=prompt, width=spec.size,
                            height=spec.size, num_inference_steps=spec.steps, guidance_scale=5.0, seed=seed, cfg=True)
                for i, (prompt, seed) in enumerate(CALIBRATION_PROMPTS)]
    samplers = [Sampler(request, family, encode_conditioning(family, request)) for request in requests]
    samples = record_generations(family, samplers, spec.side).samples()
    predictor = fit_predictor(samples, spec.tolerance, len(family.denoiser.transformer_blocks))
    return PatchReuse(predictor, spec.side, spec.full_steps)
