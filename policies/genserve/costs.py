"""The latencies the GenServe solver asks for: T_img(b, w, h) and T_step(w, h, F, p) (Table 4).

The paper reads them from an offline profile (per-step cost is stable to < 0.05% CV, Table 1),
which is what makes a per-round plan predictable. The solver only needs these two calls; tests
answer them with a small analytic fake and the profiled cost model answers them in production.
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

from stepserve.policies.cost_model import GroupShape, ProfiledCostModel


@runtime_checkable
class StepCosts(Protocol):
    """Seconds for one denoising step on the current device kind."""

    def image_step_seconds(self, model: str, height: int, width: int, rows: int) -> float:
        """One forward of an image batch with `rows` batch rows, on one worker."""

    def video_step_seconds(self, model: str, height: int, width: int, frames: int, degree: int) -> float:
        """One DiT step of one video split over `degree` workers (sequence parallelism).

        A degree the model cannot run at may return +inf; the solver then never proposes it.
        """


class MemoizedCosts:
    """Remembers every answer of a `StepCosts`.

    The solver asks the same few shapes many times in one round (batch enlargement checks,
    every degree of every video), and the answers never change, so a caller that keeps one of
    these across rounds pays for each shape once. Owned by its caller: no module-level cache.
    """

    def __init__(self, costs: StepCosts) -> None:
        self._costs = costs
        self._image: dict[tuple[str, int, int, int], float] = {}
        self._video: dict[tuple[str, int, int, int, int], float] = {}
        self._tables: dict[tuple[str, int, int, int, tuple[int, ...]], tuple[float, ...]] = {}

    def image_step_seconds(self, model: str, height: int, width: int, rows: int) -> float:
        key = (model, height, width, rows)
        value = self._image.get(key)
        if value is None:
            value = self._image[key] = float(self._costs.image_step_seconds(model, height, width, rows))
        return value

    def video_step_seconds(self, model: str, height: int, width: int, frames: int, degree: int) -> float:
        key = (model, height, width, frames, degree)
        value = self._video.get(key)
        if value is None:
            value = self._video[key] = float(self._costs.video_step_seconds(model, height, width, frames, degree))
        return value


    def video_step_table(self, model: str, height: int, width: int, frames: int,
                         degrees: tuple[int, ...]) -> tuple[float, ...]:
        """`video_step_seconds` at each of `degrees`, as one lookup: every video asks for its
        whole degree list every round."""
        key = (model, height, width, frames, degrees)
        table = self._tables.get(key)
        if table is None:
            table = self._tables[key] = tuple(self.video_step_seconds(model, height, width, frames, d)
                                              for d in degrees)
        return table


def memoized(costs: StepCosts) -> MemoizedCosts:
    """`costs` itself if it already memoizes, else a fresh memo around it."""
    return costs if isinstance(costs, MemoizedCosts) else MemoizedCosts(costs)


class ProfiledStepCosts:
    """`StepCosts` answered by a profiled cost model (policies/cost_model.py).

    An image batch's step is one worker round of one group; a video's step is a round at its
    SP degree. Videos are costed with classifier-free guidance (2 rows per forward), which is
    what Wan and CogVideoX run by default; a degree the profile lacks costs +inf, so the solver
    never proposes it.
    """

    def __init__(self, cost_model: ProfiledCostModel) -> None:
        self._cost = cost_model

    def image_step_seconds(self, model: str, height: int, width: int, rows: int) -> float:
        return self._cost.round_seconds([GroupShape(model, height, width, rows)])

    def video_step_seconds(self, model: str, height: int, width: int, frames: int, degree: int) -> float:
        if degree not in self._cost.sp_degrees(model):
            return math.inf
        return self._cost.video_step_seconds(model, height, width, frames, degree)


class ObservedOverheadCosts:
    """`StepCosts` plus a per-step overhead the live router observes on top of the profile.

    A profile times the model on the worker; the co-serving router also pays, every step, the
    round trip from its decision to the worker's report (one step per call, no pipelining), which
    on a busy CPU host can exceed the forward itself. The router measures the difference and
    hands it in here, so the scheduler's predictions (and with them its pause and wait choices)
    match what a step really costs. Zero overheads give back the profile exactly.
    """

    def __init__(self, base: StepCosts, image_extra_s: float = 0.0, video_extra_s: float = 0.0) -> None:
        if not (image_extra_s >= 0 and video_extra_s >= 0):
            raise ValueError(f"overheads must be >= 0, got {image_extra_s!r}, {video_extra_s!r}")
        self.base = base
        self.image_extra_s = image_extra_s
        self.video_extra_s = video_extra_s

    def image_step_seconds(self, model: str, height: int, width: int, rows: int) -> float:
        return self.base.image_step_seconds(model, height, width, rows) + self.image_extra_s

    def video_step_seconds(self, model: str, height: int, width: int, frames: int, degree: int) -> float:
        return self.base.video_step_seconds(model, height, width, frames, degree) + self.video_extra_s
