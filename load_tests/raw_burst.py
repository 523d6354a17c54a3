"""A burst of HTTP requests sent at once, with as little client work as possible in the way.

Every connection is opened first, then every request is written back to back (a few
milliseconds for hundreds), and each answer's status line and headers are timed as they come.
An HTTP client library costs milliseconds of CPU per request on a small machine (httpx: about
10 ms on 2 cores), which would spread the burst over seconds and put the client's own
queueing into every latency; here a latency is the server's.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from stepserve.load_tests.live import check_loopback


@dataclass(frozen=True)
class BurstAnswer:
    status: int
    latency_s: float  # from this request's write to its status line and headers
    retry_after: str | None
    body: bytes


async def burst(base_url: str, path: str, body: dict[str, Any], count: int,
                headers: dict[str, str] | None = None) -> list[BurstAnswer]:
    """POST `body` as JSON to `path` `count` times at once; the answers in sending order."""
    url = urlsplit(check_loopback(base_url))
    payload = json.dumps(body).encode()
    extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
    request = (f"POST {path} HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(payload)}\r\n{extra}Connection: close\r\n\r\n").encode() + payload
    connections = [await asyncio.open_connection(url.hostname, url.port) for _ in range(count)]
    sent = [0.0] * count
    try:
        answers = [asyncio.create_task(_answer(reader, sent, i)) for i, (reader, _) in enumerate(connections)]
        for i, (_, writer) in enumerate(connections):
            writer.write(request)
            sent[i] = time.perf_counter()
        await asyncio.gather(*(writer.drain() for _, writer in connections))
        return list(await asyncio.gather(*answers))
    finally:
        for _, writer in connections:
            writer.close()


async def _answer(reader: asyncio.StreamReader, sent: list[float], i: int) -> BurstAnswer:
    status = int((await reader.readline()).split()[1])
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    answered = time.perf_counter()
    return BurstAnswer(status, answered - sent[i], headers.get("retry-after"), await reader.read())
