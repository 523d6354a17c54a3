"""GenServe through the one core: videos start, keep, pause to host, resume and regroup, images
preempt them at step boundaries, and every request finishes exactly (driven by the simulator,
whose SimWorkers check residency and make SP members wait for each other as collectives do)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from stepserve.load_tests.sim import SimConfig, TextEncoderSpec, simulate
from stepserve.load_tests.workload import ScheduledRequest

ENCODER = TextEncoderSpec(batch_wait_s=0.0, cache_size=0)


@dataclass(frozen=True)
class Costs:
    """Test double of the profiled cost model (tests/cpu/policies/test_cost_model*.py test the real
    one): an image step is 0.1 s, a video step 1 s / SP degree, everything else nearly free."""

    def step_seconds(self, batch) -> float:
        return 1.0 / batch.sp_degree if batch.frames > 1 else 0.1

    def round_seconds(self, batches) -> float:
        return sum(self.step_seconds(b) for b in batches)

    def text_encode_seconds(self, model, texts):
        return 0.001

    def decode_seconds(self, model, height, width, frames=1):
        return 0.01

    def request_overhead_seconds(self, model):
        return 0.0

    def solo_seconds(self, model, height, width, steps, cfg, frames=1):
        return steps * (1.0 if frames > 1 else 0.1)


def image(i, at, steps=4, slo=None):
    return ScheduledRequest(i, at, steps, i, 64, 64, 7.5, "a cat", "img", slo_s=slo)


def video(i, at, steps=20, slo=None):
    return ScheduledRequest(i, at, steps, i, 64, 64, 5.0, "a fox", "vid", slo_s=slo, num_frames=9)


def run(requests, workers=2, **options):
    config = SimConfig(workers=workers, policy="genserve", policy_options={"sp_degrees": (1, 2), **options},
                       text_encoder=ENCODER, pipeline_lead_s=0.0)
    return {t.index: t for t in simulate(requests, Costs(), config).traces}


def test_an_idle_pool_runs_a_lone_video_at_the_highest_degree():
    traces = run([video(0, 0.0, steps=10, slo=100.0)])
    assert traces[0].status == "finished" and set(traces[0].degrees) == {2}
    assert traces[0].completion_s == pytest.approx(10 * 0.5 + 0.01, abs=0.02)


def test_an_urgent_image_preempts_a_video_at_its_boundary_and_the_video_resumes():
    traces = run([video(0, 0.0, steps=20, slo=100.0), image(1, 0.3, steps=4, slo=0.9)])
    img, vid = traces[1], traces[0]
    assert img.status == vid.status == "finished"
    assert img.met_slo  # it got a worker at the video's next boundary (0.5 s), not after it
    assert vid.pauses >= 1 and 1 in vid.degrees and vid.degrees[0] == 2
    assert len(vid.degrees) == 20 and vid.met_slo


@pytest.mark.parametrize("options", [{}, {"dp": False}, {"preemption": False, "dp": False, "elastic_sp": False}])
def test_mixed_work_all_finishes_exactly_once(options):
    requests = [video(i, i * 0.7, steps=8 + i % 5, slo=60.0) for i in range(4)]
    requests += [image(10 + i, i * 0.23, steps=3 + i % 4, slo=2.0) for i in range(20)]
    traces = run(requests, workers=3, **options)
    assert all(t.status == "finished" for t in traces.values())
    for t in traces.values():
        assert len(t.degrees) == t.steps  # one recorded step per denoising step, no more
    if options.get("preemption") is False:
        assert all(t.pauses == 0 for t in traces.values() if t.kind == "video")
        assert {d for t in traces.values() if t.kind == "video" for d in t.degrees} <= {1}


def test_videos_are_a_class_of_their_own_in_the_queue_bound():
    config = SimConfig(workers=1, policy="genserve", policy_options={"sp_degrees": (1,)}, text_encoder=ENCODER,
                       max_queued_videos=1, pipeline_lead_s=0.0)
    requests = [video(i, 0.0, steps=5) for i in range(3)] + [image(10 + i, 0.01, steps=2) for i in range(5)]
    traces = {t.index: t for t in simulate(requests, Costs(), config).traces}
    assert sum(traces[i].status == "rejected" for i in range(3)) >= 1  # the video queue is full ...
    assert all(traces[10 + i].status == "finished" for i in range(5))  # ... and images still get in
