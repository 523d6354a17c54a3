"""Open-loop load against a running stepserve over HTTP (`POST /v1/images/generations`).

Each request leaves at its scheduled offset whether or not earlier ones have answered, so a
slow server meets the offered load instead of quietly lowering it (no coordinated omission).
A run always ends on its own: every request has a timeout and the run has a deadline.
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
from collections.abc import Sequence
from urllib.parse import urlsplit

import httpx

from .records import RequestRecord
from .workload import ScheduledRequest

GENERATIONS = "/v1/images/generations"


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


async def _one(client: httpx.AsyncClient, request: ScheduledRequest, start: float, timeout_s: float,
               deadline_s: float) -> RequestRecord:
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
    try:
        response = await asyncio.wait_for(client.post(GENERATIONS, json=request.body()), budget)
    except asyncio.TimeoutError:
        # wait_for cancelled the call, closing its connection, which cancels it server-side.
        error = f"no response within {budget:.1f} s"
        return RequestRecord(**base, sent_s=sent, latency_s=None, status=None, error=error)
    except httpx.HTTPError as exc:
        return RequestRecord(**base, sent_s=sent, latency_s=None, status=None, error=f"{type(exc).__name__}: {exc}")
    latency = now() - request.offset_s
    error = None if response.status_code == 200 else _error_message(response)
    return RequestRecord(**base, sent_s=sent, latency_s=latency, status=response.status_code, error=error)


async def run_open_loop(base_url: str, requests: Sequence[ScheduledRequest], request_timeout_s: float,
                        deadline_s: float) -> list[RequestRecord]:
    """Send every request at its offset; returns one record per request, in workload order.

    A request waits at most `request_timeout_s` for its answer, and nothing waits past
    `deadline_s` after the start; what is unanswered by then is recorded without a response.
    """
    async with loopback_client(base_url) as client:
        start = time.perf_counter()
        return list(await asyncio.gather(
            *(_one(client, r, start, request_timeout_s, deadline_s) for r in requests)
        ))
