"""The PatchedServe policy's config."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from stepserve.policies.base import check_batch_cap

PAPER_BATCH_CAP = 12  # §8: every system batches at most 12 requests (memory)


class Predictor(str, Enum):
    MLP = "mlp"  # the Throughput Analyzer (§6.1), trained when the policy is built
    COST_MODEL = "cost_model"  # the cost model the analyzer is trained from, asked directly


@dataclass(frozen=True)
class PatchedServeConfig:
    # None: as many as the worker allows (the paper's systems batch at most 12).
    max_batch_size: int | None = None
    # Throughput mode (§6.2): while the most urgent waiting request's slack (in units of its
    # standalone latency) is above this, a round admits what raises throughput most instead of
    # the most urgent request. inf: always the most urgent first.
    throughput_slack: float = 2.0
    # What predicts a batch's step latency.
    predictor: Predictor = Predictor.MLP
    # The Throughput Analyzer's resolutions, (height, width); a batch with another size, or
    # larger than it was trained on, is priced by the cost model.
    sizes: tuple[tuple[int, int], ...] = ((512, 512), (768, 768), (1024, 1024))
    # Its dataset (§6.1: 200 combinations, trained on 80%) and the seed of both draws.
    training_samples: int = 200
    seed: int = 0

    def __post_init__(self) -> None:
        check_batch_cap("max_batch_size", self.max_batch_size)
        if isinstance(self.throughput_slack, bool) or not isinstance(self.throughput_slack, (int, float)) or math.isnan(
                self.throughput_slack):
            raise ValueError(f"throughput_slack must be a number (inf: never), got {self.throughput_slack!r}")
        object.__setattr__(self, "predictor", Predictor(self.predictor))
        sizes = tuple(tuple(size) for size in self.sizes)  # YAML has no tuples
        if not sizes or len(set(sizes)) != len(sizes) or any(
                len(s) != 2 or any(isinstance(x, bool) or not isinstance(x, int) or x < 8 for x in s) for s in sizes):
            raise ValueError(f"sizes must be distinct (height, width) pairs of ints >= 8, got {self.sizes!r}")
        object.__setattr__(self, "sizes", sizes)
        if isinstance(self.training_samples, bool) or not isinstance(self.training_samples, int) or (
                self.training_samples < 10):
            raise ValueError(f"training_samples must be an int >= 10, got {self.training_samples!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")

    @property
    def training_batch(self) -> int:
        """The most requests in one training batch."""
        return self.max_batch_size or PAPER_BATCH_CAP

