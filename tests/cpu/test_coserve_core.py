"""The co-serving core: one GenServe decision for the whole pool, executed by free workers only,
with videos started, kept, moved, paused to host and resumed, and no worker in two places."""

from __future__ import annotations

import math

import pytest

from stepserve.actors.coserve_core import (
    CoServeCore,
    ImageStep,
    JobStatus,
    VideoDecode,
    VideoPause,
    VideoStep,
)
from stepserve.actors.router_core import DuplicateRequestError, QueueFullError
from stepserve.policies.genserve import GenServeConfig
from stepserve.policies.types import RequestSpec, VideoSpec


class Costs:
    """Test double for the profiled `StepCosts` (tests/cpu/policies/test_cost_model_video.py
    tests the real one): an image step is 0.1 s, a video step 1 s / degree."""

    def image_step_seconds(self, model, height, width, rows):
        return 0.1

    def video_step_seconds(self, model, height, width, frames, degree):
        return 1.0 / degree


def image(rid, steps=4):
    return RequestSpec(rid, "img", "a cat", 64, 64, steps, 7.5, 0)


def video(rid, steps=20):
    return VideoSpec(rid, "vid", "a fox", 64, 64, 9, steps, 5.0, 0)


def core(workers=2, **config):
    return CoServeCore([f"w{i}" for i in range(workers)], GenServeConfig(sp_degrees=(1, 2), **config), Costs())


def submit(c, spec, now=0.0, deadline=math.inf):
    (c.submit_video if isinstance(spec, VideoSpec) else c.submit_image)(spec, now, deadline)
    c.mark_ready(spec.request_id)


def test_an_urgent_image_pauses_a_video_at_its_boundary_and_the_video_resumes_after():
    c = core()
    submit(c, video("v"), deadline=100.0)
    (start,) = c.schedule(0.0)
    assert start == VideoStep("v", ("w0", "w1"), "new")  # idle workers: the highest degree

    submit(c, image("i"), now=0.2, deadline=0.9)  # needs a worker now
    assert c.schedule(0.2) == []  # both workers are inside the video's step
    assert c.video_step_done("v", 0.5) is False
    out = c.schedule(0.5)
    kinds = {type(a) for a in out}
    assert ImageStep in kinds and c.state("i").status is JobStatus.RUNNING
    step = next(a for a in out if isinstance(a, ImageStep))
    assert step.admit == ("i",)
    video_part = [a for a in out if not isinstance(a, ImageStep)]
    # Either a downgrade to the other worker ("move") or a pause to host, never both workers.
    assert len(video_part) == 1
    moved = video_part[0]
    assert isinstance(moved, (VideoPause, VideoStep))
    if isinstance(moved, VideoStep):
        # Shrinking keeps a prefix of its own group (materialize.py); the image takes the rest.
        assert moved.source == "move" and moved.workers == ("w0",) and moved.from_workers == ("w0", "w1")
        assert step.worker_id == "w1"

    # The image finishes; the video ends up at both workers again.
    t = 0.5
    while c.state("i").status is not JobStatus.FINISHED:
        t += 0.1
        c.image_step_done(step.worker_id, t)
        if isinstance(moved, VideoStep) and c.busy("w0"):
            c.video_step_done("v", t)
        out = c.schedule(t)
        step = next((a for a in out if isinstance(a, ImageStep)), step)
        moved = next((a for a in out if isinstance(a, VideoStep)), moved)
    assert c.state("i").finish_time < 1.2


def _drive(c, t_end=200.0):
    """Run the core to completion with the test costs; check the pool invariants on the way."""
    running: list[tuple[float, object]] = []
    t = 0.0
    for a in c.schedule(t):
        running.append((t, a))
    while running:
        running.sort(key=lambda x: x[0] + _cost(x[1]))
        started, a = running.pop(0)
        t = started + _cost(a)
        if isinstance(a, ImageStep):
            c.image_step_done(a.worker_id, t)
        elif isinstance(a, VideoStep):
            c.video_step_done(a.job_id, t)
        elif isinstance(a, VideoDecode):
            c.video_decoded(a.job_id, a.worker_id, t)
        out = c.schedule(t)
        busy = [w for _, x in running for w in _workers(x)]
        for x in out:
            assert not set(_workers(x)) & set(busy), f"{x} takes a busy worker"
            busy += _workers(x)
            running.append((t, x))
        assert t < t_end
    return t


def _cost(a):
    if isinstance(a, ImageStep):
        return 0.1
    if isinstance(a, VideoStep):
        return 1.0 / len(a.workers)
    if isinstance(a, VideoDecode):
        return 0.3
    return 0.0


def _workers(a):
    if isinstance(a, ImageStep):
        return [a.worker_id]
    if isinstance(a, VideoStep):
        return list(a.workers)
    if isinstance(a, VideoDecode):
        return [a.worker_id]
    return []


@pytest.mark.parametrize("config", [dict(), dict(dp=False), dict(preemption=False, dp=False, elastic_sp=False)])
def test_mixed_work_all_finishes_and_no_worker_is_in_two_places(config):
    c = CoServeCore(["a", "b", "c", "d"], GenServeConfig(sp_degrees=(1, 2, 4), **config), Costs())
    for k in range(3):
        submit(c, video(f"v{k}", steps=6), deadline=20.0 + k)
    for k in range(8):
        submit(c, image(f"i{k}", steps=3), deadline=2.0 + 0.1 * k)
    _drive(c)
    for k in range(3):
        state = c.state(f"v{k}")
        assert state.status is JobStatus.FINISHED and state.steps_done == 6 and len(state.degrees) == 6
    for k in range(8):
        assert c.state(f"i{k}").status is JobStatus.FINISHED


