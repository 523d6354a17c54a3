"""Test doubles of `stepserve.policies.cost_model.CostModel` with hand-checkable numbers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ConstantCost:
    """Every group costs `step_s` whatever its size; a round adds `round_overhead_s`."""

    step_s: float = 1.0
    round_overhead_s: float = 0.0
    encode_s: float = 0.1
    decode_s: float = 0.5
    overhead_s: float = 0.0

    def denoise_seconds(self, group) -> float:
        return self.step_s

    def round_seconds(self, groups: Sequence) -> float:
        return sum(self.denoise_seconds(g) for g in groups) + (self.round_overhead_s if groups else 0.0)

    def text_encode_seconds(self, model: str, texts: int) -> float:
        return self.encode_s

    def decode_seconds(self, model: str, height: int, width: int) -> float:
        return self.decode_s

    def request_overhead_seconds(self, model: str) -> float:
        return self.overhead_s

    def solo_seconds(self, model: str, height: int, width: int, steps: int, cfg: bool, frames: int = 1) -> float:
        return self.encode_s + steps * self.round_seconds([None]) + self.decode_s + self.overhead_s


@dataclass(frozen=True)
class BatchingCost(ConstantCost):
    """A GPU-like step: a fixed part plus a small cost per batch row and per megapixel-row, so
    batching many requests is much cheaper per request than running them one by one."""

    base_s: float = 0.04
    per_row_s: float = 0.004
    per_mpx_row_s: float = 0.02
    encode_s: float = 0.005
    decode_s: float = 0.01

    def denoise_seconds(self, group) -> float:
        return self.base_s + group.rows * (self.per_row_s + self.per_mpx_row_s * group.height * group.width / 1e6)

    def solo_seconds(self, model: str, height: int, width: int, steps: int, cfg: bool, frames: int = 1) -> float:
        from stepserve.policies.cost_model import GroupShape

        group = GroupShape(model, height, width, 2 if cfg else 1, frames)
        return self.encode_s + steps * self.round_seconds([group]) + self.decode_s + self.overhead_s
