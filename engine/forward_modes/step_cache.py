"""Step caching per request inside a continuous batch (First-Block Cache, `engine.step_cache`):
a request that asks for it (`RequestSpec.step_cache`, its threshold) keeps its own cache, and a
group holding one runs the family's forward cut after its first block, each request deciding
for itself whether its rows go on through the later blocks or reuse its last computed step.
Members without a cache compute every step in full in the same forward. A skipped step takes the
later blocks' last result as it was, or extrapolated (`step_cache_method`: TaylorSeer). Approximate, per request;
a request that does not ask is exact.

Skip-CFG composes with it: a member past its first skipping step (`RequestSpec.skip_cfg_from`),
caching or not (a member of the skip-CFG mode rides along), runs its conditional row alone, and a
caching one's cache keeps that row from then on (`FirstBlockCache.drop_unconditional`), so its
later steps skip both its unconditional row and, where they barely change, its later blocks."""

from __future__ import annotations

import torch

from stepserve.engine.forward_modes.base import ForwardBatch, ForwardMode, ModeName
from stepserve.engine.forward_modes.skip_cfg import guided, joined_rows, skips_cfg
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
        return (not batch.group.ranks and not batch.addons and self.name in modes
                and modes <= {self.name, ModeName.SKIP_CFG, None} and self.serves(batch.family))

    def forward(self, batch: ForwardBatch) -> list[torch.Tensor]:
        skips = [skips_cfg(sampler) for sampler in batch.samplers]
        caches = []
        for sampler, skip in zip(batch.samplers, skips):
            if sampler.mode is not self.name:
                caches.append(FirstBlockCache(0.0, sampler.rows - int(skip)))
                continue
            if skip and sampler.mode_state.rows == sampler.rows:
                sampler.mode_state.drop_unconditional()
            caches.append(sampler.mode_state)
        rows = batch.family.denoise_first_block_cached(*joined_rows(batch, skips), caches)
        return guided(rows, batch, skips)

    def missed(self, sampler) -> None:
        sampler.mode_state.reset()