def test_a_fixed_degree_without_preemption_never_pauses_or_regroups():
    c = core(preemption=False, dp=False, elastic_sp=False, fixed_sp_degree=1)
    submit(c, video("v", steps=3))
    submit(c, image("i", steps=2), deadline=0.5)
    _drive(c)
    assert c.state("v").degrees == (1, 1, 1) and c.state("v").pauses == 0


def test_unready_work_waits_and_bad_submissions_are_refused():
    c = CoServeCore(["w0"], GenServeConfig(sp_degrees=(1,)), Costs(), max_queue_len=2)
    c.submit_image(image("i"), 0.0)
    assert c.schedule(0.0) == []  # text embeddings still in flight
    with pytest.raises(DuplicateRequestError):
        c.submit_image(image("i"), 0.0)
    c.submit_video(video("v"), 0.0)
    with pytest.raises(QueueFullError):
        c.submit_image(image("j"), 0.0)
    c.mark_ready("i")
    (step,) = c.schedule(0.0)
    assert isinstance(step, ImageStep) and step.request_ids == ("i",)
    with pytest.raises(ValueError, match="reported a VideoStep"):
        c.video_step_done("i", 0.1)


def test_a_worker_decoding_a_video_is_out_of_the_round():
    # v finishes on both workers; its decode takes w0 for a long time. An image arriving then
    # must go to w1, and the plan must not count w0 (no SP-2 group that waits on the decode).
    c = core()
    submit(c, video("v", steps=1), deadline=100.0)
    (step,) = c.schedule(0.0)
    assert step.workers == ("w0", "w1")
    assert c.video_step_done("v", 0.5) is True
    submit(c, video("v2", steps=5), now=0.5, deadline=100.0)
    submit(c, image("i"), now=0.5, deadline=10.0)
    out = c.schedule(0.5)
    decode = next(a for a in out if isinstance(a, VideoDecode))
    assert decode.worker_id == "w0"
    assert c.last_decision is not None and "w0" not in {w for v in c.last_decision.videos for w in v.workers}
    assert all(b.worker_id != "w0" for b in c.last_decision.image_batches)
    work = [a for a in out if not isinstance(a, VideoDecode)]
    assert len(work) == 1 and "w0" not in getattr(work[0], "workers", (getattr(work[0], "worker_id", ""),))


def test_the_scheduler_plans_denoising_to_end_before_the_tail():
    # One worker; a video with 9 one-second steps left at t = 1 (done at 10) and deadline 12;
    # an image (4 x 0.1 s) due at 1.8 that misses if it waits a round (0.5 s). Without a tail
    # the video could pause a round and still finish by 10.5 <= 12, so it gives way. With a
    # 1.8 s decode after its last step it must finish denoising by 10.2: pausing would make it
    # miss, and it keeps the worker (it is the less slack of the two).
    for tail, image_runs in ((0.0, True), (1.8, False)):
        c = CoServeCore(["w0"], GenServeConfig(sp_degrees=(1,), round_s=0.5), Costs())
        c.submit_video(video("v", steps=10), 0.0, 12.0, tail_s=tail)
        c.mark_ready("v")
        (step,) = c.schedule(0.0)
        assert isinstance(step, VideoStep)
        submit(c, image("i", steps=4), now=0.5, deadline=1.8)
        c.video_step_done("v", 1.0)
        out = c.schedule(1.0)
        assert any(isinstance(a, ImageStep) for a in out) is image_runs
        assert any(isinstance(a, VideoPause) for a in out) is image_runs
    with pytest.raises(ValueError, match="tail_s"):
        core().submit_image(image("x"), 0.0, 1.0, tail_s=-1.0)


def test_observed_overheads_recalibrate_the_scheduler_only_when_they_matter():
    from stepserve.actors.step_overhead import StepOverhead
    from stepserve.policies.genserve import ObservedOverheadCosts

    overhead = StepOverhead(alpha=0.1)
    assert overhead.observe("image", 0.150, 0.100)  # first sample: 50 ms more than the profile
    assert overhead.apply() == (pytest.approx(0.05), 0.0)
    assert not overhead.observe("image", 0.160, 0.100)  # 1 ms moved: not worth a new memo
    # Faster than predicted counts as no overhead; enough such steps pull the estimate down.
    moved = [overhead.observe("image", 0.090, 0.100) for _ in range(5)]
    assert moved.index(True) >= 1 and overhead.estimate["image"] < 0.04
    with pytest.raises(ValueError):
        StepOverhead(alpha=0)

    costs = ObservedOverheadCosts(Costs(), image_extra_s=0.05, video_extra_s=0.2)
    assert costs.image_step_seconds("img", 64, 64, 2) == pytest.approx(0.15)
    assert costs.video_step_seconds("vid", 64, 64, 9, 2) == pytest.approx(0.7)
    with pytest.raises(ValueError):
        ObservedOverheadCosts(Costs(), image_extra_s=-1)

    # The core predicts from the new costs from its next decision on.
    c = core(workers=1)
    submit(c, video("v", steps=50), deadline=1000.0)
    c.schedule(0.0)
    c.video_step_done("v", 1.0)
    c.schedule(1.0)
    assert c.last_decision.video("v").predicted_finish == pytest.approx(1.0 + 49 * 1.0)
    c.video_step_done("v", 2.0)
    c.set_costs(ObservedOverheadCosts(Costs(), video_extra_s=0.5))
    c.schedule(2.0)
    assert c.last_decision.video("v").predicted_finish == pytest.approx(2.0 + 48 * 1.5)
