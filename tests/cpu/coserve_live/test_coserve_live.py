"""Images and videos co-served for real (configs/local-video.yaml: 2 CPU workers, GenServe):
the video job API end to end with visible progress, running videos pausing for urgent images at
a step boundary and resuming from host memory, and their frames equal to uninterrupted runs."""

import asyncio
import io
import time
import zipfile

import av
import httpx
import numpy as np
import pytest
import ray
from PIL import Image
from ray import serve

from stepserve.engine.families import ALL_PARTS, load_family

from tests.tiny_video import TINY_WAN, make_video_spec, run_video, video_conditioning

VIDEO = dict(model="tiny-wan", prompt="a red fox runs through snow", size="64x64", num_frames=9,
             num_inference_steps=100, seed=5)
# The second video is longer, so it has less slack than the first once both run: whichever
# worker frees first goes to it (the least slack resumes first).
SECOND = dict(VIDEO, num_inference_steps=250, seed=6)


def poll(client, url, video_id):
    response = client.get(f"{url}/v1/videos/{video_id}")
    assert response.status_code == 200, response.text
    return response.json()


def job_record(video_id):
    """The job store's record of a finished video: how it ran (pauses, the SP degree of every step)."""
    return serve.get_deployment_handle("JobStore", app_name="stepserve").get.remote(video_id).result()


def reference_frames(steps: int, seed: int, frames: int) -> np.ndarray:
    family = load_family(TINY_WAN, ALL_PARTS, "cpu")
    spec = make_video_spec(rid="ref", steps=steps, seed=seed, guidance=5.0, height=64, width=64, frames=frames,
                           prompt=VIDEO["prompt"])
    video = family.decode(run_video(family, spec, video_conditioning(family, spec)).latents)[0]
    return (video * 255).round().astype(np.uint8)  # as diffusers' numpy_to_pil


def unzip_frames(data: bytes) -> np.ndarray:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        names = sorted(archive.namelist())
        return np.stack([np.asarray(Image.open(io.BytesIO(archive.read(n))).convert("RGB")) for n in names])


def wait_until(client, url, video_id, predicate, deadline):
    while not predicate(video := poll(client, url, video_id)):
        assert video["status"] in ("queued", "in_progress") and time.monotonic() < deadline, video
        time.sleep(0.05)
    return video


def test_videos_yield_to_urgent_images_and_resume_to_the_uninterrupted_result(coserve_app):
    """Two videos hold both workers; two urgent images of different sizes (they cannot share a
    forward) need workers now, so videos pause at a step boundary, the images finish first, and
    the videos resume from host memory (usually on the other worker) and complete exactly. At
    least one video pauses; the second may not, when the scheduler finds that the second image
    meets its deadline on the worker the first image frees (a matter of timing)."""
    url, _ = coserve_app
    deadline = time.monotonic() + 300
    with httpx.Client(timeout=120) as client:
        ids = []
        for body in (VIDEO, SECOND):
            created = client.post(f"{url}/v1/videos", json=body)
            assert created.status_code == 200, created.text
            video = created.json()
            assert video["object"] == "video" and video["status"] in ("queued", "in_progress")
            ids.append(video["id"])
            # Progress is visible while it runs.
            video = wait_until(client, url, video["id"], lambda v: v["steps_done"] >= 3, deadline)
            assert video["status"] == "in_progress" and 0 < video["progress"] < 100 and video["sp_degree"] == 1

        # The images' SLO (2 s) is far shorter than either video's remaining steps. The short
        # one is sent first, so it takes a worker first and frees it first.
        async def urgent_images():
            async with httpx.AsyncClient(timeout=120) as images:
                async def one(size, steps, delay):
                    await asyncio.sleep(delay)
                    return await images.post(f"{url}/v1/images/generations", json={
                        "model": "tiny-sd", "prompt": "a lighthouse", "size": size, "num_inference_steps": steps,
                        "seed": 3})
                return await asyncio.gather(one("128x64", 4, 0.0), one("64x64", 8, 0.15))

        for image in asyncio.run(urgent_images()):
            assert image.status_code == 200, image.text
        for video_id in ids:
            assert poll(client, url, video_id)["status"] == "in_progress", "the images should finish first"
            assert client.get(f"{url}/v1/videos/{video_id}/content").status_code == 409  # not ready yet
        pauses = []
        for video_id in ids:
            video = wait_until(client, url, video_id, lambda v: v["status"] == "completed", deadline)
            assert video["progress"] == 100 and video["steps_done"] == video["steps_total"]
            pauses.append(video["pauses"])
        assert max(pauses) >= 1, pauses

        for video_id, body in zip(ids, (VIDEO, SECOND)):
            record = job_record(video_id)
            assert len(record.sp_degrees) == body["num_inference_steps"]
            # The store records what the job API showed. Which worker a paused video resumes on
            # depends on which image's worker frees first; a change of group is asserted
            # deterministically in coserve_sp_live (a change of degree).
            assert record.pauses == pauses[ids.index(video_id)]
            frames = client.get(f"{url}/v1/videos/{video_id}/content", params={"variant": "frames"})
            assert frames.status_code == 200 and frames.headers["x-stepserve-video-format"] == "png-zip"
            served = unzip_frames(frames.content)
            expected = reference_frames(steps=body["num_inference_steps"], seed=body["seed"], frames=9)
            assert served.shape == expected.shape == (9, 64, 64, 3)
            # Paused, moved through host memory and resumed, yet the uninterrupted
            # run's frames (8-bit; float noise may flip one rounding).
            assert np.abs(served.astype(int) - expected.astype(int)).max() <= 1

        mp4 = client.get(f"{url}/v1/videos/{ids[0]}/content")
    assert mp4.status_code == 200 and mp4.headers["content-type"] == "video/mp4"
    with av.open(io.BytesIO(mp4.content)) as container:
        decoded = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(decoded) == 9 and decoded[0].shape == (64, 64, 3)


