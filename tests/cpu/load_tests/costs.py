"""Test doubles of `stepserve.policies.cost_model.CostModel` with hand-checkable numbers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from stepserve.policies.cost_model import BatchShape


@dataclass(frozen=True)
class ConstantCost:
    """Every batch costs `step_s` whatever its size; a round adds `round_overhead_s`."""

    step_s: float = 1.0
    round_overhead_s: float = 0.0
    encode_s: float = 0.1
    decode_s: float = 0.5
    overhead_s: float = 0.0

    def denoise_seconds(self, batch: BatchShape) -> float:
        return self.step_s

    def round_seconds(self, batches: Sequence[BatchShape]) -> float:
        return sum(self.denoise_seconds(b) for b in batches) + (self.round_overhead_s if batches else 0.0)

    def step_seconds(self, batch: BatchShape) -> float:
        return self.round_seconds([batch])

    def text_encode_seconds(self, model: str, texts: int) -> float:
        return self.encode_s

    def decode_seconds(self, model: str, height: int, width: int, frames: int = 1) -> float:
        return self.decode_s

    def request_overhead_seconds(self, model: str) -> float:
        return self.overhead_s

    def solo_seconds(self, model: str, height: int, width: int, steps: int, cfg: bool, frames: int = 1) -> float:
        batch = BatchShape(model, height, width, 2 if cfg else 1, frames)
        return (self.encode_s + steps * self.round_seconds([batch]) + self.decode_seconds(model, height, width, frames)
                + self.overhead_s)


@dataclass(frozen=True)
class BatchingCost(ConstantCost):
    """A GPU-like step: a fixed part plus a small cost per batch row and per megapixel-row, so
    batching many requests is much cheaper per request than running them one by one. A
    video's rows weigh by its frames; sequence parallelism divides the work over the degree
    (perfect scaling: the doubles need numbers, not a model of the all-to-all)."""

    base_s: float = 0.04
    per_row_s: float = 0.004
    per_mpx_row_s: float = 0.02
    encode_s: float = 0.005
    decode_s: float = 0.01

    def denoise_seconds(self, batch: BatchShape) -> float:
        work = batch.rows * (self.per_row_s + self.per_mpx_row_s * batch.pixels / 1e6)
        return self.base_s + work / batch.sp_degree
