"""A `CostModel` that answers as the one it wraps: the base of models that price some forwards
their own way (`instgenie.MaskAwareCosts`: forwards with cached activations;
`patchedserve.PackedForwardCosts`: rounds whose resolutions share a forward) and leave every
other question to the model they wrap.

Beyond the protocol, a profiled model has optional parts (host slowdowns, LoRA loads, the
ControlNet service's time, `models`, ...) that the simulator and the policies look up by name:
those are the base's too, so a wrapped model can stand wherever its base stood.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from stepserve.policies.cost_model import BatchShape, CostModel


class WrappedCosts:
    def __init__(self, base: CostModel) -> None:
        self.base = base

    def denoise_seconds(self, batch: BatchShape) -> float:
        return self.base.denoise_seconds(batch)

    def round_seconds(self, batches: Sequence[BatchShape]) -> float:
        return self.base.round_seconds(batches)

    def step_seconds(self, batch: BatchShape) -> float:
        return self.base.step_seconds(batch)

    def text_encode_seconds(self, model: str, texts: int) -> float:
        return self.base.text_encode_seconds(model, texts)

    def decode_seconds(self, model: str, height: int, width: int, frames: int = 1) -> float:
        return self.base.decode_seconds(model, height, width, frames)

    def request_overhead_seconds(self, model: str) -> float:
        return self.base.request_overhead_seconds(model)

    def solo_seconds(self, model: str, height: int, width: int, steps: int, cfg: bool, frames: int = 1) -> float:
        return self.base.solo_seconds(model, height, width, steps, cfg, frames)

    def __getattr__(self, name: str) -> Any:
        if name == "base" or name.startswith("__"):  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.base, name)
