"""Algorithm 1's time-outs over a worker's batch: when each member is predicted to finish, and
whether a candidate would make an active request miss its deadline.

A worker's batch steps together; each member leaves after its last step, and the step gets
cheaper as members leave. `finish_times` plays that out with the predicted step latency of the
members still there, which is what Algorithm 1's `predictor(cur_task, act_queue)` feeds its
time-outs. Requests that join later are not foreseen (nor are they in the paper).

The paper's schedulability test (line 22) checks only the least-slack active task. With mixed
resolutions and step counts the least-slack request is not always the first to miss, so every
active request is checked here: a candidate is refused when some request predicted to meet its
deadline without it is predicted to miss with it. One that misses anyway does not block.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from stepserve.policies.types import RequestView

# The predicted seconds of one step of a batch (latency.BatchLatency.step_seconds).
StepSeconds = Callable[[Sequence[RequestView]], float]


def finish_times(batch: Sequence[RequestView], now: float, step_seconds: StepSeconds) -> dict[str, float]:
    """Each member's predicted end of denoising, the batch stepping from `now` on."""
    finish: dict[str, float] = {}
    at, done = now, 0
    for end in sorted({v.steps_left for v in batch}):
        members = [v for v in batch if v.steps_left > done]
        at += (end - done) * step_seconds(members)
        for v in members:
            if v.steps_left == end:
                finish[v.request_id] = at
        done = end
    return finish


def harmed(batch: Sequence[RequestView], before: Mapping[str, float], after: Mapping[str, float]) -> list[str]:
    """The members that meet their deadlines finishing at `before` but miss them at `after`."""
    return [v.request_id for v in batch if before[v.request_id] <= v.deadline < after[v.request_id]]
