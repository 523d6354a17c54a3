"""Kill the router under load (configs/local-video.yaml: images and videos): Serve starts a new
one, which runs the unfinished video jobs again from their last checkpoints (the job store keeps
them), while the ingress submits again every image the old router died holding. No admitted
request is lost, what finished before is still there, and a resumed video equals the same video
run without a break. Then kill the job store: it reads back what it had written, so nothing
finished or running is lost either."""

import asyncio
import time

import httpx
import numpy as np
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from stepserve.engine.families import ALL_PARTS, load_family
from stepserve.runtime import CONFIGS, load_serve_config

from tests.cpu.coserve_live.test_coserve_live import unzip_frames
from tests.cpu.integration.conftest import serving
from tests.tiny_video import TINY_WAN, make_video_spec, run_video, video_conditioning

VIDEO = {"model": "tiny-wan", "prompt": "a fox running", "size": "64x64", "num_frames": 5,
         "num_inference_steps": 30}
LONG = 250  # steps of the videos the kill interrupts (the model's most), at 9 frames of the largest size:
LONG_FRAMES = 9  # long enough that they run on while every image is admitted
LONG_SIZE = 128


def image(seed: int) -> dict:
    return {"model": "tiny-sd", "prompt": "a red fox", "size": "64x64", "num_inference_steps": 60, "seed": seed}


@pytest.fixture(scope="module")
def video_app():
    config = load_serve_config(CONFIGS / "local-video.yaml")
    # A tiny video takes a second or two: checkpoints a few times a second, so one is in the
    # store when the router dies.
    config["applications"][0]["args"]["router"]["checkpoint_interval_s"] = 0.25
    yield from serving(config)


def replica_actor(deployment: str = "Router"):
    """A deployment's replica actor (Serve names it SERVE_REPLICA::<app>#<deployment>#<id>)."""
    (actor,) = [a for a in ray.util.list_named_actors(all_namespaces=True) if f"#{deployment}#" in a["name"]]
    return ray.get_actor(actor["name"], namespace=actor["namespace"])


def reference_frames(seed: int) -> np.ndarray:
    """The video as one uninterrupted run makes it."""
    family = load_family(TINY_WAN, ALL_PARTS, "cpu")
    spec = make_video_spec(rid="ref", steps=LONG, seed=seed, guidance=5.0, height=LONG_SIZE, width=LONG_SIZE,
                           frames=LONG_FRAMES, prompt=VIDEO["prompt"])
    video = family.decode(run_video(family, spec, video_conditioning(family, spec)).latents)[0]
    return (video * 255).round().astype(np.uint8)  # as diffusers' numpy_to_pil


def test_a_router_killed_under_load_loses_no_admitted_request_and_no_finished_video(video_app):
    url, _ = video_app
    router = serve.get_deployment_handle("Router", app_name="stepserve")

    async def scenario():
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            finished = (await client.post("/v1/videos", json={**VIDEO, "num_inference_steps": 4})).json()["id"]
            done = await client.get(f"/v1/videos/{finished}", headers={"Prefer": "wait=60"})
            assert done.json()["status"] == "completed"
            long = {**VIDEO, "num_inference_steps": LONG, "num_frames": LONG_FRAMES, "size": f"{LONG_SIZE}x{LONG_SIZE}"}
            videos = [(await client.post("/v1/videos", json={**long, "seed": i})).json()["id"] for i in range(2)]
            deadline = time.monotonic() + 120
            while (await client.get(f"/v1/videos/{videos[0]}")).json()["steps_done"] < LONG // 5:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)  # checkpointed: the store holds one
            images = [asyncio.create_task(client.post("/v1/images/generations", json=image(i))) for i in range(4)]
            while True:  # every image admitted, the videos still running: the router holds them all
                state = await router.readiness.remote()
                if state["running"] + state["queued"] >= len(images) + len(videos) and state["running"]:
                    break
                assert time.monotonic() < deadline and not any(i.done() for i in images), state
                await asyncio.sleep(0.02)
            old = replica_actor()
            ray.kill(old)  # Serve finds its replica dead and starts another
            answers = await asyncio.gather(*images)
            ended = {}
            deadline = time.monotonic() + 300
            while len(ended) < len(videos):
                assert time.monotonic() < deadline, f"videos never ended: {ended}"
                for vid in videos:
                    job = (await client.get(f"/v1/videos/{vid}", headers={"Prefer": "wait=5"})).json()
                    if job["status"] in ("completed", "failed", "cancelled"):
                        ended[vid] = job
            content = await client.get(f"/v1/videos/{finished}/content")
            frames = (await client.get(f"/v1/videos/{videos[0]}/content", params={"variant": "frames"})).content
            metrics = (await client.get("/metrics")).text
            return old, answers, ended, content, frames, metrics, videos

    old, answers, ended, content, frames, metrics, videos = asyncio.run(scenario())
    assert replica_actor()._actor_id != old._actor_id
    # The new router's own count: it finished every one of them (the old one's died with it).
    finished_here = sum(s.value for family in text_string_to_metric_families(metrics) for s in family.samples
                        if s.name == "stepserve_requests_total" and s.labels["status"] == "finished")
    assert finished_here == 6
    assert [a.status_code for a in answers] == [200] * 4, [a.text[:200] for a in answers]
    assert [job["status"] for job in ended.values()] == ["completed"] * 2, ended
    assert content.status_code == 200 and content.content  # finished before the kill: still there
    store = serve.get_deployment_handle("JobStore", app_name="stepserve")
    resumed = store.get.remote(videos[0]).result()
    assert resumed.resumes == 1 and resumed.resumed_from_step >= LONG // 5, resumed  # from a checkpoint
    assert np.abs(unzip_frames(frames).astype(int) - reference_frames(seed=0).astype(int)).max() <= 1


def test_a_job_store_killed_under_load_reads_back_what_it_had(video_app):
    url, _ = video_app

    async def job(client, vid):
        while True:  # 503 while the store restarts
            response = await client.get(f"/v1/videos/{vid}", headers={"Prefer": "wait=5"})
            if response.status_code == 200:
                return response.json()
            assert response.status_code == 503, response.text
            await asyncio.sleep(0.5)

    async def scenario():
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            finished = (await client.post("/v1/videos", json={**VIDEO, "seed": 11})).json()["id"]
            while (await job(client, finished))["status"] != "completed":
                pass
            before = (await client.get(f"/v1/videos/{finished}/content")).content
            running = (await client.post("/v1/videos", json={**VIDEO, "num_inference_steps": LONG // 2,
                                                             "seed": 12})).json()["id"]
            while (await job(client, running))["steps_done"] < 10:
                await asyncio.sleep(0.1)
            old = replica_actor("JobStore")
            ray.kill(old)  # Serve starts another; it reads its journal back
            deadline = time.monotonic() + 300
            while (status := (await job(client, running))["status"]) not in ("completed", "failed", "cancelled"):
                assert time.monotonic() < deadline
            after = await client.get(f"/v1/videos/{finished}/content")
            listed = [j["id"] for j in (await client.get("/v1/videos", params={"limit": 100})).json()["data"]]
            return old, before, after, status, listed, running, finished

    old, before, after, status, listed, running, finished = asyncio.run(scenario())
    assert replica_actor("JobStore")._actor_id != old._actor_id
    assert after.status_code == 200 and after.content == before  # finished before the kill
    assert status == "completed"  # the router stored it once the new store answered
    assert {running, finished} <= set(listed)
