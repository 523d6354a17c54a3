"""Which add-on modes a worker runs. LoRA joining is always there (exact with a bound of 0, and
it brings the LoRAs a worker does not hold yet); stale ControlNets only when switched on."""

from __future__ import annotations

from stepserve.engine.addon_modes.base import AddonMode, AddonModeName
from stepserve.engine.addon_modes.lora_joining import LoraJoining
from stepserve.engine.addon_modes.stale_controlnet import StaleControlNets
from stepserve.engine.mode_settings import ModeSettings


def addon_modes(settings: ModeSettings = ModeSettings()) -> dict[AddonModeName, AddonMode]:
    """A step runner's add-on modes by name, from its settings (`loras`, `lora_bounds`,
    `stale_controlnets`)."""
    modes: list[AddonMode] = [LoraJoining(settings.loras, settings.lora_bounds)]
    if settings.stale_controlnets:
        modes.append(StaleControlNets())
    return {mode.name: mode for mode in modes}
