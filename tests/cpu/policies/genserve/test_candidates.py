"""Stage 1 video candidates: which degrees and pauses each switch allows, and pruning."""

from __future__ import annotations

import math

import pytest

from stepserve.policies.genserve import GenServeConfig
from stepserve.policies.genserve.candidates import video_options

from tests.cpu.policies.genserve.fakes import FakeCosts, vid

# FakeCosts, 480p/81 frames: T_step = 4.0 / d + 0.05 * (d - 1): 4.0, 2.05, 1.15, 0.85 s.


def degrees(options):
    return [c.degree for c in options.candidates]


def test_running_video_current_first_then_other_degrees_then_pause():
    job = vid("v", 100.0, on=("w0", "w1"))
    options = video_options(job, 0.0, GenServeConfig(), FakeCosts(), 8)
    assert degrees(options) == [2, 1, 4, 8, 0]
    assert options.best_step_s == pytest.approx(0.85)


def test_waiting_video_wait_first_then_degrees():
    options = video_options(vid("v", 100.0, paused=True), 0.0, GenServeConfig(), FakeCosts(), 8)
    assert degrees(options) == [0, 1, 2, 4, 8]


def test_degrees_above_the_cluster_are_not_offered():
    options = video_options(vid("v", 100.0), 0.0, GenServeConfig(), FakeCosts(), 3)
    assert degrees(options) == [0, 1, 2]
    assert options.best_step_s == pytest.approx(2.05)


def test_preemption_off_never_offers_a_pause_to_a_running_video():
    config = GenServeConfig(preemption=False)
    assert 0 not in degrees(video_options(vid("v", 100.0, on=("w0",)), 0.0, config, FakeCosts(), 8))
    # A queued video can always wait: not starting is not preempting.
    assert 0 in degrees(video_options(vid("v", 100.0), 0.0, config, FakeCosts(), 8))


def test_fixed_sp_keeps_the_running_degree_and_starts_at_the_fixed_one():
    config = GenServeConfig(elastic_sp=False, fixed_sp_degree=2)
    assert degrees(video_options(vid("v", 100.0, on=("w0", "w1", "w2", "w3")), 0.0, config, FakeCosts(), 8)) == [4, 0]
    assert degrees(video_options(vid("v", 100.0), 0.0, config, FakeCosts(), 8)) == [0, 2]
    # The fixed degree does not fit: the video can only wait, and can never recover.
    options = video_options(vid("v", 100.0), 0.0, config, FakeCosts(), 1)
    assert degrees(options) == [0]
    assert options.best_step_s == math.inf
    assert options.candidates[0].value[0] == 0


def test_resume_degree_limits_the_recovery_assumption():
    options = video_options(vid("v", 100.0), 0.0, GenServeConfig(resume_degree=2), FakeCosts(), 8)
    assert options.best_step_s == pytest.approx(2.05)
    assert degrees(options) == [0, 1, 2, 4, 8]  # it may still run faster when workers are there


def test_degrees_that_are_not_faster_are_pruned_but_the_current_one_stays_on_a_tie():
    costs = FakeCosts(video_steps={"wan": {1: 3.0, 2: 2.0, 4: 2.0, 8: 2.5}})
    assert degrees(video_options(vid("v", 100.0), 0.0, GenServeConfig(), costs, 8)) == [0, 1, 2]
    running4 = vid("v", 100.0, on=("w0", "w1", "w2", "w3"))
    assert degrees(video_options(running4, 0.0, GenServeConfig(), costs, 8)) == [4, 1, 2, 0]
    # Strictly slower than a smaller degree: the current one goes, the smaller one replaces it.
    running8 = vid("v", 100.0, on=tuple(f"w{i}" for i in range(8)))
    assert degrees(video_options(running8, 0.0, GenServeConfig(), costs, 8)) == [1, 2, 0]


def test_unsupported_degrees_are_skipped_and_an_unsupported_current_degree_is_an_error():
    costs = FakeCosts(video_steps={"wan": {1: 3.0, 4: 1.0}})
    assert degrees(video_options(vid("v", 100.0), 0.0, GenServeConfig(), costs, 8)) == [0, 1, 4]
    with pytest.raises(ValueError, match="step cost"):
        video_options(vid("v", 100.0, on=("w0", "w1")), 0.0, GenServeConfig(), costs, 8)


def test_candidate_values():
    # 40 steps: 160 s at d=1, 46 s at d=4, 34 s at d=8 (best). Deadline 50, now 0, round 1 s.
    options = video_options(vid("v", 50.0, steps=40), 0.0, GenServeConfig(), FakeCosts(), 8)
    by_degree = {c.degree: c.value for c in options.candidates}
    weight = round(1e6 / (1 + 50 - 34))
    assert by_degree[4] == (1, weight, -weight * 46_000_000)
    # d=1 misses if kept, but one round at d=1 still leaves 34 s at d=8 in time: recoverable.
    assert by_degree[1] == (1, weight, -weight * 160_000_000)
    assert by_degree[0] == (1, 0, -weight * 35_000_000)
    late = video_options(vid("v", 34.5, steps=40), 0.0, GenServeConfig(), FakeCosts(), 8)
    by_degree = {c.degree: c.value[0] for c in late.candidates}
    assert by_degree == {0: 0, 1: 0, 2: 0, 4: 0, 8: 1}  # only running at 8 now makes it
