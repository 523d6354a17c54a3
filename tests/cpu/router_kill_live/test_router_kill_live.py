"""Kill the router under load (configs/local-video.yaml: images and videos): Serve starts a new
one, which runs the unfinished video jobs again from the start (their records are in the job
store), while the ingress submits again every image the old router died holding. No admitted
request is lost, and what finished before is still there."""

import asyncio
import time

import httpx
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from stepserve.runtime import CONFIGS, load_serve_config

from tests.cpu.integration.conftest import serving

VIDEO = {"model": "tiny-wan", "prompt": "a fox running", "size": "64x64", "num_frames": 5,
         "num_inference_steps": 30}


def image(seed: int) -> dict:
    return {"model": "tiny-sd", "prompt": "a red fox", "size": "64x64", "num_inference_steps": 60, "seed": seed}


@pytest.fixture(scope="module")
def video_app():
    yield from serving(load_serve_config(CONFIGS / "local-video.yaml"))


def router_actor():
    """The Router's replica actor (Serve names it SERVE_REPLICA::<app>#Router#<id>)."""
    (actor,) = [a for a in ray.util.list_named_actors(all_namespaces=True) if "#Router#" in a["name"]]
    return ray.get_actor(actor["name"], namespace=actor["namespace"])


def test_a_router_killed_under_load_loses_no_admitted_request_and_no_finished_video(video_app):
    url, _ = video_app
    router = serve.get_deployment_handle("Router", app_name="stepserve")

    async def scenario():
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            finished = (await client.post("/v1/videos", json={**VIDEO, "num_inference_steps": 4})).json()["id"]
            done = await client.get(f"/v1/videos/{finished}", headers={"Prefer": "wait=60"})
            assert done.json()["status"] == "completed"
            videos = [(await client.post("/v1/videos", json={**VIDEO, "seed": i})).json()["id"] for i in range(2)]
            images = [asyncio.create_task(client.post("/v1/images/generations", json=image(i))) for i in range(4)]
            while True:  # every image and video admitted: the router holds them all
                state = await router.readiness.remote()
                if state["running"] + state["queued"] >= len(images) + len(videos) and state["running"]:
                    break
                await asyncio.sleep(0.05)
            old = router_actor()
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
            metrics = (await client.get("/metrics")).text
            return old, answers, ended, content, metrics

    old, answers, ended, content, metrics = asyncio.run(scenario())
    assert router_actor()._actor_id != old._actor_id
    # The new router's own count: it finished every one of them (the old one's died with it).
    finished_here = sum(s.value for family in text_string_to_metric_families(metrics) for s in family.samples
                        if s.name == "stepserve_requests_total" and s.labels["status"] == "finished")
    assert finished_here == 6
    assert [a.status_code for a in answers] == [200] * 4, [a.text[:200] for a in answers]
    assert [job["status"] for job in ended.values()] == ["completed"] * 2, ended
    assert content.status_code == 200 and content.content  # finished before the kill: still there
