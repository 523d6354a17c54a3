"""Which add-on modes a worker runs. LoRA joining is always there (exact with a bound of 0, and
it brings the LoRAs a worker does not hold yet); stale ControlNets only when switched on."""

from __future__ import annotations

from stepserve.engine.addon_modes.base import AddonMode, AddonModeName
from stepserve.engine.addon_modes.lora_joining import LoraJoining
from stepserve.engine.addon_modes.stale_controlnet import StaleControlNets
from stepserve.engine.addons.lora import LoraLoader
from stepserve.engine.addons.source import LoraJoinBounds


def addon_modes(*, loras: LoraLoader | None = None, lora_bounds: LoraJoinBounds = LoraJoinBounds(),
                stale_controlnets: bool = False) -> dict[AddonModeName, AddonMode]:
    """A step runner's add-on modes by name, from their settings (keywords of `StepRunner`; a
    worker's come from `actors.denoiser.mode_settings`). `loras`: brings LoRAs that are not in
    the families yet (None: every LoRA a request names must be loaded already); `lora_bounds`:
    the fraction of a request's steps that may run before each of its LoRAs has arrived (0:
    none, exact); `stale_controlnets`: ControlNets the service runs may be one step stale."""
    modes: list[AddonMode] = [LoraJoining(loras, lora_bounds)]
    if stale_controlnets:
        modes.append(StaleControlNets())
    return {mode.name: mode for mode in modes}
