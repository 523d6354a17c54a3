"""Where a served ControlNet's or LoRA's weights come from, and loading it into its model's family."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
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
    # A LoRA's bound on a late join (SwiftDiffusion §4.2's k, as a fraction of a request's steps:
    # `stepserve lora-bound` measures it); None: the pool's `lora_loading.join_by`.
    join_by: float | None = None

    def __post_init__(self) -> None:
        if (self.preset is None) == (self.path is None):
            raise ValueError(f"{self.kind.value} {self.name!r}: give exactly one of preset or path")
        if self.join_by is not None and (self.kind is not AddonKind.LORA or not 0.0 <= self.join_by < 1.0):
            raise ValueError(f"{self.kind.value} {self.name!r}: join_by is a LoRA's, in [0, 1), got {self.join_by!r}")


@dataclass(frozen=True)
class LoraJoinBounds:
    """How late each LoRA may join a request: the fraction of its steps that may run before the
    LoRA applies (bounded asynchronous loading, SwiftDiffusion §4.2; 0: from the first step,
    exact). Each LoRA's own bound where it has one (its profiled k), else `default`."""

    default: float = 0.0
    per_lora: Mapping[tuple[str, str], float] = field(default_factory=dict)  # (model, LoRA) -> bound

    def __post_init__(self) -> None:
        for bound in (self.default, *self.per_lora.values()):
            if not 0.0 <= bound < 1.0:
                raise ValueError(f"a LoRA join bound must be in [0, 1), got {bound!r}")

    @classmethod
    def of(cls, sources: Iterable[AddonSource], default: float = 0.0) -> "LoraJoinBounds":
        return cls(default, {(s.model, s.name): s.join_by for s in sources
                             if s.kind is AddonKind.LORA and s.join_by is not None})

    def bound(self, model: str, lora: str) -> float:
        return self.per_lora.get((model, lora), self.default)

    def tightest(self, model: str, loras: Iterable[str]) -> float:
        """The least bound of these LoRAs (0 when any must apply from the first step)."""
        return min((self.bound(model, name) for name in loras), default=self.default)


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
