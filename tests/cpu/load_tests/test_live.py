"""The open-loop generator against a small local HTTP server that answers slowly on purpose."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from stepserve.load_tests.live import check_loopback, run_open_loop, wait_ready
from stepserve.load_tests.workload import ScheduledRequest

REFUSED_STEPS = 13  # the fake server answers 429 to this step count


def fake_app() -> FastAPI:
    app = FastAPI()

    @app.post("/v1/images/generations")
    async def generate(request: Request) -> JSONResponse:
        body = await request.json()
        if body["num_inference_steps"] == REFUSED_STEPS:
            return JSONResponse({"error": {"message": "the server is at capacity"}}, status_code=429)
        await asyncio.sleep(body["num_inference_steps"] / 100)  # 10 ms per step
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


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://localhost:1/", "http://[::1]:9", "http://127.5.0.1"])
def test_loopback_targets_are_allowed(url):
    assert check_loopback(url) == url.rstrip("/")


@pytest.mark.parametrize("url", ["http://example.com", "https://127.0.0.1", "http://10.0.0.1:8000", "127.0.0.1:8000",
                                 "http://localhost.example.com"])
def test_other_targets_are_refused(url):
    with pytest.raises(ValueError):
        check_loopback(url)
