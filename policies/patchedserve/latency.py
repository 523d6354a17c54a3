"""How long one worker step of a batch takes, as the scheduler predicts it.

The Throughput Analyzer (predictor.py) answers where it covers the batch: plain images of one
model it was trained for (on the batches its profile measured, the cost model filling in the
rest: samples.py), at sizes of its vocabulary, within the rows it saw. Anything else (another
model or size, a bigger batch, videos, add-ons, cached edits) is priced by the cost model, as is
everything when no analyzer is given.
Answers are remembered per batch: a round asks about the same few batches many times.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from stepserve.policies.cost_model import CostModel, computed_share
from stepserve.policies.instgenie.placement import batch_shapes
from stepserve.policies.patchedserve.predictor import ThroughputAnalyzer
from stepserve.policies.patchedserve.samples import Composition, composition_of, round_seconds
from stepserve.policies.types import RequestView

MEMO_LIMIT = 1 << 16  # distinct batches remembered before the memo starts over


def plain_composition(views: Sequence[RequestView]) -> tuple[str, Composition] | None:
    """(model, rows per size) of a batch of plain images of one model; None for any other."""
    model = views[0].shape_key.model
    rows: dict[tuple[int, int], int] = {}
    for v in views:
        key = v.shape_key
        if (v.is_video or key.model != model or key.frames != 1 or key.loras or key.cached_edit or v.loras
                or v.controlnets or computed_share(v) < 1.0):
            return None
        size = (key.height, key.width)
        rows[size] = rows.get(size, 0) + v.rows
    return model, composition_of(rows)


class BatchLatency:
    """Predicted seconds of one step of a batch on one worker (a round that steps every member)."""

    def __init__(self, pricing: CostModel, analyzers: Mapping[str, ThroughputAnalyzer] | None = None) -> None:
        self.pricing = pricing
        self.analyzers = dict(analyzers or {})
        self._memo: dict[object, float] = {}

    def step_seconds(self, views: Sequence[RequestView]) -> float:
        if not views:
            return 0.0
        plain = plain_composition(views)
        key: object = plain if plain is not None else tuple(batch_shapes(views))
        seconds = self._memo.get(key)
        if seconds is None:
            if len(self._memo) >= MEMO_LIMIT:
                self._memo.clear()
            seconds = self._memo[key] = self._predict(plain, views)
        return seconds

    def _predict(self, plain: tuple[str, Composition] | None, views: Sequence[RequestView]) -> float:
        if plain is None:
            return self.pricing.round_seconds(batch_shapes(views))
        model, composition = plain
        analyzer = self.analyzers.get(model)
        if analyzer is not None and analyzer.covers(composition):
            return analyzer.predict(composition)
        return round_seconds(self.pricing, model, composition)