@pytest.mark.parametrize("body, status, param", [
    ({**VIDEO, "num_frames": 4}, 400, "num_frames"),
    ({**VIDEO, "num_frames": 1001}, 400, "num_frames"),
    ({**VIDEO, "size": "4096x4096"}, 400, "size"),
    ({**VIDEO, "num_inference_steps": 100000}, 400, "num_inference_steps"),
    ({**VIDEO, "model": "nope"}, 404, "model"),
])
def test_bad_video_requests_are_4xx_and_the_server_keeps_serving(coserve_app, body, status, param):
    url, _ = coserve_app
    response = httpx.post(f"{url}/v1/videos", json=body, timeout=60)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param
    assert httpx.get(f"{url}/v1/videos/video_{'0' * 32}", timeout=60).status_code == 404


def test_a_video_backlog_does_not_stop_images(coserve_app):
    """Videos fill their own queue bound (429 with Retry-After); images, a class of their own,
    are still admitted and served on time meanwhile."""
    url, _ = coserve_app
    long_video = dict(VIDEO, num_inference_steps=250)
    created, refused = [], None
    with httpx.Client(timeout=60) as client:
        for i in range(40):
            response = client.post(f"{url}/v1/videos", json=dict(long_video, seed=100 + i))
            if response.status_code == 429:
                refused = response
                break
            assert response.status_code == 200, response.text
            created.append(response.json()["id"])
        assert refused is not None, "the video queue never filled"
        assert int(refused.headers["retry-after"]) >= 1 and refused.json()["error"]["code"] == "overloaded"
        try:
            for seed in range(4):
                started = time.monotonic()
                image = client.post(f"{url}/v1/images/generations", json={
                    "model": "tiny-sd", "prompt": "a lighthouse", "size": "64x64", "num_inference_steps": 6,
                    "seed": seed})
                assert image.status_code == 200, image.text
                assert time.monotonic() - started < 10
        finally:
            for video_id in created:
                assert client.delete(f"{url}/v1/videos/{video_id}").status_code == 200


def test_a_worker_killed_under_video_and_image_load_loses_no_request(coserve_app):
    """Kill a worker while a video and images run: the video resumes from its last checkpoint
    (or step 0) elsewhere and still equals the uninterrupted run; every image succeeds; the
    workers' world is rebuilt once the worker is back. Last in this module: it disturbs the app."""
    url, _ = coserve_app
    router = serve.get_deployment_handle("Router", app_name="stepserve")
    names = router.worker_actor_names.remote().result()
    body = dict(VIDEO, num_inference_steps=120, seed=21)
    deadline = time.monotonic() + 300
    with httpx.Client(timeout=120) as client:
        video_id = client.post(f"{url}/v1/videos", json=body).json()["id"]
        wait_until(client, url, video_id, lambda v: v["steps_done"] >= 60 and v["sp_degree"] >= 1, deadline)
        # The worker holding the video dies: its state must come back from a checkpoint.
        victim = names[router.progress.remote(video_id).result()["workers"][0]]

        async def images_and_a_kill():
            async with httpx.AsyncClient(timeout=300) as images:
                calls = [asyncio.create_task(images.post(f"{url}/v1/images/generations", json={
                    "model": "tiny-sd", "prompt": "a lighthouse", "size": "64x64", "num_inference_steps": 30,
                    "seed": seed})) for seed in range(4)]
                await asyncio.sleep(0.3)
                ray.kill(ray.get_actor(victim), no_restart=False)
                return await asyncio.gather(*calls)

        for image in asyncio.run(images_and_a_kill()):
            assert image.status_code == 200, image.text
        video = wait_until(client, url, video_id, lambda v: v["status"] == "completed", deadline)
        assert video["steps_done"] == body["num_inference_steps"]
        assert "stepserve_recoveries_total 0.0" not in httpx.get(f"{url}/metrics").text
        frames = client.get(f"{url}/v1/videos/{video_id}/content", params={"variant": "frames"})
    served = unzip_frames(frames.content)
    expected = reference_frames(steps=body["num_inference_steps"], seed=body["seed"], frames=9)
    assert np.abs(served.astype(int) - expected.astype(int)).max() <= 1
    while router.readiness.remote().result()["live_workers"] < 2:
        assert time.monotonic() < deadline, "the killed worker never came back"
        time.sleep(0.5)
