"""Video classes in workloads: frames carried to the requests, `/v1/videos` bodies, and SLOs
from the video's solo latency."""

from __future__ import annotations

import pytest

from stepserve.load_tests.workload import WorkloadError, generate, load_workload, parse_workload
from stepserve.policies.cost_model import load_profile


def test_the_genserve_workload_mixes_images_and_videos_with_video_slos():
    cost = load_profile("genserve-rtx6000")
    requests = generate(load_workload("genserve-balanced"), cost)
    videos = [r for r in requests if r.is_video]
    images = [r for r in requests if not r.is_video]
    assert 0.35 < len(videos) / len(requests) < 0.65
    assert all(r.num_frames == 81 and r.model == "wan2.2-5b" for r in videos)
    v = videos[0]
    assert v.slo_s == pytest.approx(cost.solo_seconds(v.model, v.height, v.width, v.num_inference_steps, True,
                                                      frames=81))
    assert v.body()["num_frames"] == 81 and "n" not in v.body()
    assert images[0].body()["n"] == 1 and "num_frames" not in images[0].body()
    assert images[0].slo_s == pytest.approx(2.0 * cost.solo_seconds(
        images[0].model, images[0].height, images[0].width, images[0].num_inference_steps, True))


def test_bad_frame_counts_are_refused():
    raw = {"num_requests": 3, "arrival": {"process": "poisson", "rate": 1.0},
           "classes": [{"name": "v", "model": "m", "sizes": [64], "steps": 4, "num_frames": 0}]}
    with pytest.raises(WorkloadError):
        parse_workload(raw)
