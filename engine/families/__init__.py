"""Model families by name. A family is one architecture; presets and folders are its sources."""

from __future__ import annotations

from typing import Collection

import torch

from .base import ALL_PARTS, DENOISER, TEXT, VAE, DiffusionFamily, ModelSource
from .sd15 import SD15Family
from .wan import WanFamily

FAMILIES: dict[str, type[DiffusionFamily]] = {"sd15": SD15Family, "wan": WanFamily}


def load_family(source: ModelSource, parts: Collection[str], device: str | torch.device = "cpu") -> DiffusionFamily:
    if source.family not in FAMILIES:
        raise ValueError(f"model {source.name!r}: unknown family {source.family!r}; known: {sorted(FAMILIES)}")
    return FAMILIES[source.family].load(source, parts, device)


__all__ = ["ALL_PARTS", "DENOISER", "TEXT", "VAE", "DiffusionFamily", "FAMILIES", "ModelSource", "load_family"]
