"""What the reuse predictor learns from (PatchedServe §7: input-output similarity across blocks
and timesteps): per (row, block, patch) of exact forwards, how far the block's input moved since
the cached one, and how far its output did.

Recorded by `engine.patch_cache.cached_sd3.statistics_forward`, which computes every patch and
compares each block's fresh input and output with those of earlier steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ReuseSamples:
    """One sample per (row, block, patch, step), float64 / long on the CPU."""

    block: torch.Tensor  # block number
    noise_level: torch.Tensor  # the row's timestep / 1000: SD3's flow-matching sigma
    input_change: torch.Tensor  # relative MSE of the block's input patch against the cached one
    output_change: torch.Tensor  # relative MSE of its output patch against the cached one: reuse's error

    def __len__(self) -> int:
        return len(self.block)

    def reusable(self, tolerance: float) -> torch.Tensor:
        """The label: reusing the cached output would change this patch's output by less than
        `tolerance` (relative MSE)."""
        return self.output_change < tolerance


class ReuseStatistics:
    """Samples appended block by block, kept on the CPU."""

    def __init__(self) -> None:
        self._parts: list[tuple[torch.Tensor, ...]] = []

    def add(self, block: int, noise_level: torch.Tensor, input_change: torch.Tensor,
            output_change: torch.Tensor) -> None:
        """One block's samples: `noise_level` [B], the changes [B, patches]."""
        changes = input_change.shape
        self._parts.append((torch.full(changes, block, dtype=torch.long),
                            noise_level.detach().double().cpu()[:, None].expand(changes),
                            input_change.detach().double().cpu(), output_change.detach().double().cpu()))

    def samples(self) -> ReuseSamples:
        """Everything added so far, flattened. Plain tensors even when recorded under inference
        mode, so a predictor can be fitted to them."""
        if not self._parts:
            raise ValueError("no statistics recorded yet")
        with torch.inference_mode(False):
            columns = [torch.cat([part[i].flatten() for part in self._parts]).clone() for i in range(4)]
        return ReuseSamples(*columns)
