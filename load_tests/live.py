"""Open-loop load against a running stepserve over HTTP: images with `POST /v1/images/generations`,
edits with `POST /v1/images/edits` (multipart: `ScheduledRequest.files`), videos with the job
API (`POST /v1/videos`, then `GET /v1/videos/{id}` until the job ends).

Each request leaves at its scheduled offset whether or not earlier ones have answered, so a
slow server meets the offered load instead of quietly lowering it (no coordinated omission).
A run always ends on its own: every request has a timeout and the run has a deadline.

A video's latency runs from its scheduled send to the status answer that saw it `completed`.
Status requests are long polls (`Prefer: wait=N`, RFC 7240): the server answers when the job
ends, so the latency is exact to one HTTP answer, and a waiting video costs the server one open
request, not a status request every few milliseconds (at a 25 ms poll interval those requests
took more CPU than the workers on a 2-core machine, and latency measured the polling). A server
that does not apply the preference (no `Preference-Applied` in its answer) is polled every
`video_poll_s` instead, and a latency then reads up to one interval late.
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
from collections.abc import Sequence
from dataclasses import replace
from urllib.parse import urlsplit

import httpx
import openai

from stepserve.load_tests.records import RequestRecord
from stepserve.load_tests.workload import ScheduledRequest

GENERATIONS = "/v1/images/generations"
EDITS = "/v1/images/edits"
VIDEOS = "/v1/videos"
VIDEO_POLL_S = 0.25  # seconds between status polls of a video job, if the server cannot long-poll
VIDEO_WAIT_S = 30  # seconds one status long poll may wait for the job to end
# A video job that ended without its frames, as the HTTP status the image path would answer:
# a failed generation is a server error, a cancelled request a conflict (as `edge.as_api_error`).
JOB_END_STATUS = {"failed": 500, "cancelled": 409}


def check_loopback(base_url: str) -> str:
    """The URL, if it points at this machine; load is never sent anywhere else."""
    parts = urlsplit(base_url)
    host = parts.hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if parts.scheme != "http" or not loopback:
        raise ValueError(f"only http:// loopback targets are allowed, got {base_url!r}")
    return base_url.rstrip("/")


def loopback_client(base_url: str) -> httpx.AsyncClient:
    # No pool limit: a capped pool would queue sends client-side and close the loop again.
    # trust_env=False: a proxy from the environment must not intercept loopback traffic.
    return httpx.AsyncClient(
        base_url=check_loopback(base_url), timeout=None, trust_env=False,
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
    )


async def wait_ready(base_url: str, timeout_s: float = 120.0) -> dict:
    """Poll `GET /ready` until it answers 200; returns its body."""
    deadline = time.monotonic() + timeout_s
    async with loopback_client(base_url) as client:
        while True:
            try:
                response = await client.get("/ready", timeout=5.0)
                if response.status_code == 200:
                    return response.json()
            except httpx.TransportError:
                pass  # the proxy is not listening yet
            if time.monotonic() > deadline:
                raise TimeoutError(f"{base_url}/ready did not answer 200 within {timeout_s} s")
            await asyncio.sleep(0.5)


def _error_message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200]


async def _image(client: httpx.AsyncClient, request: ScheduledRequest) -> tuple[int, str | None]:
    files = request.files()
    if files is None:
        response = await client.post(GENERATIONS, json=request.body())
    else:  # an edit: its fields as form values
        response = await client.post(EDITS, data={k: str(v) for k, v in request.body().items()}, files=files)
    return response.status_code, None if response.status_code == 200 else _error_message(response)


async def _image_via_openai(client: openai.AsyncOpenAI, request: ScheduledRequest) -> tuple[int, str | None]:
    """The same request through the official client: OpenAI's fields as arguments, every
    extension (steps, seed, add-ons...) in `extra_body`."""
    body = request.body()
    model = body.pop("model", None)
    named = {} if model is None else {"model": model}
    files = request.files()
    try:
        if files is None:
            await client.images.generate(prompt=body.pop("prompt"), size=body.pop("size"), n=body.pop("n"),
                                         response_format="b64_json", extra_body=body, **named)
        else:
            await client.images.edit(image=files["image"], mask=files["mask"], prompt=body.pop("prompt"),
                                     n=body.pop("n"), response_format="b64_json", extra_body=body, **named)
    except openai.APIStatusError as exc:
        return exc.status_code, exc.message
    return 200, None


async def _video(client: httpx.AsyncClient, request: ScheduledRequest, poll_s: float,
                 job: dict[str, str]) -> tuple[int | None, str | None]:
    """Create the job and long-poll it until it ends; (200, None) once it is completed. `job` gets
    the job's id as soon as the server hands it out, so a caller that gives up can cancel it."""
    response = await client.post(VIDEOS, json=request.body())
    polled = False
    while True:
        if response.status_code != 200:
            return response.status_code, _error_message(response)
        try:
            video = response.json()
            job["id"], status = str(video["id"]), str(video["status"])
        except (ValueError, KeyError, TypeError):
            return None, f"not a video object: {response.text[:200]}"
        if status == "completed":
            return 200, None
        if status in JOB_END_STATUS:
            error = video.get("error")
            message = (error.get("message") if isinstance(error, dict) else error) or f"video {status}"
            return JOB_END_STATUS[status], f"video {status}: {message}"
        if polled and "preference-applied" not in response.headers:
            await asyncio.sleep(poll_s)  # the server answered at once: poll
        response = await client.get(f"{VIDEOS}/{job['id']}", headers={"Prefer": f"wait={VIDEO_WAIT_S}"})
        polled = True


