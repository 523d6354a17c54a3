"""Add-ons to a denoiser forward: ControlNet residuals and LoRA updates, by the rows that use them."""

from __future__ import annotations

from dataclasses import dataclass

from stepserve.engine.addons.controlnet import ControlRows
from stepserve.engine.addons.lora import LoraRows


@dataclass(frozen=True)
class StepAddons:
    """What one forward adds to its denoiser: each request's ControlNets and LoRAs at this step."""

    controls: tuple[ControlRows, ...] = ()
    loras: tuple[LoraRows, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.controls or self.loras)


__all__ = ["ControlRows", "LoraRows", "StepAddons"]
