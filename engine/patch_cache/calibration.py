"""Recording what the reuse predictor learns from (PatchedServe §7): whole exact generations of
an SD3 family's requests, every block's input and output change per patch and step, against
each of the last few steps (a cached forward compares with inputs as old as the patch's last
recomputation, so the predictor must know what older caches do).

The paper records 1K requests offline; this records whichever requests the caller gives, with
their own seeds, so a predictor can be fitted at startup (or in a benchmark) from a calibration
run that is the same every time. The generations are the served ones: each request's `Sampler`
makes its inputs and takes its steps, all requests stepping together in one forward a step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from stepserve.engine.editing.masked_sd3 import SD3Inputs
from stepserve.engine.patch_cache.cache import PatchCache
from stepserve.engine.patch_cache.cached_sd3 import statistics_forward
from stepserve.engine.patch_cache.statistics import ReuseStatistics


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
