"""Under every policy, a request that ends early frees its worker at the next step boundary: an
image whose HTTP client went away, an image cancelled through a handle, a video cancelled or
deleted through the job API. One worker, so "freed" is plain: the next request runs at once.

The app (tiny-sd images + tiny-wan videos on one CPU worker) is deployed once per policy on one
local Ray, replacing the previous policy's app. CI runs the shipped defaults' policies (the
embedded default's `continuous`, the cluster's `composed`); the others run with `-m slow` (each
deployment costs CI most of a minute).
"""

import time

import httpx
import pytest
from ray import serve

from stepserve.runtime import load_serve_config, run_app, CONFIGS

from tests.cpu.integration.conftest import free_port, local_ray_for_tests

POLICIES = ["continuous", "composed"] + [pytest.param(p, marks=pytest.mark.slow)
                                         for p in ("static_fcfs", "dynamic_batching", "genserve")]
# The largest image the config allows at its most steps: it must outlast the 3 s client timeout
# with room to spare (at 128 px, 100 steps once finished in under 3 s on a quiet machine).
LONG_IMAGE = {"prompt": "a long one", "size": "256x256", "num_inference_steps": 100, "seed": 1}
SHORT_IMAGE = {"prompt": "a short one", "size": "64x64", "num_inference_steps": 3, "seed": 2}
LONG_VIDEO = {"model": "tiny-wan", "prompt": "a long video", "size": "64x64", "num_frames": 9,
              "num_inference_steps": 200, "seed": 3}


def app_config(policy: str, port: int) -> dict:
    config = load_serve_config(CONFIGS / "local-video.yaml")
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    args = config["applications"][0]["args"]
    args["workers"]["num_workers"] = 1
    args["router"] = {"policy": policy, "profiles": ["tiny-sd-cpu", "tiny-wan-cpu"]}
    if policy == "genserve":
        args["router"]["policy_options"] = {"sp_degrees": [1]}
    if policy == "composed":  # as configs/local-video.yaml: the long image outlasts its SLO, and is served
        args["router"]["policy_options"] = {"sp_degrees": [1], "refuse_unattainable": False}
    return config


@pytest.fixture(scope="module")
def ray_port():
    with local_ray_for_tests():
        yield free_port()


@pytest.fixture(scope="module", params=POLICIES)
def app(request, ray_port):
    config = app_config(request.param, ray_port)
    handle = run_app(config, http=True)
    url = f"http://127.0.0.1:{ray_port}"
    deadline = time.monotonic() + 180
    while httpx.get(f"{url}/ready", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "app never became ready"
        time.sleep(0.5)
    yield url, handle, request.param
    serve.delete("stepserve")


def router():
    return serve.get_deployment_handle("Router", app_name="stepserve")


def wait_idle(timeout_s: float = 30.0) -> None:
    """Until nothing runs on the worker (the early-ended request left it)."""
    deadline = time.monotonic() + timeout_s
    while (state := router().readiness.remote().result())["running"] or state["queued"]:
        assert time.monotonic() < deadline, f"the worker was not freed: {state}"
        time.sleep(0.1)


def assert_a_short_image_runs_now(url: str) -> None:
    started = time.monotonic()
    response = httpx.post(f"{url}/v1/images/generations", json=SHORT_IMAGE, timeout=60)
    assert response.status_code == 200, response.text
    assert time.monotonic() - started < 20


def test_a_client_that_disconnects_frees_the_worker(app):
    url, _, policy = app
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/images/generations", json=LONG_IMAGE, timeout=3.0,
                   headers={"Idempotency-Key": f"gone-{policy}"})
    wait_idle()
    assert router().progress.remote("img-unknown").result() is None
    assert_a_short_image_runs_now(url)


def test_a_handle_cancel_frees_the_worker(app):
    url, handle, policy = app
    response = handle.generate.remote(LONG_IMAGE, f"cancel-me-{policy}")
    deadline = time.monotonic() + 60
    while not (p := handle.progress.remote(f"cancel-me-{policy}").result()) or p["steps_done"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert handle.cancel.remote(f"cancel-me-{policy}").result() is True
    with pytest.raises(Exception) as info:
        response.result(timeout_s=60)
    assert getattr(info.value, "code", None) == "cancelled"
    wait_idle()
    assert_a_short_image_runs_now(url)


@pytest.mark.parametrize("how", ["cancel", "delete"])
def test_a_cancelled_or_deleted_video_frees_the_worker(app, how):
    url, _, _ = app
    created = httpx.post(f"{url}/v1/videos", json=LONG_VIDEO, timeout=60)
    assert created.status_code == 200, created.text
    video_id = created.json()["id"]
    deadline = time.monotonic() + 60
    while httpx.get(f"{url}/v1/videos/{video_id}", timeout=30).json()["steps_done"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    if how == "cancel":
        response = httpx.post(f"{url}/v1/videos/{video_id}/cancel", timeout=30)
        assert response.status_code == 200 and response.json()["status"] == "cancelled"
    else:
        response = httpx.delete(f"{url}/v1/videos/{video_id}", timeout=30)
        assert response.json() == {"id": video_id, "object": "video.deleted", "deleted": True}
        assert httpx.get(f"{url}/v1/videos/{video_id}", timeout=30).status_code == 404
    wait_idle()
    assert_a_short_image_runs_now(url)
