"""SwiftDiffusion's pipelined ControlNets for slow links (§4.1), an approximation
(`controlnet_service.stale`): where the ControlNet service runs a family's ControlNets, a step
adds the residuals of the request's previous step's input while this step's are computed for
the next, so neither the ControlNet nor the transfer is waited for.

Its state per request is one `StaleResiduals` per ControlNet the request uses. It is not
exported: a request that moves waits once for fresh residuals on its new worker, and goes on
stale from there. A ControlNet off at a step (scale 0) drops what it held, which would otherwise
be more than one step old when it is on again."""

from __future__ import annotations

from dataclasses import replace

from stepserve.engine.addon_modes.base import AddonMode, AddonModeName
from stepserve.engine.addons import StepAddons
from stepserve.engine.addons.controlnet import StaleResiduals


class StaleControlNets(AddonMode):
    name = AddonModeName.STALE_CONTROLNET

    def serves(self, family) -> bool:
        """Only where its ControlNets run as a service: on the worker there is no link to hide."""
        return family.takes_addons and family.controlnet_service is not None

    def admit(self, sampler, family) -> None:
        if sampler.spec.controlnets:
            sampler.addon_state[self.name] = tuple(StaleResiduals() for _ in sampler.spec.controlnets)

    def adjust(self, sampler, addons: StepAddons) -> StepAddons:
        holders = sampler.addon_state.get(self.name)
        if holders is None:
            return addons
        for use, holder in zip(addons.controls, holders):
            if use.scale == 0.0:
                holder.clear()
        return replace(addons, controls=tuple(replace(use, stale=holder)
                                              for use, holder in zip(addons.controls, holders)))
