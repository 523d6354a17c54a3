"""SynerDiff's adaptive skip-CFG (§III-B, Fig. 9): late in its denoising a request's
unconditional row adds little, so from its step s_min on a request runs its conditional row only
and takes that prediction as its guided one. s_min comes with the request
(`RequestSpec.skip_cfg_from`): the ingress reads it off its model's measured curve
(`policies.synerdiff.skip_cfg.SkipCfgCurve`, measured by `load_tests.bench_skip_cfg`) for the
model's quality threshold S. Approximate, off by default (S = 1). Under load, a worker's load
controller may move s_min toward the request's floor (`skip_cfg_floor_from`) and back.

Every family that guides by CFG serves it. A group in which some member skips runs one forward
of the members' rows less the skipping members' unconditional rows; the others' rows, and their
results, are those of the plain forward. A skipping member's prediction [cond, cond] makes its
sampler's guidance `uncond + g * (cond - uncond)` exactly `cond`. Groups with add-ons (their
residuals and LoRA rows are laid out for whole requests) or over ranks run plainly. A request that
also caches steps holds the step cache's state, and that mode's forward skips its unconditional
rows the same way (`engine.forward_modes.step_cache`), from the same step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stepserve.engine.forward_modes.base import ForwardBatch, ForwardMode, ModeName


@dataclass
class CfgSkip:
    """A request's skip-CFG state: the first of its steps that may run without its unconditional
    row (None: none yet; a worker's load controller moves it toward the request's floor as its
    queue builds, and back), and whether its next step does (a worker's sequencer may keep it
    guided for a step: `engine.round_sequencer`)."""

    first_step: int | None
    chosen: bool = True


class CfgSkipping(ForwardMode):
    name = ModeName.SKIP_CFG

    def serves(self, family) -> bool:
        return family.classifier_free_guidance

    def admit(self, sampler, family) -> None:
        spec = sampler.spec
        if spec.skip_cfg_step_under(1.0) is not None:  # it may skip, if not at once then under load
            sampler.enter(self.name, CfgSkip(spec.skip_cfg_step))

    def takes(self, batch: ForwardBatch) -> bool:
        modes = {sampler.mode for sampler in batch.samplers}
        return (not batch.group.ranks and not batch.addons and modes <= {self.name, None}
                and any(_skips(sampler) for sampler in batch.samplers))

    def forward(self, batch: ForwardBatch) -> list[torch.Tensor]:
        skips = [_skips(sampler) for sampler in batch.samplers]
        sample, timesteps, cond = joined_rows(batch, skips)
        return guided(batch.family.denoise(sample, timesteps, cond, sp_group=None), batch, skips)


def skips_cfg(sampler) -> bool:
    """The request's next step runs without its unconditional row: in this mode, where it is past
    its first skipping step and its sequencer chose so; caching steps, where it is past that step."""
    if sampler.mode is ModeName.SKIP_CFG:
        return _skips(sampler)
    first = sampler.spec.skip_cfg_step
    return sampler.mode is ModeName.STEP_CACHE and first is not None and sampler.step_index >= first


def joined_rows(batch: ForwardBatch, skips: list[bool]) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The members' inputs concatenated along rows, less the unconditional row of each that `skips`."""
    if not any(skips):
        return batch.joined()  # (a lone member's inputs as they are, uncopied)
    inputs = [_conditional(x) if skip else x for x, skip in zip(batch.inputs, skips)]
    sample, timesteps = (torch.cat([x[i] for x in inputs]) for i in (0, 1))
    return sample, timesteps, {name: torch.cat([x[2][name] for x in inputs]) for name in inputs[0][2]}


def guided(rows: torch.Tensor, batch: ForwardBatch, skips: list[bool]) -> list[torch.Tensor]:
    """Each member's prediction from a forward of `joined_rows`: a skipping member's conditional
    prediction twice, [cond, cond], which its sampler's guidance turns into cond exactly."""
    outputs = rows.split([sampler.rows - int(skip) for sampler, skip in zip(batch.samplers, skips)])
    return [torch.cat([out, out]) if skip else out for out, skip in zip(outputs, skips)]


def past_first_step(sampler) -> bool:
    """The request may skip CFG at its next step."""
    if sampler.mode is not ModeName.SKIP_CFG:
        return False
    first = sampler.mode_state.first_step
    return first is not None and sampler.step_index >= first


def follow_load(sampler, load: float) -> None:
    """Its first skipping step, moved `load` (0 to 1) of the way toward its floor's (SynerDiff's
    load controller on its worker: `engine.round_sequencer`)."""
    if sampler.mode is ModeName.SKIP_CFG:
        sampler.mode_state.first_step = sampler.spec.skip_cfg_step_under(load)


def _skips(sampler) -> bool:
    return past_first_step(sampler) and sampler.mode_state.chosen


def _conditional(model_input: tuple) -> tuple:
    """A CFG request's (sample, timesteps, conditioning) less its unconditional (first) row."""
    sample, timesteps, cond = model_input
    return sample[1:], timesteps[1:], {name: value[1:] for name, value in cond.items()}
