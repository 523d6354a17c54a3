"""The plain forward: the members' rows in one batched `denoise`, with their add-ons, over the
group's ranks when it names several (sequence parallelism). Every family has it; it takes every
group no earlier mode took, and it is exact."""

from __future__ import annotations

import torch

from stepserve.engine.forward_modes.base import ForwardBatch, ForwardMode, ModeName


class Plain(ForwardMode):
    name = ModeName.PLAIN

    def serves(self, family) -> bool:
        return True

    def takes(self, batch: ForwardBatch) -> bool:
        return True

    def check(self, batch: ForwardBatch) -> None:
        if len(batch.group.ranks) > 1 and not batch.family.sequence_parallel:
            raise ValueError(f"model {batch.family.source.name!r} cannot run sequence-parallel")

    def forward(self, batch: ForwardBatch) -> list[torch.Tensor]:
        sample, timesteps, cond = batch.joined()
        # Only families that take add-ons take the keyword (admission refused the others' requests).
        extra = {"addons": batch.addons} if batch.addons else {}
        return batch.split(batch.family.denoise(sample, timesteps, cond, sp_group=batch.process_group, **extra))
