"""The latencies the GenServe solver asks for: T_img(b, w, h) and T_step(w, h, F, p) (Table 4).

Both are one question: what one step of one batch costs, `step_seconds(BatchShape)` (an image
batch is one frame at SP degree 1, a video one request at its degree). The paper reads the
answers from an offline profile (per-step cost is stable to < 0.05% CV, Table 1), which is what
makes a per-round plan predictable; `ProfiledCostModel` answers it in production and tests
answer it with a small analytic fake.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

from stepserve.policies.cost_model import BatchShape
from stepserve.policies.types import RequestKind

# A BatchShape's fields as a plain tuple, in field order: (model, height, width, rows, frames,
# sp_degree). The solver's hot paths key memos on these (a frozen dataclass hashes in Python).
StepKey = tuple[str, int, int, int, int, int]


@runtime_checkable
class StepCosts(Protocol):
    """Seconds for one denoising step on the current device kind."""

    def step_seconds(self, batch: BatchShape) -> float:
        """One round that runs just `batch` (on each worker of its SP group).

        An SP degree the model cannot run at may return +inf; the solver then never proposes it.
        """


class MemoizedCosts:
    """Remembers every answer of a `StepCosts`.

    The solver asks the same few shapes many times in one round (batch enlargement checks,
    every degree of every video), and the answers never change, so a caller that keeps one of
    these across rounds pays for each shape once. Owned by its caller: no module-level cache.
    """

    def __init__(self, costs: StepCosts) -> None:
        self._costs = costs
        self._steps: dict[StepKey, float] = {}
        self._tables: dict[tuple[str, int, int, int, int, tuple[int, ...]], tuple[float, ...]] = {}
        self._packed: dict[tuple[str, tuple[tuple[int, int, int], ...]], float] = {}
        self._masked: dict[tuple[str, int, int, int, float, tuple[int, ...], int], float] = {}  # and add-ons
        self._packs = getattr(costs, "packs", None)

    def packs(self, model: str) -> bool:
        """Whether a worker runs plain image batches of this model at several resolutions as one
        forward, and the costs price it so (`PackedForwardCosts`: `workers.pack_resolutions`)."""
        return self._packs is not None and bool(self._packs(model))

    def packed_step_of(self, model: str, groups: tuple[tuple[int, int, int], ...]) -> float:
        """One step of a worker whose plan holds these plain image groups of `model` ((height,
        width, rows) each, sorted), packed into one forward; only where `packs(model)`."""
        key = (model, groups)
        value = self._packed.get(key)
        if value is None:
            batches = [BatchShape(model, h, w, rows) for h, w, rows in groups]
            value = self._packed[key] = float(self._costs.round_seconds(batches))  # type: ignore[attr-defined]
        return value

    def image_step_of(self, model: str, height: int, width: int, rows: int, computed: float,
                      controlnet_rows: tuple[int, ...] = (), lora_rows: int = 0) -> float:
        """One step of an image batch of `rows` rows of which `computed` (rows weighted by each
        request's `computed_share`) are computed: an edit of a cached template computes its
        masked tokens only (InstGenIE), which costs models price (`MaskAwareCosts`) and others
        ignore. The share is rounded up to a hundredth: a conservative price, and a finite memo.
        Add-ons as `BatchShape` counts them (SwiftDiffusion): a ControlNet call per entry of
        `controlnet_rows` (sorted), and `lora_rows` rows x LoRAs of unmerged updates."""
        if computed >= rows and not (controlnet_rows or lora_rows):
            return self.step_seconds_of((model, height, width, rows, 1, 1))
        share = 1.0 if computed >= rows else min(1.0, math.ceil(100.0 * computed / rows - 1e-9) / 100.0) or 0.01
        key = (model, height, width, rows, share, controlnet_rows, lora_rows)
        value = self._masked.get(key)
        if value is None:
            value = self._masked[key] = float(self._costs.step_seconds(
                BatchShape(model, height, width, rows, controlnet_rows=controlnet_rows, lora_rows=lora_rows,
                           mask_ratio=share)))
        return value

    def step_seconds(self, batch: BatchShape) -> float:
        return self.step_seconds_of((batch.model, batch.height, batch.width, batch.rows, batch.frames,
                                     batch.sp_degree))

    def step_seconds_of(self, key: StepKey) -> float:
        """`step_seconds` of the BatchShape with these fields; builds it only on a miss."""
        value = self._steps.get(key)
        if value is None:
            value = self._steps[key] = float(self._costs.step_seconds(BatchShape(*key)))
        return value

    def video_step_table(self, model: str, height: int, width: int, rows: int, frames: int,
                         degrees: tuple[int, ...]) -> tuple[float, ...]:
        """`step_seconds` at each of `degrees`, as one lookup: every video asks for its whole
        degree list every round."""
        key = (model, height, width, rows, frames, degrees)
        table = self._tables.get(key)
        if table is None:
            table = self._tables[key] = tuple(self.step_seconds_of((model, height, width, rows, frames, d))
                                              for d in degrees)
        return table


def memoized(costs: StepCosts) -> MemoizedCosts:
    """`costs` itself if it already memoizes, else a fresh memo around it."""
    return costs if isinstance(costs, MemoizedCosts) else MemoizedCosts(costs)


class ObservedOverheadCosts:
    """`StepCosts` plus a per-step overhead the live router observes on top of the profile, by
    request kind (a batch of more than one frame is a video's step, else an image batch's).

    A profile times the model on the worker; the co-serving router also pays, every step, the
    round trip from its decision to the worker's report (one step per call, no pipelining), which
    on a busy CPU host can exceed the forward itself. The router measures the difference and
    hands it in here, so the scheduler's predictions (and with them its pause and wait choices)
    match what a step really costs. A kind left out, or zero, gives back the profile exactly.
    """

    def __init__(self, base: StepCosts, extra_s: Mapping[RequestKind, float]) -> None:
        for kind, seconds in extra_s.items():
            if not isinstance(kind, RequestKind):
                raise ValueError(f"overheads are keyed by RequestKind, got {kind!r}")
            if not seconds >= 0:
                raise ValueError(f"overhead of {kind.value} steps must be >= 0, got {seconds!r}")
        self.base = base
        self.extra_s = dict(extra_s)

    def step_seconds(self, batch: BatchShape) -> float:
        kind = RequestKind.T2V if batch.frames > 1 else RequestKind.T2I
        return self.base.step_seconds(batch) + self.extra_s.get(kind, 0.0)

    def packs(self, model: str) -> bool:
        packs = getattr(self.base, "packs", None)
        return packs is not None and bool(packs(model))

    def round_seconds(self, batches: Sequence[BatchShape]) -> float:
        """A round of plain image groups (a packed forward's: see `MemoizedCosts.packed_step_of`)."""
        return self.base.round_seconds(batches) + self.extra_s.get(RequestKind.T2I, 0.0)  # type: ignore[attr-defined]
