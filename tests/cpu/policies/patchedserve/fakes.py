"""An analytic cost model for hand-made rounds, and a step-by-step finish oracle."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from stepserve.policies.cost_model import BatchShape
from stepserve.policies.types import RequestView

# snapshots.SMALL and LARGE are 64 and 128 px.
PER_ROW = {64: 0.005, 128: 0.02}


@dataclass
class LinearCosts:
    """A `CostModel` of one formula: a forward costs `fixed` plus `per_row[height]` a row, a round
    adds `round_s`. So one CFG request alone steps in 20 ms at 64 px and 50 ms at 128 px, and a
    second request of the same size adds 10 ms (64 px) or 40 ms (128 px) to the step."""

    fixed: float = 0.01
    per_row: dict[int, float] = field(default_factory=lambda: dict(PER_ROW))
    round_s: float = 0.0

    def denoise_seconds(self, batch: BatchShape) -> float:
        return self.fixed + self.per_row[batch.height] * batch.rows

    def round_seconds(self, batches: Sequence[BatchShape]) -> float:
        return sum(self.denoise_seconds(b) for b in batches) + (self.round_s if batches else 0.0)

    def step_seconds(self, batch: BatchShape) -> float:
        return self.round_seconds([batch])

    def text_encode_seconds(self, model: str, texts: int) -> float:
        return 0.01

    def decode_seconds(self, model: str, height: int, width: int, frames: int = 1) -> float:
        return 0.05

    def request_overhead_seconds(self, model: str) -> float:
        return 0.0

    def solo_seconds(self, model: str, height: int, width: int, steps: int, cfg: bool, frames: int = 1) -> float:
        return 0.06 + steps * self.round_seconds([BatchShape(model, height, width, 2 if cfg else 1, frames)])


def stepped_finishes(batch: Sequence[RequestView], start: float,
                     step: Callable[[Sequence[RequestView]], float]) -> dict[str, float]:
    """Each member's end of denoising, the batch run one step at a time from `start` (the
    oracle for schedulability.finish_times, which jumps from one departure to the next)."""
    left = {v.request_id: v.steps_left for v in batch}
    finish = {rid: start for rid, n in left.items() if n == 0}
    at = start
    while any(left.values()):
        running = [v for v in batch if left[v.request_id] > 0]
        at += step(running)
        for v in running:
            left[v.request_id] -= 1
            if left[v.request_id] == 0:
                finish[v.request_id] = at
    return finish
