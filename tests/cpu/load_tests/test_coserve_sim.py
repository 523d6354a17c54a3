"""The co-serving simulator on the derived GenServe profile: every request completes, runs are
deterministic, and GenServe's full policy beats FCFS on the same requests."""

from __future__ import annotations

from dataclasses import replace

from stepserve.load_tests.sim.coserve import CoServeSimConfig, simulate_coserve
from stepserve.load_tests.workload import generate, load_workload
from stepserve.policies.cost_model import load_profile
from stepserve.policies.genserve import GenServeConfig

FCFS = GenServeConfig(preemption=False, dp=False, elastic_sp=False)


def _run(config, rate=0.5, n=80):
    cost = load_profile("genserve-rtx6000")
    spec = load_workload("genserve-balanced").with_rate(rate)
    requests = generate(replace(spec, num_requests=n), cost)
    return simulate_coserve(requests, cost, CoServeSimConfig(workers=8, genserve=config))


def _sar(result, kind=None):
    traces = [t for t in result.traces if kind is None or t.kind == kind]
    return sum(t.met_slo for t in traces) / len(traces)


def test_every_request_completes_and_runs_repeat_exactly():
    a, b = _run(GenServeConfig()), _run(GenServeConfig())
    assert all(t.status == "finished" for t in a.traces)
    assert {t.kind for t in a.traces} == {"image", "video"}
    assert [t.completion_s for t in a.traces] == [t.completion_s for t in b.traces]
    videos = [t for t in a.traces if t.kind == "video"]
    assert all(len(t.degrees) == t.steps for t in videos)  # one entry per step
    assert any(max(t.degrees) > 1 for t in videos)  # elastic SP used idle workers


def test_fcfs_runs_videos_at_the_fixed_degree_and_never_pauses():
    result = _run(FCFS)
    videos = [t for t in result.traces if t.kind == "video"]
    assert all(set(t.degrees) == {1} and t.pauses == 0 for t in videos)


def test_the_full_policy_beats_fcfs_overall_and_for_images():
    fcfs, full = _run(FCFS), _run(GenServeConfig())
    assert _sar(full) > _sar(fcfs)
    assert _sar(full, "image") > _sar(fcfs, "image")


def test_the_dp_does_not_pause_videos_into_misses():
    # Regression: the scheduler used to plan against the end-to-end deadline, ignoring the
    # seconds of VAE decode after a video's last step, so the DP saw slack that was not there,
    # paused on-time videos for images and made them late (its video attainment fell below the
    # greedy allocator's). The simulator now passes each request's tail with its deadline.
    greedy = GenServeConfig(preemption=True, dp=False, elastic_sp=False)
    dp = GenServeConfig(preemption=True, dp=True, elastic_sp=False)
    assert _sar(_run(dp), "video") >= _sar(_run(greedy), "video")