async def _cancel_video(client: httpx.AsyncClient, video_id: str, budget_s: float) -> None:
    """Best effort: a video the client gave up on must not keep taking workers from the rest of
    the run (an image's is cancelled server-side when its connection closes)."""
    if budget_s <= 0:
        return  # the run is over; the app is torn down after it anyway
    try:
        await asyncio.wait_for(client.post(f"{VIDEOS}/{video_id}/cancel"), budget_s)
    except (asyncio.TimeoutError, httpx.HTTPError):
        pass


async def _one(client: httpx.AsyncClient, request: ScheduledRequest, start: float, timeout_s: float,
               deadline_s: float, video_poll_s: float = VIDEO_POLL_S,
               sdk: openai.AsyncOpenAI | None = None) -> RequestRecord:
    def now() -> float:
        return time.perf_counter() - start

    base = dict(index=request.index, steps=request.num_inference_steps, scheduled_s=request.offset_s,
                slo_s=request.slo_s, width=request.width, height=request.height,
                request_class=request.request_class)
    await asyncio.sleep(max(0.0, min(request.offset_s, deadline_s) - now()))
    sent = now()
    if sent >= deadline_s:
        return RequestRecord(**base, sent_s=None, latency_s=None, status=None, error="run deadline reached before send")
    # The run deadline caps every wait, so the run ends on time without cancelling anything.
    budget = min(timeout_s, deadline_s - sent)
    job: dict[str, str] = {}
    if request.is_video:
        call = _video(client, request, video_poll_s, job)
    else:
        call = _image(client, request) if sdk is None else _image_via_openai(sdk, request)
    try:
        status, error = await asyncio.wait_for(call, budget)
    except asyncio.TimeoutError:
        # wait_for cancelled the call, closing its connection, which cancels an image server-side;
        # a video job outlives its connections, so it is cancelled explicitly.
        if "id" in job:
            await _cancel_video(client, job["id"], min(1.0, deadline_s - now()))
        what = "completion" if request.is_video else "response"
        error = f"no {what} within {budget:.1f} s"
        return RequestRecord(**base, sent_s=sent, latency_s=None, status=None, error=error)
    except httpx.HTTPError as exc:
        return RequestRecord(**base, sent_s=sent, latency_s=None, status=None, error=f"{type(exc).__name__}: {exc}")
    latency = now() - request.offset_s
    if status is None:  # the server answered, but not with anything a video job says
        return RequestRecord(**base, sent_s=sent, latency_s=None, status=None, error=error)
    return RequestRecord(**base, sent_s=sent, latency_s=latency, status=status, error=error)


async def run_open_loop(base_url: str, requests: Sequence[ScheduledRequest], request_timeout_s: float,
                        deadline_s: float, video_poll_s: float = VIDEO_POLL_S,
                        via_openai: bool = False) -> list[RequestRecord]:
    """Send every request at its offset; returns one record per request, in workload order.
    `via_openai`: images go through the official `openai` client (videos keep the job API).

    A request waits at most `request_timeout_s` for its answer (a video: for its job to end,
    long-polled, or polled every `video_poll_s` by a server that cannot), and nothing waits past
    `deadline_s` after the start; what is unanswered by then is recorded without a response.
    """
    if not video_poll_s > 0:
        raise ValueError(f"video_poll_s must be > 0, got {video_poll_s}")
    sdk = openai.AsyncOpenAI(
        base_url=f"{check_loopback(base_url)}/v1", api_key="unused", max_retries=0, timeout=request_timeout_s,
        http_client=loopback_client(base_url)) if via_openai else None
    async with loopback_client(base_url) as client:
        start = time.perf_counter()
        try:
            return list(await asyncio.gather(
                *(_one(client, r, start, request_timeout_s, deadline_s, video_poll_s, sdk) for r in requests)
            ))
        finally:
            if sdk is not None:
                await sdk.close()


def one_by_one(base_url: str, requests: Sequence[ScheduledRequest], timeout_s: float) -> list[RequestRecord]:
    """Each request alone, sent once the previous one answered (solo latencies, warm-ups); one
    that fails raises, naming it."""
    records = []
    for request in requests:
        (record,) = asyncio.run(run_open_loop(base_url, [replace(request, offset_s=0.0)], timeout_s, timeout_s))
        if not record.ok:
            raise RuntimeError(f"{request.request_class or 'request'} {request.index} failed alone: {record.error}")
        records.append(record)
    return records
