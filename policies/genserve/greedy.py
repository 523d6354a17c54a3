"""The allocator used when the DP is switched off: greedy first-come-first-served (GenServe's
FCFS baseline, §6 ablation, Fig. 14 "Baseline" and "+ Preemption" rows).

1. Running videos keep their groups: a first-come-first-served system never takes workers away
   on its own.
2. Waiting work (queued or paused videos, EDF-formed image batches) gets workers in arrival
   order, first fit. A video asks for the smallest degree that meets its deadline (elastic SP)
   or its fixed degree, and takes the fastest degree that still fits when that is too many.
3. With preemption: an image batch that would miss its deadline by waiting a round takes
   workers from running videos in slack-ranked order (victims.py), but only from a video that
   stays on track without them; with elastic SP the victim is downgraded rather than paused
   when that frees enough (the paper's "softer" preemption, §4.2).
4. With elastic SP: workers still free upgrade running videos, least slack first (§4.3).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from stepserve.policies.genserve.candidates import VideoCandidate, VideoOptions
from stepserve.policies.genserve.image_batching import ImagePlan
from stepserve.policies.genserve.types import GenServeConfig
from stepserve.policies.genserve.victims import rank_victims, video_slack


@dataclass(frozen=True)
class GreedyAllocation:
    degrees: tuple[int, ...]  # per video (in the order given); 0 = not running
    placed: tuple[int, ...]  # indices of the image batches that run, ascending


def _largest_at_most(option: VideoOptions, limit: int) -> int:
    return max((d for d in option.run_degrees if d <= limit), default=0)


def _fastest_at_most(option: VideoOptions, limit: int) -> int:
    fitting = [d for d in option.run_degrees if d <= limit]
    return min(fitting, key=lambda d: (option.step_s[d], d), default=0)


def _wanted_degree(option: VideoOptions, now: float, free: int) -> int:
    job = option.job
    on_time = [d for d in option.run_degrees if now + job.steps_left * option.step_s[d] <= job.deadline]
    want = min(on_time) if on_time else _fastest_at_most(option, 1 << 30)
    return want if want <= free else _fastest_at_most(option, free)


def greedy_allocation(options: Sequence[VideoOptions], images: ImagePlan, now: float, config: GenServeConfig,
                      n_workers: int) -> GreedyAllocation:
    degrees = [0] * len(options)
    free = n_workers
    for j, option in enumerate(options):
        if option.job.running:
            # The current degree may have been pruned as slower than a smaller one; take that.
            degrees[j] = _largest_at_most(option, option.job.degree)
            free -= degrees[j]

    placed: set[int] = set()
    items = [(o.job.arrival_time, 0, o.job.job_id, j) for j, o in enumerate(options) if not o.job.running]
    items += [(min(m.arrival_time for m in b.members), 1, b.members[0].request_id, k)
              for k, b in enumerate(images.batches)]
    for _, kind, _, index in sorted(items):
        if kind == 0:
            d = _wanted_degree(options[index], now, free)
            degrees[index] = d
            free -= d
        elif free > 0:
            placed.add(index)
            free -= 1

    if config.preemption:
        free = _preempt_for_urgent_images(options, images, degrees, placed, free, now)
        for k in range(len(images.batches)):  # workers a downgrade freed beyond the urgent need
            if free > 0 and k not in placed:
                placed.add(k)
                free -= 1

    if config.elastic_sp and free > 0:
        running = [(options[j].job, video_slack(options[j].job, now, options[j].step_s[degrees[j]]))
                   for j in range(len(options)) if degrees[j] > 0]
        index_of = {o.job.job_id: j for j, o in enumerate(options)}
        for job in reversed(rank_victims(running)):  # least slack first
            j = index_of[job.job_id]
            d = _fastest_at_most(options[j], degrees[j] + free)
            if options[j].step_s[d] < options[j].step_s[degrees[j]]:
                free -= d - degrees[j]
                degrees[j] = d
    return GreedyAllocation(tuple(degrees), tuple(sorted(placed)))


def _met(option: VideoOptions, degree: int) -> int:
    candidate: VideoCandidate | None = option.candidate(degree)
    return -1 if candidate is None else candidate.value[0]


def _preempt_for_urgent_images(options: Sequence[VideoOptions], images: ImagePlan, degrees: list[int],
                               placed: set[int], free: int, now: float) -> int:
    for k, batch in enumerate(images.batches):
        if k in placed or batch.placed_value[0] <= batch.waiting_value[0]:
            continue  # running, or nobody in it gains a deadline by running now
        if free == 0:
            running = [(options[j].job, video_slack(options[j].job, now, options[j].step_s[degrees[j]]))
                       for j in range(len(options)) if degrees[j] > 0]
            index_of = {o.job.job_id: j for j, o in enumerate(options)}
            for job in rank_victims(running):
                j = index_of[job.job_id]
                option, d = options[j], degrees[j]
                # Softest first: the largest smaller degree that keeps the victim on track, else a pause.
                smaller = [e for e in option.run_degrees if e < d and _met(option, e) >= _met(option, d)]
                if smaller:
                    degrees[j] = max(smaller)
                elif _met(option, 0) >= _met(option, d):
                    degrees[j] = 0
                else:
                    continue
                free += d - degrees[j]
                break
            else:
                return free  # nobody can give way; later batches are less urgent
        placed.add(k)
        free -= 1
    return free
