"""Model families by name. A family is one architecture; presets and folders are its sources."""

from __future__ import annotations

import importlib
from collections.abc import Collection, Iterator, Mapping

import torch

from stepserve.engine.addons.controlnet import RemoteControlNets
from stepserve.engine.families.base import ALL_PARTS, DENOISER, TEXT, VAE, DiffusionFamily, ModelSource

# name -> (module, class). A family's module is imported when the family is first looked up:
# each pulls in its own diffusers pipelines and engine wrappers, and `stepserve generate` needs one.
_WHERE = {
    "sd15": ("stepserve.engine.families.sd15", "SD15Family"),
    "sdxl": ("stepserve.engine.families.sdxl", "SDXLFamily"),
    "sd3": ("stepserve.engine.families.sd3", "SD3Family"),
    "flux": ("stepserve.engine.families.flux", "FluxFamily"),
    "wan": ("stepserve.engine.families.wan", "WanFamily"),
    "wan-ti2v": ("stepserve.engine.families.wan", "WanTI2VFamily"),
}


class _Families(Mapping[str, type[DiffusionFamily]]):
    """Read-only name -> family class; names and membership need no import, a lookup imports one family."""

    def __getitem__(self, name: str) -> type[DiffusionFamily]:
        module, cls = _WHERE[name]
        return getattr(importlib.import_module(module), cls)

    def __iter__(self) -> Iterator[str]:
        return iter(_WHERE)

    def __len__(self) -> int:
        return len(_WHERE)


FAMILIES: Mapping[str, type[DiffusionFamily]] = _Families()


def family_class(name: str) -> type[DiffusionFamily]:
    """The family class registered as `name`: its class attributes say what it can serve."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}; known: {sorted(FAMILIES)}") from None


def resolve_device(device: str) -> str:
    """A configured device: "auto" is CUDA where there is one, else the CPU."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def load_family(source: ModelSource, parts: Collection[str], device: str | torch.device = "cpu",
                remote: RemoteControlNets | None = None) -> DiffusionFamily:
    """`remote`: where the family's ControlNets run when not on this worker (families that take
    add-ons only)."""
    if source.family not in FAMILIES:
        raise ValueError(f"model {source.name!r}: unknown family {source.family!r}; known: {sorted(FAMILIES)}")
    cls = FAMILIES[source.family]
    if remote is None:
        return cls.load(source, parts, device)
    if not cls.takes_addons:
        raise ValueError(f"model {source.name!r} ({source.family}) takes no ControlNets")
    return cls.load(source, parts, device, remote)


__all__ = [
    "ALL_PARTS", "DENOISER", "TEXT", "VAE", "DiffusionFamily", "FAMILIES", "ModelSource", "family_class",
    "load_family",
]
