"""GenServe's per-round scheduler for image + video co-serving (genserve-slides.txt).

A standalone, pure algorithm: one call per step round, from a frozen `RoundInput` to a frozen
`RoundDecision`. It decides for the whole cluster at once (which videos run at which SP degree
on which workers, which are paused, which image batches run where); policy.py turns that into
the per-worker plans of the one scheduler interface.

    decision = decide_round(RoundInput(now, workers, images, videos), GenServeConfig(), costs)

`costs` is anything with `step_seconds(BatchShape)` (`StepCosts`): a `ProfiledCostModel`
(policies/cost_model.py), optionally inside `ObservedOverheadCosts` and `MemoizedCosts`.
"""

from stepserve.policies.genserve.costs import MemoizedCosts, ObservedOverheadCosts, StepCosts
from stepserve.policies.genserve.evaluate import check_decision, score_plan
from stepserve.policies.genserve.scheduler import decide_round
from stepserve.policies.genserve.types import (
    GenServeConfig,
    ImageBatch,
    ImageRequest,
    PlanScore,
    RoundDecision,
    RoundInput,
    VideoAction,
    VideoDecision,
    VideoJob,
    VideoStatus,
)

__all__ = [
    "GenServeConfig",
    "ImageBatch",
    "ImageRequest",
    "MemoizedCosts",
    "ObservedOverheadCosts",
    "PlanScore",
    "RoundDecision",
    "RoundInput",
    "StepCosts",
    "VideoAction",
    "VideoDecision",
    "VideoJob",
    "VideoStatus",
    "check_decision",
    "decide_round",
    "score_plan",
]
