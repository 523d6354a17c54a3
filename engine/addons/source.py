"""Where a served ControlNet's or LoRA's weights come from, and loading it into its model's family."""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import Enum

from diffusers import ControlNetModel

from stepserve.engine.addons.lora import load_lora_file
from stepserve.engine.addons.presets import preset_controlnet, preset_lora
from stepserve.engine.families.base import LOCAL, DiffusionFamily, ModelSource


class AddonKind(str, Enum):
    CONTROLNET = "controlnet"
    LORA = "lora"


@dataclass(frozen=True)
class AddonSource:
    """A ControlNet or LoRA served for base model `model`: a preset (random weights sized for the
    model's preset, deterministic by `seed`) or a local path (a diffusers ControlNet folder; a
    LoRA `.safetensors` file or a folder holding diffusers' `pytorch_lora_weights.safetensors`)."""

    kind: AddonKind
    name: str
    model: str
    preset: str | None = None
    path: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.preset is None) == (self.path is None):
            raise ValueError(f"{self.kind.value} {self.name!r}: give exactly one of preset or path")


def _check_preset(source: AddonSource, model: ModelSource) -> None:
    """A preset add-on is sized for its model's preset (random weights of that shape)."""
    if source.preset is not None and source.preset != model.preset:
        raise ValueError(f"{source.kind.value} {source.name!r}: preset {source.preset!r} does not fit model "
                         f"{model.name!r} (preset {model.preset!r})")


def controlnet_model(source: AddonSource, model: ModelSource) -> ControlNetModel:
    """The ControlNet `source` names, for base model `model`, float32 on the host."""
    _check_preset(source, model)
    if source.preset is not None:
        return preset_controlnet(model.family, source.preset, source.seed)
    if not os.path.isdir(source.path):
        raise FileNotFoundError(f"ControlNet {source.name!r}: folder {source.path!r} does not exist")
    return ControlNetModel.from_pretrained(source.path, **LOCAL)


def load_addon(source: AddonSource, family: DiffusionFamily) -> None:
    """Build or read `source` and serve it on `family` (its model's, with the denoiser loaded)."""
    if not family.takes_addons:
        raise ValueError(f"{source.kind.value} {source.name!r}: model {family.source.name!r} "
                         f"({family.source.family}) takes no ControlNets or LoRAs")
    if source.kind is AddonKind.CONTROLNET:
        family.add_controlnet(source.name, controlnet_model(source, family.source))
    else:
        _check_preset(source, family.source)
        lora = preset_lora(source.name, family.denoiser, source.seed) if source.preset is not None \
            else load_lora_file(source.name, source.path)
        family.add_lora(lora)
