"""PatchedServe §5's patch cache (`engine.patch_cache`): each admitted request of a model with a
calibrated reuse predictor gets its own `PatchCache`, and a group of such requests runs
`family.denoise_patch_cached`, reusing each one's patches from its previous step where the
predictor allows. Approximate (`patch_cache.enabled`)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from stepserve.engine.forward_modes.base import ForwardBatch, ForwardMode, ModeName
from stepserve.engine.patch_cache.cache import PatchCache
from stepserve.engine.patch_cache.cached_sd3 import PatchReuse


class PatchCaching(ForwardMode):
    name = ModeName.PATCH_CACHE

    def __init__(self, reuse: Mapping[str, PatchReuse]):
        self.reuse = dict(reuse)  # by model: how its requests reuse their patches (a model not named: never)

    def admit(self, sampler, family) -> None:
        if sampler.spec.model in self.reuse:
            sampler.enter(self.name, PatchCache(sampler.rows))

    def takes(self, batch: ForwardBatch) -> bool:
        return not batch.group.ranks and not batch.addons and batch.all_in(self.name)

    def forward(self, batch: ForwardBatch) -> list[torch.Tensor]:
        caches = [sampler.mode_state for sampler in batch.samplers]
        reuse = self.reuse[batch.samplers[0].spec.model]
        return batch.split(batch.family.denoise_patch_cached(*batch.joined(), caches, reuse))
