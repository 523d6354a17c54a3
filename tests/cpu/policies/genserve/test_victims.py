"""Slack ranking of preemption victims (§4.2)."""

from __future__ import annotations

import math

from stepserve.policies.genserve.victims import rank_victims, video_slack

from tests.cpu.policies.genserve.fakes import vid


def test_slack_is_deadline_minus_remaining_work():
    job = vid("v", 100.0, steps=10, on=("w0",))
    assert video_slack(job, 20.0, 3.0) == 50.0


def test_late_first_then_most_slack_first():
    a, b, c, late = vid("a", 1), vid("b", 1), vid("c", 1), vid("late", 1)
    order = rank_victims([(a, 5.0), (late, -2.0), (b, 50.0), (c, math.inf)])
    assert [j.job_id for j in order] == ["late", "c", "b", "a"]


def test_ties_prefer_the_newer_job_then_the_id():
    old, new, new2 = vid("old", 1, arrival=0.0), vid("z", 1, arrival=5.0), vid("y", 1, arrival=5.0)
    assert [j.job_id for j in rank_victims([(old, 3.0), (new, 3.0), (new2, 3.0)])] == ["y", "z", "old"]
