"""Step caching per request inside a continuous batch (First-Block Cache, `engine.step_cache`):
a request that asks for it (`RequestSpec.step_cache`, its threshold) keeps its own cache, and a
group holding one runs the family's forward cut after its first block, each request deciding
for itself whether its rows go on through the later blocks or reuse its last computed step.
Members without a cache compute every step in full in the same forward. A skipped step takes the
later blocks' last result as it was, or extrapolated (`step_cache_method`: TaylorSeer). Approximate, per request;
a request that does not ask is exact."""

from __future__ import annotations

import torch

from stepserve.engine.forward_modes.base import ForwardBatch, ForwardMode, ModeName
from stepserve.engine.step_cache.first_block import FirstBlockCache
from stepserve.policies.types import StepCacheMethod


class StepCaching(ForwardMode):
    name = ModeName.STEP_CACHE

    def admit(self, sampler, family) -> None:
        if sampler.spec.step_cache > 0:
            order = 1 if sampler.spec.step_cache_method is StepCacheMethod.TAYLORSEER else 0
            sampler.enter(self.name, FirstBlockCache(sampler.spec.step_cache, sampler.rows, order))

    def takes(self, batch: ForwardBatch) -> bool:
        modes = {sampler.mode for sampler in batch.samplers}
        return (not batch.group.ranks and not batch.addons and self.name in modes and modes <= {self.name, None}
                and self.serves(batch.family))

    def forward(self, batch: ForwardBatch) -> list[torch.Tensor]:
        caches = [s.mode_state if s.mode is self.name else FirstBlockCache(0.0, s.rows) for s in batch.samplers]
        return batch.split(batch.family.denoise_first_block_cached(*batch.joined(), caches))

    def missed(self, sampler) -> None:
        sampler.mode_state.reset()
