"""GenServe's SLO-aware per-round scheduler (GenServe §4.4, Algorithm 1), end to end.

    t+ = t + Delta_round
    Stage 1: C_v(t) for every video (candidates.py); EDF image batches (image_batching.py)
    Stage 2: knapsack DP over video groups with the worker budget (knapsack.py)
    Stage 3: each terminal budget b leaves N - b workers to images; the best sum wins
    then: MATERIALIZEALLOCATIONS onto concrete workers (materialize.py)

With `dp=False` the greedy FCFS allocator (greedy.py) replaces stages 2-3; preemption and
elastic SP switch off inside the candidate sets, so every ablation row of the paper (Fig. 14)
is one config.

The router calls `decide_round` at every step boundary; it reads nothing but its arguments.
Videos and images are put in a canonical order first (arrival, then id), so the decision does
not depend on the order the caller listed them in.
"""

from __future__ import annotations

from stepserve.policies.genserve.candidates import video_options
from stepserve.policies.genserve.costs import StepCosts, memoized
from stepserve.policies.genserve.greedy import greedy_allocation
from stepserve.policies.genserve.image_batching import edf_batches
from stepserve.policies.genserve.knapsack import solve_knapsack
from stepserve.policies.genserve.materialize import materialize
from stepserve.policies.genserve.scoring import RESERVE_WEIGHT, add
from stepserve.policies.genserve.types import (
    GenServeConfig,
    ImageBatch,
    PlanScore,
    RoundDecision,
    RoundInput,
    VideoAction,
    VideoDecision,
)
from stepserve.policies.genserve.victims import rank_victims, video_slack


def decide_round(inp: RoundInput, config: GenServeConfig, costs: StepCosts) -> RoundDecision:
    """One round's allocation. Pass a `MemoizedCosts` kept across rounds to skip repeated
    cost-model queries; a plain `StepCosts` is memoized for this call only."""
    costs = memoized(costs)
    n = len(inp.workers)
    now = inp.now
    videos = sorted(inp.videos, key=lambda v: (v.arrival_time, v.job_id))
    options = [video_options(v, now, config, costs, n) for v in videos]
    occupied = {i.worker_id for i in inp.images if i.worker_id is not None}
    images = edf_batches(inp.images, now, config, costs, n, inp.reserve,
                         _empty_workers(inp, occupied) if config.spread_images else 0)

    if config.dp:
        solution = solve_knapsack(options, images, n)
        degrees = [options[j].candidates[c].degree for j, c in enumerate(solution.choices)]
        placed = tuple(range(min(solution.image_workers, len(images.batches))))
        value = solution.value
    else:
        allocation = greedy_allocation(options, images, now, config, n)
        degrees, placed = list(allocation.degrees), allocation.placed
        value = images.value_of(placed)
        for option, degree in zip(options, degrees):
            value = add(value, option.candidate(degree).value)  # type: ignore[union-attr]
        idle = n - sum(degrees) - len(placed)  # the greedy allocator ignores the reserve; the score counts it
        value = add(value, (0, RESERVE_WEIGHT * min(inp.reserve, idle), 0))

    # Empty workers before occupied ones for new batches: part of sticky batching (a resident
    # never moves, so a batch put on its worker would displace it).
    placement = materialize(inp.workers, options, degrees, images.batches, placed, inp.busy,
                            occupied if config.sticky_images else frozenset())

    decided: dict[str, VideoDecision] = {}
    victims, downgraded = [], []
    for option, degree, group in zip(options, degrees, placement.video_workers):
        job = option.job
        if degree == 0:
            action = VideoAction.PAUSE if job.running else VideoAction.WAIT
            decided[job.job_id] = VideoDecision(job.job_id, action)
            if job.running:
                victims.append((job, video_slack(job, now, option.step_s.get(job.degree, 0.0))))
            continue
        action = VideoAction.KEEP if job.running and group == job.workers else VideoAction.RUN
        finish = now + job.steps_left * option.step_s[degree]
        decided[job.job_id] = VideoDecision(job.job_id, action, group, finish)
        if job.running and degree < job.degree:
            downgraded.append(job.job_id)

    batches = []
    used = {w for group in placement.video_workers for w in group}
    for k, worker in placement.batch_workers:
        batch = images.batches[k]
        ids = tuple(m.request_id for m in batch.members)
        admit = tuple(m.request_id for m in batch.members if m.worker_id != worker)
        batches.append(ImageBatch(worker, batch.shape_key, ids, admit, batch.step_s))
        used.add(worker)
    position = {w: i for i, w in enumerate(inp.workers)}
    batches.sort(key=lambda b: position[b.worker_id])
    stepping = {rid for b in batches for rid in b.request_ids}

    return RoundDecision(
        now=now,
        videos=tuple(decided[v.job_id] for v in inp.videos),
        image_batches=tuple(batches),
        score=PlanScore(*value),
        preempted=tuple(job.job_id for job in rank_victims(victims)),
        downgraded=tuple(sorted(downgraded)),
        idle_workers=tuple(w for w in inp.workers if w not in used),
        waiting_images=tuple(i.request_id for i in inp.images if i.request_id not in stepping),
    )


def _empty_workers(inp: RoundInput, occupied: set[str]) -> int:
    """Free workers holding nothing, less one for each video waiting to start or resume (see
    GenServeConfig.spread_images)."""
    held = {w for v in inp.videos for w in v.workers}
    empty = sum(1 for w in inp.workers if w not in inp.busy and w not in occupied and w not in held)
    return max(0, empty - sum(1 for v in inp.videos if not v.workers))
