"""The open-loop generator against a small local HTTP server that answers slowly on purpose.

The server is a test double of stepserve's HTTP API: images answer after 10 ms per step, edits
at once (recording their form); a video is a job (the shape of `deployments/videos.py`, tested for real in
tests/cpu/deployments/test_videos_api.py) that completes 10 ms per step after its creation.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import socket
import threading
import time
from dataclasses import fields, replace

import numpy as np
import PIL.Image
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from stepserve.load_tests.edit_workload import ScheduledEdit, mask_png
from stepserve.load_tests.live import check_loopback, one_by_one, run_open_loop, wait_ready
from stepserve.load_tests.workload import ScheduledRequest

REFUSED_STEPS = 13  # the fake server answers 429 to this step count
FAILING_STEPS = 17  # a video job with this step count fails when it would have completed


class FakeJobs:
    """Video jobs that run on the clock: queued, in progress, then completed (or failed)."""

    def __init__(self) -> None:
        self.jobs: dict[str, dict] = {}
        self.bodies: list[dict] = []  # every create body, in arrival order
        self.polls: dict[str, int] = {}
        self.cancelled: list[str] = []
        self.long_polls = True  # honour `Prefer: wait=N` as stepserve does
        self._ids = itertools.count()

    def create(self, body: dict) -> dict:
        self.bodies.append(body)
        job_id = f"video_{next(self._ids):032x}"
        self.jobs[job_id] = {"id": job_id, "steps": body["num_inference_steps"], "seed": body["seed"],
                             "created": time.monotonic(), "status": "queued"}
        self.polls[job_id] = 0
        return self.view(job_id)

    def view(self, job_id: str) -> dict:
        job = self.jobs[job_id]
        elapsed = time.monotonic() - job["created"]
        if job["status"] not in ("cancelled", "failed", "completed") and elapsed >= job["steps"] / 100:
            job["status"] = "failed" if job["steps"] == FAILING_STEPS else "completed"
        elif job["status"] == "queued" and elapsed > 0.02:
            job["status"] = "in_progress"
        error = {"code": "generation_failed", "message": "video generation failed"} if job["status"] == "failed" \
            else None
        return {"id": job_id, "object": "video", "status": job["status"], "error": error}


JOBS = FakeJobs()
IMAGE_BODIES: list[dict] = []  # every image body, in arrival order
EDITS: list[dict] = []  # every edit's form fields, with its files' sizes in bytes under "files"


def fake_app() -> FastAPI:
    app = FastAPI()

    @app.post("/v1/videos")
    async def create_video(request: Request) -> JSONResponse:
        body = await request.json()
        if body["num_inference_steps"] == REFUSED_STEPS:
            return JSONResponse({"error": {"message": "too many queued videos"}}, status_code=429)
        return JSONResponse(JOBS.create(body))

    @app.get("/v1/videos/{video_id}")
    async def get_video(video_id: str, request: Request) -> JSONResponse:
        if video_id not in JOBS.jobs:
            return JSONResponse({"error": {"message": f"video {video_id!r} does not exist"}}, status_code=404)
        JOBS.polls[video_id] += 1
        prefer = request.headers.get("prefer", "")
        if not (JOBS.long_polls and prefer.startswith("wait=")):
            return JSONResponse(JOBS.view(video_id))
        until = time.monotonic() + float(prefer.removeprefix("wait="))
        while JOBS.view(video_id)["status"] in ("queued", "in_progress") and time.monotonic() < until:
            await asyncio.sleep(0.002)
        return JSONResponse(JOBS.view(video_id), headers={"Preference-Applied": prefer})

    @app.post("/v1/videos/{video_id}/cancel")
    async def cancel_video(video_id: str) -> JSONResponse:
        JOBS.cancelled.append(video_id)
        JOBS.jobs[video_id]["status"] = "cancelled"
        return JSONResponse(JOBS.view(video_id))

    @app.post("/v1/images/generations")
    async def generate(request: Request) -> JSONResponse:
        body = await request.json()
        IMAGE_BODIES.append(body)
        if body["num_inference_steps"] == REFUSED_STEPS:
            return JSONResponse({"error": {"message": "the server is at capacity"}}, status_code=429)
        await asyncio.sleep(body["num_inference_steps"] / 100)  # 10 ms per step
        return JSONResponse({"data": []})

    @app.post("/v1/images/edits")
    async def edit(request: Request) -> JSONResponse:
        form = await request.form()
        fields = {k: v for k, v in form.items() if isinstance(v, str)}
        fields["files"] = {k: len(await v.read()) for k, v in form.items() if not isinstance(v, str)}
        EDITS.append(fields)
        return JSONResponse({"data": []})

    @app.get("/ready")
    async def ready() -> JSONResponse:
        return JSONResponse({"status": "ready"})

    return app


@pytest.fixture(scope="module")
def server_url():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(fake_app(), host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=0.2))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    asyncio.run(wait_ready(url, timeout_s=10))
    yield url
    server.should_exit = True
    thread.join(timeout=10)


def request(index: int, offset: float, steps: int) -> ScheduledRequest:
    return ScheduledRequest(index=index, offset_s=offset, num_inference_steps=steps, seed=index, width=64,
                            height=64, guidance_scale=7.5, prompt="p")


def video(index: int, offset: float, steps: int) -> ScheduledRequest:
    return ScheduledRequest(index=index, offset_s=offset, num_inference_steps=steps, seed=index, width=64,
                            height=64, guidance_scale=5.0, prompt="a fox", model="tiny-wan", num_frames=9,
                            request_class="video")


def created(index: int) -> tuple[str, dict]:
    """The job id and create body of the video with this seed, as the fake server saw them."""
    [body] = [b for b in JOBS.bodies if b["seed"] == index]
    [job_id] = [j for j, job in JOBS.jobs.items() if job["seed"] == index]
    return job_id, body


def test_sends_on_schedule_while_earlier_requests_are_outstanding(server_url):
    # Each answer takes 0.5 s and a request is due every 50 ms: a closed loop would fall
    # behind by ~0.45 s per request; the open loop sends every one on time.
    requests = [request(i, 0.05 * i, steps=50) for i in range(8)]
    records = asyncio.run(run_open_loop(server_url, requests, request_timeout_s=5, deadline_s=10))
    assert [r.index for r in records] == list(range(8))
    assert all(r.ok and r.error is None for r in records)
    for r in records:
        assert 0 <= r.sent_s - r.scheduled_s < 0.2
        assert 0.5 <= r.latency_s < 1.5


def test_failures_are_recorded_not_raised(server_url):
    requests = [request(0, 0.0, steps=REFUSED_STEPS), request(1, 0.0, steps=300)]
    records = asyncio.run(run_open_loop(server_url, requests, request_timeout_s=0.5, deadline_s=10))
    refused, slow = records
    assert (refused.status, refused.error) == (429, "the server is at capacity")
    assert refused.latency_s is not None and not refused.ok
    assert slow.status is None and slow.latency_s is None and "0.5 s" in slow.error


def test_run_ends_at_its_deadline(server_url):
    # A 3 s answer and a request due after the deadline: the run still ends at ~0.6 s.
    requests = [request(0, 0.0, steps=300), request(1, 1.0, steps=10)]
    start = time.perf_counter()
    answered_late, never_sent = asyncio.run(run_open_loop(server_url, requests, request_timeout_s=60, deadline_s=0.6))
    assert time.perf_counter() - start < 0.95  # not the 1.0 s offset of the unsent one, nor 3 s
    assert answered_late.sent_s is not None and answered_late.status is None
    assert never_sent.sent_s is None and never_sent.status is None and "deadline" in never_sent.error


def test_videos_are_jobs_long_polled_until_completed(server_url):
    # An image and a video side by side: the image is answered in one call, the video is created
    # with its job body and long-polled: one status request, answered when the job completes.
    requests = [request(0, 0.0, steps=30), video(1000, 0.0, steps=30)]
    image, clip = asyncio.run(run_open_loop(server_url, requests, request_timeout_s=5, deadline_s=10,
                                            video_poll_s=2.0))
    assert image.ok and 0.3 <= image.latency_s < 1.0
    assert clip.ok and clip.error is None and clip.request_class == "video"
    # When it completed, not at the 2 s poll (the margin is for a busy CI machine, whose thread
    # switches once stretched this to 0.76 s).
    assert 0.3 <= clip.latency_s < 0.3 + 1.0
    job_id, body = created(1000)
    assert (body["num_frames"], body["size"], body["model"]) == (9, "64x64", "tiny-wan")
    assert body["num_inference_steps"] == 30 and "n" not in body
    assert JOBS.polls[job_id] == 1


def test_a_server_that_cannot_long_poll_is_polled_and_the_interval_bounds_the_latency(server_url):
    # The job completes 0.1 s after creation; polled every 0.4 s, the client sees it at the
    # first poll, 0.4 s in: the latency reads late by less than one interval.
    JOBS.long_polls = False
    try:
        [clip] = asyncio.run(run_open_loop(server_url, [video(1001, 0.0, steps=10)], request_timeout_s=5,
                                           deadline_s=10, video_poll_s=0.4))
    finally:
        JOBS.long_polls = True
    assert clip.ok and 0.4 <= clip.latency_s < 0.1 + 0.4 + 0.3


def test_video_failures_are_recorded_not_raised(server_url):
    requests = [video(1002, 0.0, steps=REFUSED_STEPS), video(1003, 0.0, steps=FAILING_STEPS),
                video(1004, 0.0, steps=300)]
    refused, failed, slow = asyncio.run(run_open_loop(server_url, requests, request_timeout_s=0.5, deadline_s=10))
    assert (refused.status, refused.error) == (429, "too many queued videos") and not refused.ok
    assert failed.status == 500 and failed.error == "video failed: video generation failed" and not failed.ok
    assert failed.latency_s is not None and failed.latency_s >= FAILING_STEPS / 100
    # Timed out: no status, and the job it left running on the server is cancelled.
    assert slow.status is None and slow.latency_s is None and "0.5 s" in slow.error
    slow_id, _ = created(1004)
    assert slow_id in JOBS.cancelled and JOBS.jobs[slow_id]["status"] == "cancelled"


def test_a_video_still_running_at_the_deadline_ends_the_run_on_time(server_url):
    start = time.perf_counter()
    [clip] = asyncio.run(run_open_loop(server_url, [video(1005, 0.0, steps=300)], request_timeout_s=60,
                                       deadline_s=0.5))
    assert time.perf_counter() - start < 1.0  # not the job's 3 s
    assert clip.sent_s is not None and clip.status is None and clip.latency_s is None


def test_poll_interval_must_be_positive(server_url):
    with pytest.raises(ValueError):
        asyncio.run(run_open_loop(server_url, [video(0, 0.0, steps=10)], request_timeout_s=1, deadline_s=1,
                                  video_poll_s=0))


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://localhost:1/", "http://[::1]:9", "http://127.5.0.1"])
def test_loopback_targets_are_allowed(url):
    assert check_loopback(url) == url.rstrip("/")


@pytest.mark.parametrize("url", ["http://example.com", "https://127.0.0.1", "http://10.0.0.1:8000", "127.0.0.1:8000",
                                 "http://localhost.example.com"])
def test_other_targets_are_refused(url):
    with pytest.raises(ValueError):
        check_loopback(url)


def test_images_through_the_openai_client_carry_every_extension(server_url):
    with_addons = replace(request(0, 0.0, 2), controlnets=("canny",), loras=("papercut",), negative_prompt="fog")
    requests = [with_addons, request(1, 0.01, REFUSED_STEPS)]
    records = asyncio.run(run_open_loop(server_url, requests, 5.0, 10.0, via_openai=True))
    assert [r.status for r in records] == [200, 429]
    body = next(b for b in IMAGE_BODIES if b["seed"] == 0 and "loras" in b)
    assert body["loras"] == [{"name": "papercut"}] and body["controlnets"][0]["name"] == "canny"
    assert body["controlnets"][0]["image"] and body["negative_prompt"] == "fog" and body["num_inference_steps"] == 2
    assert body["response_format"] == "b64_json" and body["size"] == "64x64"


@pytest.mark.parametrize("via_openai", [False, True])
def test_edits_are_multipart_with_their_template_picture_and_mask(server_url, via_openai):
    """A `ScheduledEdit` goes to `POST /v1/images/edits`: its fields as form values (the template
    and the SLO it is held to among them), its template's picture and a mask of about its ratio
    as files; through the openai client too."""
    seed = 40 + via_openai
    edit = ScheduledEdit(**{f.name: getattr(request(0, 0.0, 3), f.name) for f in fields(ScheduledRequest)},
                         mask_ratio=0.25, template_id="sofa")
    edit = replace(edit, seed=seed, slo_s=2.5, send_slo=True, model="tiny-sd3")
    [record] = asyncio.run(run_open_loop(server_url, [edit], 5.0, 10.0, via_openai=via_openai))
    assert record.status == 200, record.error
    [sent] = [e for e in EDITS if e.get("seed") == str(seed)]
    assert (sent["template_id"], sent["slo_s"], sent["num_inference_steps"], sent["model"]) == \
        ("sofa", "2.5", "3", "tiny-sd3")
    assert "size" not in sent and set(sent["files"]) == {"image", "mask"} and min(sent["files"].values()) > 0
    assert edit.files()["image"] == ScheduledEdit(**{**edit.__dict__, "seed": 1}).files()["image"]  # one template


def test_mask_covers_about_its_ratio_on_the_latent_grid():
    alpha = np.asarray(PIL.Image.open(io.BytesIO(mask_png(64, 64, 0.25))))[..., 3]
    assert (alpha == 0).mean() == 0.25 and alpha.shape == (64, 64)
    assert (np.asarray(PIL.Image.open(io.BytesIO(mask_png(64, 32, 0.01))))[..., 3] == 0).sum() == 16 * 16


def test_one_by_one_sends_each_request_once_the_last_answered_and_raises_on_a_failure(server_url):
    records = one_by_one(server_url, [request(0, 5.0, 10), request(1, 9.0, 10)], 5.0)
    assert [r.status for r in records] == [200, 200]
    assert records[1].sent_s >= 0.0 and all(0.09 <= r.latency_s < 1.0 for r in records)  # offsets dropped
    with pytest.raises(RuntimeError, match="request 1 failed alone"):
        one_by_one(server_url, [request(0, 0.0, 2), request(1, 0.0, REFUSED_STEPS)], 5.0)
