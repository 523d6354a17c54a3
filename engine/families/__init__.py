"""Model families by name. A family is one architecture; presets and folders are its sources."""

from __future__ import annotations

from typing import Collection

import torch

from stepserve.engine.families.base import ALL_PARTS, DENOISER, TEXT, VAE, DiffusionFamily, ModelSource
from stepserve.engine.families.flux import FluxFamily
from stepserve.engine.families.sd15 import SD15Family
from stepserve.engine.families.sd3 import SD3Family
from stepserve.engine.families.sdxl import SDXLFamily
from stepserve.engine.families.wan import WanFamily, WanTI2VFamily

FAMILIES: dict[str, type[DiffusionFamily]] = {
    "sd15": SD15Family,
    "sdxl": SDXLFamily,
    "sd3": SD3Family,
    "flux": FluxFamily,
    "wan": WanFamily,
    "wan-ti2v": WanTI2VFamily,
}


def family_class(name: str) -> type[DiffusionFamily]:
    """The family class registered as `name`: its class attributes say what it can serve."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}; known: {sorted(FAMILIES)}") from None


def load_family(source: ModelSource, parts: Collection[str], device: str | torch.device = "cpu") -> DiffusionFamily:
    if source.family not in FAMILIES:
        raise ValueError(f"model {source.name!r}: unknown family {source.family!r}; known: {sorted(FAMILIES)}")
    return FAMILIES[source.family].load(source, parts, device)


__all__ = [
    "ALL_PARTS", "DENOISER", "TEXT", "VAE", "DiffusionFamily", "FAMILIES", "ModelSource", "family_class",
    "load_family",
]
