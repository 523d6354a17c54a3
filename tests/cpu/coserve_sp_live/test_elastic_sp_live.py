"""Elastic sequence parallelism live: a video runs at SP 2 over both worker actors (gloo
all-to-alls between them), drops to SP 1 at a step boundary when an urgent image needs a worker,
returns to SP 2 when the worker is idle again, and still equals the uninterrupted run."""

import time

import httpx
import numpy as np

from tests.cpu.coserve_live.test_coserve_live import VIDEO, job_record, poll, reference_frames, unzip_frames, wait_until

ELASTIC = dict(VIDEO, num_inference_steps=150, seed=7)


def test_a_video_shrinks_for_an_urgent_image_and_grows_back(elastic_app):
    url = elastic_app
    deadline = time.monotonic() + 300
    with httpx.Client(timeout=120) as client:
        video_id = client.post(f"{url}/v1/videos", json=ELASTIC).json()["id"]
        video = wait_until(client, url, video_id, lambda v: v["steps_done"] >= 3, deadline)
        assert video["sp_degree"] == 2  # both workers idle: the profile says SP 2 is faster

        image = client.post(f"{url}/v1/images/generations", json={
            "model": "tiny-sd", "prompt": "a lighthouse", "size": "64x64", "num_inference_steps": 8, "seed": 3})
        assert image.status_code == 200, image.text
        assert poll(client, url, video_id)["status"] == "in_progress", "the image should finish first"
        wait_until(client, url, video_id, lambda v: v["status"] == "completed", deadline)

        degrees = job_record(video_id).sp_degrees
        assert len(degrees) == ELASTIC["num_inference_steps"]
        assert degrees[0] == 2 and degrees[-1] == 2, degrees
        assert 1 in degrees or poll(client, url, video_id)["pauses"] >= 1, degrees  # it gave a worker up
        frames = client.get(f"{url}/v1/videos/{video_id}/content", params={"variant": "frames"})
    served = unzip_frames(frames.content)
    expected = reference_frames(steps=ELASTIC["num_inference_steps"], seed=ELASTIC["seed"], frames=9)
    assert np.abs(served.astype(int) - expected.astype(int)).max() <= 1
