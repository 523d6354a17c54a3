"""Which ControlNets and LoRAs each request of a workload uses: the production mix of SwiftDiffusion
Table 1 (how many per request), a skewed ControlNet popularity (the top few of a small set serve
nearly every call, Fig. 4-left) and a long-tailed LoRA popularity (many LoRAs, Zipf, Fig. 4-right).
Deterministic by seed; the same draws drive live runs and the simulator.
"""

from __future__ import annotations

import base64
import functools
import io
import random
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
import PIL.Image

# Table 1: P(number of ControlNets), P(number of LoRAs) per request.
SERVICE_A = dict(controlnet_counts=(0.0, 0.305, 0.695, 0.0), lora_counts=(0.002, 0.088, 0.91))
SERVICE_B = dict(controlnet_counts=(0.019, 0.251, 0.699, 0.031), lora_counts=(0.072, 0.736, 0.192))
SERVICES = {"A": SERVICE_A, "B": SERVICE_B}


@dataclass(frozen=True)
class AddonMix:
    controlnets: tuple[str, ...]  # most popular first
    loras: tuple[str, ...]  # most popular first
    controlnet_counts: tuple[float, ...]  # P(0), P(1), ... ControlNets per request
    lora_counts: tuple[float, ...]
    controlnet_zipf: float = 2.0  # skewed: a handful cover nearly all calls
    lora_zipf: float = 1.0  # long-tailed

    def __post_init__(self) -> None:
        for name, probs, pool in (("controlnet_counts", self.controlnet_counts, self.controlnets),
                                  ("lora_counts", self.lora_counts, self.loras)):
            if abs(sum(probs) - 1) > 1e-6 or min(probs) < 0:
                raise ValueError(f"{name} must be probabilities summing to 1, got {probs}")
            if max(i for i, p in enumerate(probs) if p > 0) > len(pool):
                raise ValueError(f"{name} asks for more distinct add-ons than the {len(pool)} given")

    @classmethod
    def service(cls, name: str, controlnets: Sequence[str], loras: Sequence[str]) -> "AddonMix":
        """Table 1's mix of service "A" or "B" over these add-ons."""
        return cls(tuple(controlnets), tuple(loras), **SERVICES[name])

    def without_loras(self) -> "AddonMix":
        return replace(self, lora_counts=(1.0,))

    def draw(self, rng: random.Random) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """One request's (ControlNets, LoRAs): distinct names, by count then popularity."""
        return (_distinct(rng, self.controlnets, self.controlnet_counts, self.controlnet_zipf),
                _distinct(rng, self.loras, self.lora_counts, self.lora_zipf))


def _distinct(rng: random.Random, pool: Sequence[str], counts: Sequence[float], zipf: float) -> tuple[str, ...]:
    count = rng.choices(range(len(counts)), weights=counts)[0]
    weights = [1 / (rank + 1) ** zipf for rank in range(len(pool))]
    chosen: list[str] = []
    while len(chosen) < count:
        name = rng.choices(pool, weights=weights)[0]
        if name not in chosen:
            chosen.append(name)
    return tuple(chosen)


def with_addons(requests: Sequence, mix: AddonMix, seed: int) -> list:
    """The workload's requests (`workload.ScheduledRequest`s), each with its draw from `mix`."""
    rng = random.Random(f"{seed}:addons")
    out = []
    for request in requests:
        controlnets, loras = mix.draw(rng)
        out.append(replace(request, controlnets=controlnets, loras=loras))
    return out


@functools.lru_cache(maxsize=64)
def control_image_b64(name: str, width: int, height: int) -> str:
    """A control image for ControlNet `name` (a PNG of seeded noise) as base64."""
    seed = sum(name.encode())
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    PIL.Image.fromarray(pixels).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()
