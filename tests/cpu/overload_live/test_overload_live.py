"""The edge live, on the real app: a burst beyond what the queues hold is refused by the ingress's
admission gate (429 + Retry-After, in milliseconds once the request reaches it, the router never
asked) while every request let in is served; and video jobs created while the router is still
starting are refused 503 until it is up, then complete, never accepted and then failed."""

import asyncio
import copy
import threading
import time

import httpx
import pytest
from ray import serve

from stepserve.load_tests.bench_burst import refusals_in_the_ingress, router_refused
from stepserve.load_tests.raw_burst import burst
from stepserve.runtime import CONFIGS, tiny_config_path, load_serve_config, run_app

from tests.cpu.integration.conftest import free_port, local_ray_for_tests

GENERATIONS = "/v1/images/generations"


@pytest.fixture(scope="module")
def port():
    """One Ray for the module, and one HTTP port: Serve keeps the proxy of its first start."""
    with local_ray_for_tests():
        yield free_port()


def on_port(path, port: int, **router) -> tuple[dict, str]:
    config = copy.deepcopy(load_serve_config(path))
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    args = config["applications"][0]["args"]
    args["router"] = {**args["router"], **router}
    return config, f"http://127.0.0.1:{port}"


def test_a_burst_is_refused_at_the_edge_and_every_admitted_request_is_served(port):
    # 60 at once against 16 worker slots and a queue of 8: most must be refused, and none by
    # the router (the gate counts what it let in, whatever its last report said).
    config, url = on_port(tiny_config_path(), port, max_queued_images=8)
    run_app(config, http=True)
    try:
        # 40 steps: a served request takes well over a second here, a refusal a fraction of one.
        body = {"prompt": "a red fox", "size": "64x64", "num_inference_steps": 40}
        httpx.post(f"{url}{GENERATIONS}", json=body, timeout=120).raise_for_status()
        before = httpx.get(f"{url}/metrics").text
        answers = asyncio.run(burst(url, GENERATIONS, body, 60))
        after = httpx.get(f"{url}/metrics").text
    finally:
        serve.delete("stepserve")
    refused = [a for a in answers if a.status == 429]
    served = [a for a in answers if a.status == 200]
    assert len(refused) + len(served) == len(answers), [a.status for a in answers]
    assert len(refused) >= 60 - (16 + 8) and served, (len(refused), len(served))
    assert all(a.retry_after is not None and int(a.retry_after) >= 1 for a in refused)
    assert all(a.body.startswith(b"{\"created\"") for a in served)
    assert router_refused(after) == router_refused(before), "the router had to refuse what the edge let through"
    # Every refusal is the ingress's, and takes it less time than any request served takes: a
    # refusal never waits for work (how fast it is, and what the client sees with the HTTP
    # proxy's queue in front, is load_tests/bench_burst.py's to measure: a timed bound here
    # failed on a loaded machine).
    ingress = refusals_in_the_ingress(before, after)
    assert ingress["count"] == len(refused), ingress
    assert ingress["p99_at_most_s"] < min(a.latency_s for a in served), (ingress, sorted(a.latency_s for a in served))


def test_videos_created_while_the_router_starts_complete(port):
    config, url = on_port(CONFIGS / "local-video.yaml", port)
    deploying = threading.Thread(target=run_app, args=(config,), daemon=True)
    deploying.start()
    video = {"model": "tiny-wan", "prompt": "a red fox runs", "size": "64x64", "num_frames": 5,
             "num_inference_steps": 3, "seed": 1}
    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            deadline = time.monotonic() + 240
            while True:  # the moment the ingress answers (the router may still be loading its workers)
                try:
                    if client.get("/v1/models").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "the ingress never answered"
                time.sleep(0.05)
            ids, refusals = [], 0
            while len(ids) < 3:
                created = client.post("/v1/videos", json={**video, "seed": len(ids)})
                if created.status_code == 503:  # the router is not up yet: retry as told
                    refusals += 1
                    assert created.headers["retry-after"] and created.json()["error"]["code"] == "unavailable"
                    time.sleep(0.5)
                    continue
                assert created.status_code == 200, created.text
                ids.append(created.json()["id"])
            # What this test is for: jobs sent while the router was still loading its workers.
            assert refusals > 0, "the router was up before the ingress answered: nothing was tested"
            for video_id in ids:
                while (job := client.get(f"/v1/videos/{video_id}", headers={"Prefer": "wait=30"}).json())[
                        "status"] in ("queued", "in_progress"):
                    assert time.monotonic() < deadline, job
                assert job["status"] == "completed", job
                assert job["expires_at"] >= job["completed_at"]
    finally:
        deploying.join(timeout=240)
        serve.delete("stepserve")
