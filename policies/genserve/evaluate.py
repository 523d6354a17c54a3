"""Scores and checks a finished `RoundDecision` from scratch.

The solver adds up candidate values as it goes; this recomputes the score of the concrete plan
(worker ids, batch members) straight from the cost model, so tests can hold the solver's
reported score against it, a brute-force oracle can score plans the solver never built, and
the router can reject a plan it cannot execute.
"""

from __future__ import annotations

import math

from stepserve.policies.cost_model import BatchShape
from stepserve.policies.genserve.candidates import permitted_degrees, step_times
from stepserve.policies.genserve.costs import StepCosts, memoized
from stepserve.policies.genserve.scoring import RESERVE_WEIGHT, ZERO, add, run_value, wait_value
from stepserve.policies.genserve.types import (
    GenServeConfig,
    PlanScore,
    RoundDecision,
    RoundInput,
    VideoAction,
)
from stepserve.policies.types import ShapeKey


def score_plan(inp: RoundInput, config: GenServeConfig, costs: StepCosts, decision: RoundDecision) -> PlanScore:
    costs = memoized(costs)
    n = len(inp.workers)
    now, round_s = inp.now, config.round_s
    total = ZERO
    for job in inp.videos:
        best_s = job.steps_left * step_times(job, config, costs, n)[1]
        chosen = decision.video(job.job_id)
        if chosen.action in (VideoAction.KEEP, VideoAction.RUN):
            step = costs.step_seconds(BatchShape(job.model, job.height, job.width, job.rows, job.frames, chosen.degree))
            total = add(total, run_value(job.deadline, now, job.steps_left * step, best_s, round_s))
        else:
            total = add(total, wait_value(job.deadline, now, best_s, round_s))

    by_id = {image.request_id: image for image in inp.images}
    stepping: dict[str, float] = {}
    for batch in decision.image_batches:
        sizes: dict[ShapeKey, int] = {}
        computed = 0.0
        calls: dict[str, int] = {}
        lora_rows = 0
        for rid in batch.request_ids:
            image = by_id[rid]
            sizes[image.shape_key] = sizes.get(image.shape_key, 0) + image.rows
            computed += image.rows * image.computed_share
            for name in image.controlnets:
                calls[name] = calls.get(name, 0) + image.rows
            lora_rows += image.rows * image.loras
        if len(sizes) == 1:
            (key, rows), = sizes.items()
            step = costs.image_step_of(key.model, key.height, key.width, rows, computed, tuple(sorted(calls.values())),
                                       lora_rows)
        else:  # a packed forward (check_decision: only with pack_resolutions)
            step = costs.packed_step_of(batch.shape_key.model,
                                        tuple(sorted((k.height, k.width, r) for k, r in sizes.items())))
        for rid in batch.request_ids:
            stepping[rid] = step
    for image in inp.images:
        key = image.shape_key
        solo = costs.image_step_of(key.model, key.height, key.width, image.rows, image.rows * image.computed_share,
                                   (image.rows,) * len(image.controlnets), image.rows * image.loras)
        best_s = image.steps_left * solo if solo >= 0 and math.isfinite(solo) else math.inf
        if image.request_id in stepping:
            run_s = image.steps_left * stepping[image.request_id]
            total = add(total, run_value(image.deadline, now, run_s, best_s, round_s))
        else:
            total = add(total, wait_value(image.deadline, now, best_s, round_s))
    idle = n - sum(v.degree for v in decision.videos) - len(decision.image_batches)
    total = add(total, (0, RESERVE_WEIGHT * min(inp.reserve, idle), 0))
    return PlanScore(*total)


def check_decision(inp: RoundInput, config: GenServeConfig, decision: RoundDecision) -> None:
    """Raises ValueError when the decision cannot be executed or breaks a switch."""
    n = len(inp.workers)
    known = set(inp.workers)
    used: dict[str, str] = {}

    def claim(worker: str, who: str) -> None:
        if worker not in known:
            raise ValueError(f"{who} is placed on unknown worker {worker!r}")
        if worker in used:
            raise ValueError(f"worker {worker!r} is given to both {used[worker]} and {who}")
        used[worker] = who

    if [d.job_id for d in decision.videos] != [v.job_id for v in inp.videos]:
        raise ValueError("the decision must have one entry per input video, in input order")
    for job, chosen in zip(inp.videos, decision.videos):
        runs = chosen.action in (VideoAction.KEEP, VideoAction.RUN)
        if runs != bool(chosen.workers):
            raise ValueError(f"video {job.job_id!r}: {chosen.action.value} with workers {chosen.workers}")
        if chosen.action is VideoAction.KEEP and chosen.workers != job.workers:
            raise ValueError(f"video {job.job_id!r}: KEEP must keep its workers {job.workers}")
        if chosen.action is VideoAction.RUN and job.running and chosen.workers == job.workers:
            raise ValueError(f"video {job.job_id!r}: unchanged group must be KEEP, not RUN")
        if chosen.action is VideoAction.PAUSE and not job.running:
            raise ValueError(f"video {job.job_id!r}: only a running video can be paused")
        if chosen.action is VideoAction.WAIT and job.running:
            raise ValueError(f"video {job.job_id!r}: a running video is paused, not left waiting")
        if chosen.action is VideoAction.PAUSE and not config.preemption:
            raise ValueError(f"video {job.job_id!r} paused with preemption off")
        if runs and chosen.degree not in permitted_degrees(job, config, n):
            raise ValueError(f"video {job.job_id!r}: degree {chosen.degree} is not permitted")
        for w in chosen.workers:
            claim(w, f"video {job.job_id!r}")

    by_id = {image.request_id: image for image in inp.images}
    seen: set[str] = set()
    for batch in decision.image_batches:
        claim(batch.worker_id, f"image batch on {batch.worker_id!r}")
        if not batch.request_ids or len(batch.request_ids) > config.image_max_batch:
            raise ValueError(f"batch on {batch.worker_id!r} has {len(batch.request_ids)} images")
        for rid in batch.request_ids:
            if rid not in by_id or rid in seen:
                raise ValueError(f"image {rid!r} is unknown or in two batches")
            seen.add(rid)
            if not _batchable(by_id[rid].shape_key, batch.shape_key, config.pack_resolutions):
                raise ValueError(f"image {rid!r} does not match its batch's shape key")
        if len({by_id[rid].shape_key for rid in batch.request_ids}) > 1:
            members = [by_id[rid] for rid in batch.request_ids]
            if any(m.computed_share < 1.0 for m in members):
                raise ValueError(f"batch on {batch.worker_id!r}: a packed forward computes every token, "
                                 "so an edit of a cached template cannot join one")
            if any(m.controlnets or m.loras for m in members):
                raise ValueError(f"batch on {batch.worker_id!r}: a packed forward runs no add-on, "
                                 "so an image with ControlNets or LoRAs cannot join one")
        expected_admit = tuple(rid for rid in batch.request_ids if by_id[rid].worker_id != batch.worker_id)
        if batch.admit != expected_admit:
            raise ValueError(f"batch on {batch.worker_id!r}: admit {batch.admit} != {expected_admit}")


def _batchable(key: ShapeKey, batch: ShapeKey, packing: bool) -> bool:
    """An image may share the batch's forward: the same shape, or with packing the same model
    (one image frame each; the packed forward runs the resolutions side by side)."""
    return key == batch or (packing and key.model == batch.model and key.frames == batch.frames == 1)
