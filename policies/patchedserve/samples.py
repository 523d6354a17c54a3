"""The Throughput Analyzer's dataset (patchedserve.txt §6.1): random resolution combinations and
the step latency of each.

The paper generates 200 diverse combinations of requests at its three resolutions (up to its
batch cap of 12), measures each batch's latency, and trains on 80% of them. Here a batch is a
`Composition` (rows per resolution: a CFG request adds two rows, so requests with and without
CFG are both covered), and its latency is what a `CostModel` says one worker round of it costs:
`PackedForwardCosts` (mixed_costs.py) where the workers pack resolutions into one forward, the
profile itself where they run one forward per resolution. Nothing is read from disk; the
caller hands the cost model in.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from stepserve.policies.cost_model import BatchShape, CostModel

Size = tuple[int, int]  # (height, width)
# Rows of each resolution present in one batch, sorted by size; no resolution with 0 rows.
Composition = tuple[tuple[Size, int], ...]


@dataclass(frozen=True)
class LatencySample:
    model: str
    composition: Composition
    seconds: float  # one worker round (one denoising step of every member)


def composition_of(rows: Mapping[Size, int]) -> Composition:
    """The canonical composition of a rows-per-size mapping."""
    return tuple(sorted((size, n) for size, n in rows.items() if n))


def random_compositions(sizes: Sequence[Size], max_requests: int, count: int, seed: int,
                        rows_choices: Sequence[int] = (1, 2)) -> list[Composition]:
    """`count` distinct batches of 1 to `max_requests` requests. Each batch draws which sizes it
    holds (each with probability 1/2; one at random if none), then each request one of those
    sizes and its rows from `rows_choices`, uniformly. Drawing every request's size from all `sizes` would leave the
    corners (many requests of one size) out of the dataset, and the analyzer, which is only as
    good as what it saw, would under-price exactly the large one-size batches a busy worker
    holds. Deterministic by `seed`."""
    if not sizes or max_requests < 1 or count < 1 or not rows_choices:
        raise ValueError("need sizes, max_requests >= 1, count >= 1 and rows_choices")
    rng = random.Random(seed)
    found: dict[Composition, None] = {}
    for _ in range(100 * count):
        held = [tuple(s) for s in sizes if rng.random() < 0.5] or [tuple(sizes[rng.randrange(len(sizes))])]
        rows: dict[Size, int] = {}
        for _ in range(rng.randint(1, max_requests)):
            size = held[rng.randrange(len(held))]
            rows[size] = rows.get(size, 0) + rows_choices[rng.randrange(len(rows_choices))]
        found[composition_of(rows)] = None
        if len(found) == count:
            return list(found)
    raise ValueError(f"only {len(found)} distinct batches of <= {max_requests} requests over {len(sizes)} sizes; "
                     f"asked for {count}")


def round_seconds(costs: CostModel, model: str, composition: Composition) -> float:
    """What `costs` says one worker round of the batch costs."""
    return costs.round_seconds([BatchShape(model, h, w, rows) for (h, w), rows in composition])


def training_samples(costs: CostModel, model: str, sizes: Sequence[Size], max_requests: int = 12,
                     count: int = 200, seed: int = 0) -> list[LatencySample]:
    """The paper's dataset for one model: `count` random combinations priced by `costs`."""
    return [LatencySample(model, c, round_seconds(costs, model, c))
            for c in random_compositions(sizes, max_requests, count, seed)]
