"""Stage 1 for videos: GENVIDEOCANDIDATES (GenServe Algorithm 1, line 5; Eq. (7)).

Each video gets a small candidate set C_v(t): keep running, run at another SP degree (elastic
SP, §4.3), pause (preemption, §4.2), or, for a queued or paused video, wait or start/resume at
a degree. A candidate's GPU cost w(c) is its degree and its score f(c) is its SLO value (see
scoring.py).

Candidates name a degree, not worker ids: workers are interchangeable and moving a video costs
nothing here, so the knapsack can work on counts and stay exact; the concrete group (own
workers first, §4.3 "keep assignments stable") is chosen afterwards by materialize.py.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from stepserve.policies.genserve.costs import StepCosts, memoized
from stepserve.policies.genserve.scoring import Value, run_value, slack_weight, wait_value
from stepserve.policies.genserve.types import GenServeConfig, VideoJob


# Internal per-round values are NamedTuples, not frozen dataclasses: several are built per video
# per round, and a frozen dataclass's __init__ costs several times more.
class VideoCandidate(NamedTuple):
    degree: int  # w(c): workers it uses this round; 0 = paused or waiting
    step_s: float | None  # T_step at this degree; None when it does not run
    value: Value  # its SLO score, added up by the knapsack


class VideoOptions(NamedTuple):
    job: VideoJob
    candidates: tuple[VideoCandidate, ...]  # the current choice first: it wins exact ties
    step_s: dict[int, float]  # T_step per degree it may run at this round (unpruned)
    best_step_s: float  # T_step at the degree it would resume at; inf if it can never run

    def candidate(self, degree: int) -> VideoCandidate | None:
        for c in self.candidates:
            if c.degree == degree:
                return c
        return None

    @property
    def run_degrees(self) -> tuple[int, ...]:
        return tuple(sorted(c.degree for c in self.candidates if c.degree > 0))


def permitted_degrees(job: VideoJob, config: GenServeConfig, n_workers: int) -> tuple[int, ...]:
    """Degrees the switches allow this round, before pruning."""
    if not config.elastic_sp:
        # Fixed-SP baseline: a group keeps its size for the job's lifetime.
        if job.running:
            return (job.degree,)
        return (config.fixed_sp_degree,) if config.fixed_sp_degree <= n_workers else ()
    degrees = [d for d in config.sp_degrees if d <= n_workers]
    if job.running and job.degree not in degrees:
        # Staying put is always possible, even at a degree no longer offered.
        degrees.append(job.degree)
        degrees.sort()
    return tuple(degrees)


def _best_step(job: VideoJob, config: GenServeConfig, n_workers: int, step_s: dict[int, float]) -> float:
    if not config.elastic_sp:
        degree = job.degree if job.running else config.fixed_sp_degree
        return step_s.get(degree, math.inf)
    cap = n_workers if config.resume_degree is None else min(config.resume_degree, n_workers)
    offered = [step_s[d] for d in config.sp_degrees if d <= cap and d in step_s]
    return min(offered, default=math.inf)


def step_times(job: VideoJob, config: GenServeConfig, costs: StepCosts,
               n_workers: int) -> tuple[dict[int, float], float]:
    """T_step at every degree the job may run at this round, and at the degree it would resume at."""
    degrees = permitted_degrees(job, config, n_workers)
    times = memoized(costs).video_step_table(job.model, job.height, job.width, job.rows, job.frames, degrees)
    step_s: dict[int, float] = {}
    for d, t in zip(degrees, times):
        if not (t >= 0 and math.isfinite(t)):
            if job.running and d == job.degree:
                raise ValueError(f"video {job.job_id!r} is running at degree {d}, but its step cost is {t!r}")
            continue  # a degree the model cannot run at
        step_s[d] = t
    return step_s, _best_step(job, config, n_workers, step_s)


def video_options(job: VideoJob, now: float, config: GenServeConfig, costs: StepCosts,
                  n_workers: int) -> VideoOptions:
    step_s, best_step = step_times(job, config, costs, n_workers)
    best_s = job.steps_left * best_step

    # Prune degrees that use more workers without being faster than a smaller one (low
    # resolutions barely scale with SP, Fig. 5): with the rest of the plan unchanged, the
    # smaller degree is never worse, so the knapsack loses nothing. The current degree stays
    # on a tie, to keep the group stable.
    runs: list[VideoCandidate] = []
    fastest = math.inf
    deadline, steps, round_s = job.deadline, job.steps_left, config.round_s
    weight = slack_weight(deadline - now - best_s)
    current = job.degree  # 0 unless running
    for d in step_s:  # ascending: permitted_degrees is sorted
        t = step_s[d]
        if t < fastest or (d == current and t <= fastest):
            runs.append(VideoCandidate(d, t, run_value(deadline, now, steps * t, best_s, round_s, weight)))
        if t < fastest:
            fastest = t

    idle = VideoCandidate(0, None, wait_value(deadline, now, best_s, round_s, weight))
    if job.running:
        stay = [c for c in runs if c.degree == current]
        move = [c for c in runs if c.degree != current]
        # Never empty: a pruned current degree has a faster, smaller one in `move`.
        candidates = stay + move + ([idle] if config.preemption else [])
    else:
        candidates = [idle] + runs
    return VideoOptions(job, tuple(candidates), step_s, best_step)
