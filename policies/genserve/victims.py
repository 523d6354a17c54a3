"""Slack-ranked victim selection (GenServe §4.2, "Intelligent video preemption", Fig. 8).

slack_v = D_v - t_now - S_v^rem * T_step(v): how long video v can stand still and still finish
on time at its current degree. The scheduler ranks running videos by descending slack and
preempts the highest-slack ones first, so the most urgent video keeps running. A video that
is already predicted late at its degree loses nothing it still had by pausing, so it ranks
ahead of every on-time one (the paper leaves this case open).

The greedy (non-DP) allocator picks victims from this ranking; the DP arrives at the same
order through the slack weights in its score, and the decision lists its victims in this
order.
"""

from __future__ import annotations

from collections.abc import Iterable

from stepserve.policies.genserve.types import VideoJob


def video_slack(job: VideoJob, now: float, step_s: float) -> float:
    return job.deadline - now - job.steps_left * step_s


def rank_victims(slacks: Iterable[tuple[VideoJob, float]]) -> list[VideoJob]:
    """Videos to preempt first come first: late ones, then most slack; ties by later arrival
    (the newer job has waited less), then id for determinism."""
    ranked = sorted(slacks, key=lambda js: (js[1] >= 0, -js[1], -js[0].arrival_time, js[0].job_id))
    return [job for job, _ in ranked]
