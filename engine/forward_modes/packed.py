"""PatchedServe §4: members of different resolutions in one forward (`family.denoise_mixed`:
SD3's and Flux's tokens packed, the UNet families' latents cut into patches), each member's
output as its plain forward gives it; exact.

It takes every group whose members' latent sizes differ (the policy sent one). With `join` on
(`workers.pack_resolutions`) it also makes such groups: a plan's plain groups of one model
become one, at the first one's place (one forward however many resolutions the policy's
groups hold)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from stepserve.engine.forward_modes.base import ForwardBatch, ForwardMode, ModeName
from stepserve.policies.types import StepGroup


class PackedResolutions(ForwardMode):
    name = ModeName.PACKED

    def __init__(self, join: bool = False):
        self.join = join

    def takes(self, batch: ForwardBatch) -> bool:
        return batch.mixes_sizes

    def check(self, batch: ForwardBatch) -> None:
        sizes = [tuple(sampler.latents.shape[1:]) for sampler in batch.samplers]
        model = batch.family.source.name
        if not self.serves(batch.family) or not batch.family.packs(sizes):
            raise ValueError(f"one forward of model {model!r} cannot mix latent shapes {sorted(set(sizes))}")
        if batch.group.ranks or any(s.spec.controlnets or s.spec.loras for s in batch.samplers):
            raise ValueError("a forward mixing latent shapes runs on one worker, without add-ons")

    def forward(self, batch: ForwardBatch) -> list[torch.Tensor]:
        return batch.family.denoise_mixed(list(batch.inputs))

    def joined(self, groups: Sequence[StepGroup], samplers: Mapping, families: Mapping) -> list[StepGroup]:
        """`groups` with the plain ones of each model whose family packs resolutions joined
        into one (all of them as they are unless `join`). Plain: on this worker alone, every
        member resident and holding no mode's state, no add-ons. A group whose sizes the family
        cannot pack with the ones joined so far stays on its own."""
        if not self.join:
            return list(groups)
        out: list[StepGroup] = []
        packs: dict[str, int] = {}  # model -> the index in `out` of its packed group
        for group in groups:
            model = self._plain_model(group, samplers, families)
            at = packs.get(model) if model is not None else None
            if at is None:
                if model is not None:
                    packs[model] = len(out)
                out.append(group)
                continue
            joined = StepGroup(out[at].request_ids + group.request_ids)
            if families[model].packs([tuple(samplers[rid].latents.shape[1:]) for rid in joined.request_ids]):
                out[at] = joined
            else:
                out.append(group)
        return out

    def _plain_model(self, group: StepGroup, samplers: Mapping, families: Mapping) -> str | None:
        """The model of a group `joined` may join with others, else None."""
        members = [samplers.get(rid) for rid in group.request_ids]
        if group.ranks or not members or any(s is None for s in members):
            return None
        models = {s.spec.model for s in members}
        model = next(iter(models))
        family = families.get(model)
        if len(models) > 1 or family is None or not self.serves(family):
            return None
        # (A template edit's or a patch cache's forward holds one token grid.)
        if any(s.spec.loras or s.spec.controlnets or s.mode is not None for s in members):
            return None
        return model
