"""The Throughput Analyzer's dataset (patchedserve.txt §6.1): batches of mixed resolutions and the
step latency of each, measured where the profile has the batch, filled in by the cost model else.

The paper measures 200 diverse combinations of requests at its three resolutions (up to its
batch cap of 12) and trains on 80% of them. Here a batch is a `Composition` (rows per
resolution: a CFG request adds two rows, so requests with and without CFG are both covered) and
a sample's latency is one worker round of it, from one of two sources (`LatencySample.measured`):

- measured (`measured_samples`): what `stepserve profile` timed on this device, the denoise rows
  of one size and the packed rows of several (`groups`), plus the round's overheads the profile
  times apart (the analyzer predicts a whole round, as the cost model's price does);
- filled in (`training_samples`): the paper's random combinations that no measured row has,
  priced by a `CostModel` (`PackedForwardCosts` where the workers pack resolutions into one
  forward, the profile itself where they run one forward per resolution). A profile measures a
  grid; the analyzer must also answer between its points, and a measured batch keeps its
  measured price.

Nothing is read from disk: the caller hands in the rows and the cost model.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from stepserve.policies.cost_model import DENOISE, BatchShape, CostModel, ProfileRow

Size = tuple[int, int]  # (height, width)
# Rows of each resolution present in one batch, sorted by size; no resolution with 0 rows.
Composition = tuple[tuple[Size, int], ...]


@dataclass(frozen=True)
class LatencySample:
    model: str
    composition: Composition
    seconds: float  # one worker round (one denoising step of every member)
    measured: bool  # timed on the device (`measured_samples`); False: filled in by the cost model


def composition_of(rows: Mapping[Size, int]) -> Composition:
    """The canonical composition of a rows-per-size mapping."""
    return tuple(sorted((size, n) for size, n in rows.items() if n))


def batches_of(model: str, composition: Composition) -> list[BatchShape]:
    """The plain image batches, one per resolution, of a composition."""
    return [BatchShape(model, h, w, rows) for (h, w), rows in composition]


def measured_samples(rows: Iterable[ProfileRow], model: str, sizes: Collection[Size],
                     overhead: Callable[[Sequence[BatchShape]], float]) -> list[LatencySample]:
    """One sample per batch the profile `rows` measured for `model` at `sizes`: its plain image
    forwards at SP degree 1, of one size or of several packed into one (`groups`). A sample's
    seconds are the measured forward plus `overhead` of its batches (the profile's round
    overheads: `ProfiledCostModel.round_overhead_seconds`). Rows that are not measurements (a
    derived profile's citations) are no samples; a batch measured more than once (a rerun, two
    profiles) keeps the median of its forwards."""
    forwards: dict[Composition, list[float]] = {}
    for row in rows:
        if (row.model != model or row.component != DENOISE or row.frames != 1 or row.sp_degree != 1
                or row.mask_ratio < 1.0 or not row.measured):
            continue
        composition = composition_of({(h, w): n for h, w, n in row.groups or ((row.height, row.width, row.rows),)})
        if all(size in sizes for size, _ in composition):
            forwards.setdefault(composition, []).append(row.seconds)
    return [LatencySample(model, c, statistics.median(s) + overhead(batches_of(model, c)), True)
            for c, s in forwards.items()]


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
    return costs.round_seconds(batches_of(model, composition))


def training_samples(costs: CostModel, model: str, sizes: Sequence[Size], max_requests: int = 12,
                     count: int = 200, seed: int = 0,
                     measured: Sequence[LatencySample] = ()) -> list[LatencySample]:
    """The analyzer's dataset for one model: the `measured` samples, then the paper's `count`
    random combinations priced by `costs` (filled in), less those a measured sample has."""
    known = {s.composition for s in measured}
    return [*measured, *(LatencySample(model, c, round_seconds(costs, model, c), False)
                         for c in random_compositions(sizes, max_requests, count, seed) if c not in known)]
