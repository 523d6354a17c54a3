"""SwiftDiffusion's CFG (latent) parallelism: a lone request's unconditional and conditional rows
on two ranks, each computing one and gathering the other (`engine.parallel.latent`); exact.
The router asks for it by a group's `split`; any family that guides by CFG serves it."""

from __future__ import annotations

import torch

from stepserve.engine.forward_modes.base import ForwardBatch, ForwardMode, ModeName
from stepserve.engine.parallel.latent import cfg_split_denoise
from stepserve.policies.types import GroupSplit


class CfgSplit(ForwardMode):
    name = ModeName.CFG_SPLIT

    def serves(self, family) -> bool:
        return family.classifier_free_guidance

    def takes(self, batch: ForwardBatch) -> bool:
        return bool(batch.group.ranks) and batch.group.split is GroupSplit.CFG

    def check(self, batch: ForwardBatch) -> None:
        if len(batch.group.ranks) > 1 and batch.samplers[0].rows != 2:
            raise ValueError("a CFG split needs a request that uses classifier-free guidance")

    def forward(self, batch: ForwardBatch) -> list[torch.Tensor]:
        sample, timesteps, cond = batch.joined()
        return batch.split(cfg_split_denoise(batch.family, sample, timesteps, cond, batch.process_group,
                                             batch.addons))
