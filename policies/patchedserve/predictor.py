"""The Throughput Analyzer (patchedserve.txt §6.1): a small MLP that predicts the step latency of a
batch of mixed resolutions.

Why learned: with N resolutions and up to M requests a batch can be one of sum_i C(i+N-1, N-1)
combinations, too many to profile, and a packed batch costs less than the sum of its members,
so adding up per-resolution profiles would over-price it and admit too little.

Inputs, the paper's three: the task count of each resolution (here its rows, so a CFG request
counts two), the number of distinct resolutions, and the total patch count (rows x pixels over
a 64 x 64 px patch: any fixed patch area gives a proportional count). Output: the log of the
step's seconds, so the squared error it is fitted by is a relative one (a 20 ms and a 700 ms
batch weigh alike). Two tanh hidden layers, full-batch Adam with a cosine learning rate, inputs
and output standardized on the training set; numpy, on the CPU, deterministic by seed. The
paper's MLP predicts within 3.7% on the 20% of its 200 measured combinations held out;
`holdout_error` holds out 20% of the measured batches (samples.py: the profile's one-size and
packed forwards), trains on the rest and on the batches the cost model filled in, and scores the
measured ones only.

It answers only for the batches it was trained to cover: resolutions of its vocabulary and no
more rows than it saw. Anything else is for the caller to price another way.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from stepserve.policies.patchedserve.samples import Composition, LatencySample, Size

PATCH_PIXELS = 64 * 64


class ThroughputAnalyzer:
    """The fitted MLP of one model; build it with `fit`."""

    def __init__(self, model: str, sizes: tuple[Size, ...], max_rows: int, weights: list[np.ndarray],
                 x_scale: tuple[np.ndarray, np.ndarray], y_scale: tuple[float, float]) -> None:
        self.model = model
        self.sizes = sizes
        self.max_rows = max_rows
        self._weights = weights  # W1, b1, W2, b2, W3, b3
        self._x_mean, self._x_std = x_scale
        self._y_mean, self._y_std = y_scale
        self._column = {size: i for i, size in enumerate(sizes)}

    @classmethod
    def fit(cls, samples: Sequence[LatencySample], seed: int = 0, hidden: int = 32, iterations: int = 2000,
            learning_rate: float = 0.01) -> "ThroughputAnalyzer":
        """Train on `samples` (one model's); the vocabulary is every size they contain."""
        if not samples:
            raise ValueError("no samples to train on")
        models = {s.model for s in samples}
        if len(models) != 1:
            raise ValueError(f"one analyzer per model, got samples of {sorted(models)}")
        if any(not s.seconds > 0 for s in samples):
            raise ValueError("sample latencies must be > 0")
        sizes = tuple(sorted({size for s in samples for size, _ in s.composition}))
        max_rows = max(sum(n for _, n in s.composition) for s in samples)
        column = {size: i for i, size in enumerate(sizes)}
        x = np.array([_features(column, s.composition) for s in samples])
        y = np.log(np.array([s.seconds for s in samples]))
        x_mean, x_std = x.mean(axis=0), x.std(axis=0)
        x_std[x_std == 0] = 1.0  # a constant feature (one size only) carries nothing
        y_mean, y_std = float(y.mean()), float(y.std()) or 1.0
        weights = _train((x - x_mean) / x_std, (y - y_mean) / y_std, seed, hidden, iterations, learning_rate)
        return cls(models.pop(), sizes, max_rows, weights, (x_mean, x_std), (y_mean, y_std))

    def covers(self, composition: Composition) -> bool:
        return (bool(composition) and all(size in self._column for size, _ in composition)
                and sum(rows for _, rows in composition) <= self.max_rows)

    def predict(self, composition: Composition) -> float:
        """Predicted seconds of one step of the batch; ValueError for one it does not cover."""
        if not self.covers(composition):
            raise ValueError(f"{self.model}: batch {composition} is outside what the analyzer was trained on "
                             f"(sizes {self.sizes}, <= {self.max_rows} rows)")
        x = (np.array(_features(self._column, composition)) - self._x_mean) / self._x_std
        w1, b1, w2, b2, w3, b3 = self._weights
        out = np.tanh(np.tanh(x @ w1 + b1) @ w2 + b2) @ w3 + b3
        return math.exp(float(out[0]) * self._y_std + self._y_mean)


def _features(column: dict[Size, int], composition: Composition) -> list[float]:
    """Rows per vocabulary size (in `column` order), distinct resolutions, total patches."""
    out = [0.0] * (len(column) + 2)
    for size, rows in composition:
        out[column[size]] = float(rows)
        out[-1] += rows * size[0] * size[1] / PATCH_PIXELS
    out[-2] = float(len(composition))
    return out


def _train(x: np.ndarray, y: np.ndarray, seed: int, hidden: int, iterations: int,
           learning_rate: float) -> list[np.ndarray]:
    """Full-batch Adam on the mean squared error; returns W1, b1, W2, b2, W3, b3."""
    rng = np.random.default_rng(seed)
    shapes = [(x.shape[1], hidden), (hidden, hidden), (hidden, 1)]
    params: list[np.ndarray] = []
    for rows, cols in shapes:
        params += [rng.normal(0.0, 1.0 / math.sqrt(rows), (rows, cols)), np.zeros(cols)]
    first = [np.zeros_like(p) for p in params]
    second = [np.zeros_like(p) for p in params]
    n = len(y)
    for t in range(1, iterations + 1):
        w1, b1, w2, b2, w3, b3 = params
        h1 = np.tanh(x @ w1 + b1)
        h2 = np.tanh(h1 @ w2 + b2)
        err = ((h2 @ w3 + b3)[:, 0] - y)[:, None] * (2.0 / n)
        d2 = (err @ w3.T) * (1 - h2 ** 2)
        d1 = (d2 @ w2.T) * (1 - h1 ** 2)
        grads = [x.T @ d1, d1.sum(0), h1.T @ d2, d2.sum(0), h2.T @ err, err.sum(0)]
        rate = learning_rate * 0.5 * (1 + math.cos(math.pi * t / iterations)) + 1e-4
        for p, g, m, v in zip(params, grads, first, second):
            m *= 0.9
            m += 0.1 * g
            v *= 0.999
            v += 0.001 * g * g
            p -= rate * (m / (1 - 0.9 ** t)) / (np.sqrt(v / (1 - 0.999 ** t)) + 1e-8)
    return params


@dataclass(frozen=True)
class HoldoutReport:
    """The analyzer's relative error on measured samples it was not trained on, and what it was
    trained on. No error (None) where no measured sample was held out and scored: too few measured
    rows to spare one (or none at all), so the only other score would be against the cost model."""

    measured: int  # measured samples trained on
    filled: int  # filled-in samples trained on
    test: int  # held-out measured samples scored
    mean_rel_err: float | None
    max_rel_err: float | None

    @property
    def train(self) -> int:
        return self.measured + self.filled

    def format(self, model: str) -> str:
        used = f"trained on {self.measured} measured + {self.filled} filled-in batches"
        if self.mean_rel_err is None or self.max_rel_err is None:
            return f"  {model} throughput analyzer: {used}; held-out error n/a (no measured batch held out)"
        return (f"  {model} throughput analyzer: {used}; held-out error on {self.test} measured batches "
                f"mean {self.mean_rel_err:.1%}, max {self.max_rel_err:.1%}")


def holdout_error(samples: Sequence[LatencySample], seed: int = 0, train_share: float = 0.8, hidden: int = 32,
                  iterations: int = 2000) -> tuple[ThroughputAnalyzer, HoldoutReport]:
    """The paper's evaluation on measured batches: train on a random `train_share` (80%) of the
    measured samples and every filled-in one, report the relative error on the measured rest.
    Filled-in samples are never scored: their prices are the cost model's, and matching them
    says how well the MLP learned the cost model, not the machine."""
    if not 0 < train_share < 1:
        raise ValueError(f"train_share must be in (0, 1), got {train_share}")
    measured = [s for s in samples if s.measured]
    filled = [s for s in samples if not s.measured]
    order = list(range(len(measured)))
    random.Random(seed).shuffle(order)
    cut = round(train_share * len(measured))
    kept, held = [measured[i] for i in order[:cut]], [measured[i] for i in order[cut:]]
    analyzer = ThroughputAnalyzer.fit(kept + filled, seed=seed, hidden=hidden, iterations=iterations)
    # A held-out batch larger than any trained on is an extrapolation the policy never asks
    # for (it prices those by the cost model): left out of the score.
    scored = [s for s in held if analyzer.covers(s.composition)]
    errors = [abs(analyzer.predict(s.composition) - s.seconds) / s.seconds for s in scored]
    return analyzer, HoldoutReport(len(kept), len(filled), len(scored), sum(errors) / len(errors) if errors else None,
                                   max(errors, default=None))
