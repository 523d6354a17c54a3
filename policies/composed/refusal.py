"""PatchedServe's SLO-violation analysis (Algorithm 1, lines 8-12) in the composed policy: a
waiting request that would end after its deadline even if it started now at its fastest (an
image alone on a worker, an edit computing its masked share only, a video at its fastest SP
degree that fits the pool) is refused, so the work it would take goes to requests that can
still make theirs."""

from __future__ import annotations

from stepserve.policies.cost_model import computed_share
from stepserve.policies.genserve.costs import MemoizedCosts
from stepserve.policies.patchedserve.slack import time_out
from stepserve.policies.types import RequestFailure, RequestView


def unattainable(queued: tuple[RequestView, ...], now: float, costs: MemoizedCosts, degrees: tuple[int, ...],
                 workers: int) -> tuple[RequestFailure, ...]:
    out = []
    for view in queued:
        k = view.shape_key
        if view.is_video:
            step = min((costs.step_seconds_of((k.model, k.height, k.width, view.rows, k.frames, d))
                        for d in degrees if d <= workers), default=float("inf"))
        else:  # an edit of a cached template computes its masked share only (InstGenIE)
            step = costs.image_step_of(k.model, k.height, k.width, view.rows, view.rows * computed_share(view))
        alone = view.steps_left * step
        if time_out(view, now, alone):
            out.append(RequestFailure(view.request_id, f"cannot meet its deadline: started now at its fastest it "
                                                       f"would end denoising {now + alone - view.deadline:.2f} s "
                                                       "after it"))
    return tuple(out)
