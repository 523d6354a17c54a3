"""Images and videos in one simulation (the `genserve` policy on the derived GenServe profile):
runs repeat exactly, every request finishes exactly once, sequence-parallel steps start
together, and GenServe's full policy beats FCFS on the same requests."""

from __future__ import annotations

from dataclasses import asdict, replace
from functools import cache

from stepserve.load_tests.sim import SimConfig, SimResult, Simulation, simulate
from stepserve.load_tests.workload import generate, load_workload
from stepserve.policies.cost_model import load_profile
from stepserve.policies.genserve import GenServeConfig

FCFS = GenServeConfig(preemption=False, dp=False, elastic_sp=False)
FULL = GenServeConfig()


@cache
def _requests(rate: float = 0.5, n: int = 80, seed: int = 0) -> tuple:
    spec = load_workload("genserve-balanced").with_rate(rate)
    return tuple(generate(replace(spec, num_requests=n, seed=seed), _cost()))


@cache
def _cost():
    return load_profile("genserve-rtx6000")


def _config(policy: GenServeConfig, lead: float = 0.0) -> SimConfig:
    # Lead 0, as the ablation runs: the simulator charges no round trip to hide.
    return SimConfig(workers=8, policy="genserve", policy_options=asdict(policy), pipeline_lead_s=lead,
                     max_queued_images=1024, max_queued_videos=1024)


@cache  # results are frozen; several tests compare the same runs
def _run(policy: GenServeConfig, seed: int = 0) -> SimResult:
    return simulate(_requests(seed=seed), _cost(), _config(policy))


def _sar(result: SimResult, kind: str | None = None) -> float:
    traces = [t for t in result.traces if kind is None or t.kind == kind]
    return sum(t.met_slo for t in traces) / len(traces)


def test_images_and_videos_finish_and_runs_repeat_exactly_by_seed():
    a, other = _run(FULL), _run(FULL, seed=1)
    b = simulate(_requests(), _cost(), _config(FULL))  # a fresh run, not the cached one
    assert all(t.status == "finished" for t in a.traces)
    assert {t.kind for t in a.traces} == {"image", "video"}
    assert a.traces == b.traces and a.busy_s == b.busy_s and a.rounds == b.rounds
    assert a.traces != other.traces
    videos = [t for t in a.traces if t.kind == "video"]
    assert all(len(t.degrees) == t.steps for t in videos)  # one entry per step
    assert any(max(t.degrees) > 1 for t in videos)  # elastic SP used idle workers
    assert all(t.degrees == (1,) * t.steps for t in a.traces if t.kind == "image")


class _Recorder:
    """Wraps each simulated worker's `start` and `end`: when every plan started, on which worker,
    and for how long, in start order."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.runs: list[tuple[float, float, str, object, object]] = []  # start, seconds, worker, plan, report
        self._started: dict[int, tuple[int, float]] = {}  # id(running) -> (its index in runs, start)
        for lane in sim.lanes.values():
            lane.worker.start = self._wrap_start(lane.worker.start)
            lane.worker.end = self._wrap_end(lane.worker.end)

    def _wrap_start(self, start):
        def recorded(plan, admissions):
            running = start(plan, admissions)
            self._started[id(running)] = (len(self.runs), self.sim.events.now)
            self.runs.append(None)
            return running
        return recorded

    def _wrap_end(self, end):
        def recorded(running, steps_run=None):
            report, outputs, seconds = end(running, steps_run)
            index, started = self._started.pop(id(running))
            self.runs[index] = (started, seconds, running.plan.worker_id, running.plan, report)
            return report, outputs, seconds
        return recorded


def test_every_request_finishes_once_and_sp_steps_start_when_all_members_arrive():
    # The default lead (0.05 s): plans are queued behind running ones, so members of an SP group
    # reach a shared step at different times and the early ones must wait.
    sim = Simulation(_requests(), _cost(), replace(_config(FULL), pipeline_lead_s=0.05))
    recorder = _Recorder(sim)
    result = sim.run()
    assert all(t.status == "finished" for t in result.traces)

    finished = [rid for _, _, _, plan, report in recorder.runs for rid in plan.finish if not report.failed]
    assert sorted(finished) == sorted(t.request_id for t in result.traces)  # each exactly once

    free_at: dict[str, float] = {}  # each worker's end of its previous plan
    gangs: dict[tuple[str, int], list[tuple[float, float]]] = {}  # (video, step) -> (start, member free at)
    sizes: dict[tuple[str, int], int] = {}
    for start, seconds, wid, plan, report in recorder.runs:
        assert start >= free_at.get(wid, 0.0)  # a worker runs one plan at a time
        done = {p.request_id: p.steps_done for p in report.progress}
        for group in plan.groups:
            if group.ranks:
                [rid] = group.request_ids
                key = (rid, done[rid])
                gangs.setdefault(key, []).append((start, free_at.get(wid, 0.0)))
                sizes[key] = len(group.ranks)
        free_at[wid] = start + seconds
    assert gangs, "no sequence-parallel step ran"
    waited = 0
    for key, members in gangs.items():
        assert len(members) == sizes[key], key  # every member ran the step
        starts = {start for start, _ in members}
        assert len(starts) == 1, (key, members)  # ... at the same instant
        arrived = [free for _, free in members]
        assert starts.pop() >= max(arrived)
        waited += len(set(arrived)) > 1
    assert waited, "no member ever waited for another: the gang rule went untested"


def test_fcfs_runs_videos_at_the_fixed_degree_and_never_pauses():
    videos = [t for t in _run(FCFS).traces if t.kind == "video"]
    assert all(set(t.degrees) == {1} and t.pauses == 0 for t in videos)


def test_the_full_policy_beats_fcfs_overall_and_for_images():
    fcfs, full = _run(FCFS), _run(FULL)
    assert _sar(full) > _sar(fcfs)
    assert _sar(full, "image") > _sar(fcfs, "image")


def test_the_dp_does_not_pause_videos_into_misses():
    # Regression: the scheduler used to plan against the end-to-end deadline, ignoring the
    # seconds of VAE decode after a video's last step, so the DP saw slack that was not there,
    # paused on-time videos for images and made them late (its video attainment fell below the
    # greedy allocator's). The simulator passes each request's tail with its deadline.
    greedy = GenServeConfig(preemption=True, dp=False, elastic_sp=False)
    dp = GenServeConfig(preemption=True, dp=True, elastic_sp=False)
    assert _sar(_run(dp), "video") >= _sar(_run(greedy), "video")
