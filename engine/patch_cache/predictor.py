"""The cache reuse predictor (PatchedServe §7): whether a patch's cached block output may stand
in for this step's, from features that cost almost nothing next to the block.

The paper trains a random forest on input-output similarity (MSE) across blocks and timesteps.
Here a logistic regression over three features, which makes it a calibrated threshold rule one
can read: reuse when

    change_weight * log10(input change) + noise_weight * noise level + block_bias[block] > 0,

the input change being the patch's relative MSE against the input its cached output came from
(`PatchGrid.relative_mse`), the noise level the row's timestep / 1000. So each block has its own
threshold on the input change, moving linearly with the noise level. Labels come from exact
generations (`engine.patch_cache.calibration`): a sample is reusable when the cached output
differs from the exact one by less than a tolerance (relative MSE). The input change's weight is
kept <= 0 (a patch whose input moved more is never likelier to be reused): where the noise level
alone separates the labels, a free fit may otherwise give the change a weight of either sign,
and a cached run, whose reused patches drift further every step, would then reuse a patch the
more the further it drifted. Fitting has no randomness: standardized features, zero start,
full-batch L-BFGS in float64 on the CPU, a small L2 penalty that keeps weights finite where a
block's labels are all alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from stepserve.engine.patch_cache.statistics import ReuseSamples

# An input change of 0 (the patch's input did not move) maps to log10(1e-12), not -inf.
CHANGE_FLOOR = 1e-12
L2 = 1e-4  # on the standardized weights: small next to the loss, enough to keep them finite
ITERATIONS = 200  # L-BFGS iterations at most


def log_change(change: torch.Tensor) -> torch.Tensor:
    return torch.log10(change + CHANGE_FLOOR)


@dataclass(frozen=True)
class ReusePredictor:
    """The fitted rule (see the module docstring); `tolerance`: the output change (relative MSE)
    its labels allowed."""

    change_weight: float
    noise_weight: float
    block_bias: tuple[float, ...]
    tolerance: float

    def logits(self, block: torch.Tensor, noise_level: torch.Tensor, input_change: torch.Tensor) -> torch.Tensor:
        """Broadcast over `block` (long), `noise_level` and `input_change`; > 0 means reuse."""
        bias = torch.tensor(self.block_bias, dtype=input_change.dtype, device=input_change.device)[block]
        return self._without_bias(noise_level, input_change) + bias

    def reusable(self, block: int, noise_level: torch.Tensor, input_change: torch.Tensor) -> torch.Tensor:
        """Block `block`'s decision for input changes [B, patches] of rows at `noise_level` [B]:
        [B, patches] bool. (The bias is a Python number here: no tensor made per block.)"""
        if not 0 <= block < len(self.block_bias):
            raise ValueError(f"the predictor knows {len(self.block_bias)} blocks, not block {block}")
        return self._without_bias(noise_level[:, None], input_change) + self.block_bias[block] > 0

    def _without_bias(self, noise_level: torch.Tensor, input_change: torch.Tensor) -> torch.Tensor:
        return self.change_weight * log_change(input_change) + self.noise_weight * noise_level


@dataclass(frozen=True)
class PredictorScore:
    """How a predictor does on samples, against their labels at its tolerance."""

    samples: int
    accuracy: float
    majority: float  # the accuracy of always answering the commoner label
    reused: float  # share of samples it reuses
    false_reuse: float  # share of samples it reuses though their output changed more than the tolerance


def fit_predictor(samples: ReuseSamples, tolerance: float, blocks: int) -> ReusePredictor:
    """The logistic regression of `samples`' labels at `tolerance` on their features, for a model
    of `blocks` blocks."""
    if tolerance <= 0:
        raise ValueError(f"the tolerance is a relative MSE > 0, got {tolerance}")
    if len(samples) == 0:
        raise ValueError("no samples to fit")
    if int(samples.block.max()) >= blocks:
        raise ValueError(f"samples name block {int(samples.block.max())} of a model of {blocks} blocks")
    with torch.inference_mode(False), torch.enable_grad():
        change, noise = log_change(samples.input_change), samples.noise_level
        scale = [(float(x.mean()), float(x.std()) or 1.0) for x in (change, noise)]
        features = torch.cat([torch.stack([(change - scale[0][0]) / scale[0][1], (noise - scale[1][0]) / scale[1][1]],
                                          dim=1), F.one_hot(samples.block, blocks).double()], dim=1)
        labels = samples.reusable(tolerance).double()
        # The input change's weight is -softplus(free[0]): never > 0 (see the module docstring).
        free = torch.zeros(features.shape[1], dtype=torch.float64, requires_grad=True)
        optimizer = torch.optim.LBFGS([free], max_iter=ITERATIONS, tolerance_grad=1e-9, tolerance_change=1e-12,
                                      history_size=20, line_search_fn="strong_wolfe")

        def weights() -> torch.Tensor:
            return torch.cat([-F.softplus(free[:1]), free[1:]])

        def loss() -> torch.Tensor:
            optimizer.zero_grad()
            w = weights()
            value = F.binary_cross_entropy_with_logits(features @ w, labels) + L2 * w.square().sum()
            value.backward()
            return value

        optimizer.step(loss)
        w = weights().detach().tolist()
    if not all(math.isfinite(v) for v in w):
        raise ValueError(f"the fit diverged: weights {w}")
    # Back from standardized features: a * (f - m) / s = (a / s) f - a m / s.
    change_weight, noise_weight = w[0] / scale[0][1], w[1] / scale[1][1]
    offset = change_weight * scale[0][0] + noise_weight * scale[1][0]
    return ReusePredictor(change_weight, noise_weight, tuple(b - offset for b in w[2:]), tolerance)


def score(predictor: ReusePredictor, samples: ReuseSamples) -> PredictorScore:
    """`predictor` on `samples` (held out from its fit, for an honest accuracy)."""
    if len(samples) == 0:
        raise ValueError("no samples to score")
    truth = samples.reusable(predictor.tolerance)
    reuse = predictor.logits(samples.block, samples.noise_level, samples.input_change) > 0
    share = float(truth.double().mean())
    return PredictorScore(samples=len(samples), accuracy=float((reuse == truth).double().mean()),
                          majority=max(share, 1 - share), reused=float(reuse.double().mean()),
                          false_reuse=float((reuse & ~truth).double().mean()))

