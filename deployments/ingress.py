"""The HTTP/handle ingress: validates, fans a request out to the router, decodes, answers.

Routes: POST /v1/images/generations, POST /v1/videos, GET /v1/videos/{id}, GET /v1/videos/{id}/content,
GET /v1/models, GET /health, GET /ready, GET /metrics. Handle callers use `generate(request)`,
`progress(request_id)`, `create_video(request)`, `get_video(id)` and `video_content(id)` with the same types.
"""

# No `from __future__ import annotations` here: FastAPI must see real annotations on the route
# methods that `serve.ingress` wraps, or it mistakes `request: Request` for a query parameter.

import asyncio
import base64
import hmac
import json
import logging
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from ray import serve

from ..actors.router import RequestCancelledError, RequestFailedError
from ..actors.router_core import DuplicateRequestError, QueueFullError
from .config import AppConfig
from .errors import APIError, invalid
from .protocol import ImageGenerationRequest
from .validation import to_specs
from .video_encoding import FORMAT_HEADER
from .video_validation import VideoCreateRequest
from .videos import VideoJobs, is_form, read_form

logger = logging.getLogger("stepserve.ingress")

api = FastAPI(title="stepserve", description="Diffusion serving scheduled by the denoising step.")


@api.exception_handler(APIError)
async def _on_api_error(_: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


@api.exception_handler(Exception)
async def _on_unexpected(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error")
    return JSONResponse(APIError(500, "internal server error", code="internal_error").body(), status_code=500)


async def read_json(request: Request, limit: int) -> Any:
    """The body as JSON, refusing more than `limit` bytes before reading them all."""
    return parse_json(await read_body(request, limit))


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refusing more than `limit` bytes before reading them all."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise APIError(413, f"request body exceeds {limit} bytes", code="request_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"request body exceeds {limit} bytes", code="request_too_large")
    return bytes(body)


def parse_json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        raise invalid(None, "request body is not valid JSON", code="invalid_json") from None


def _as_api_error(exc: BaseException) -> BaseException:
    """Router outcomes as API errors; anything else (e.g. CancelledError) passes unchanged."""
    if isinstance(exc, QueueFullError):
        return APIError(429, "the server is at capacity; retry later", code="queue_full", type="rate_limit_error")
    if isinstance(exc, RequestFailedError):
        return APIError(500, f"generation failed: {exc}", code="generation_failed")
    if isinstance(exc, RequestCancelledError):
        return APIError(409, str(exc), code="cancelled")
    if isinstance(exc, DuplicateRequestError):
        return APIError(409, str(exc), param="request_id", code="duplicate_request_id")
    return exc


async def _mapped(call: Any) -> Any:
    """Await `call`, turning router exceptions into API errors as `generate` does."""
    try:
        return await call
    except BaseException as exc:
        raise _as_api_error(exc) from None


class HTTPMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("stepserve_http_requests", "HTTP requests by route and status code.",
                                ["route", "code"], registry=self.registry)
        self.latency = Histogram("stepserve_http_latency_seconds", "HTTP request latency by route.", ["route"],
                                 buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100),
                                 registry=self.registry)


@serve.ingress(api)
class Ingress:
    def __init__(self, config: AppConfig, router: Any, vae_decoder: Any):
        self.config = config
        self.router = router
        self.vae_decoder = vae_decoder
        self.api_keys = config.resolved_api_keys()
        self.http = HTTPMetrics()
        self.videos = VideoJobs(config, router)

    # -- handle API ----------------------------------------------------------------------

    async def generate(self, request: ImageGenerationRequest | dict, request_id: str | None = None) -> dict:
        """Generate images; returns the OpenAI images response body. Raises APIError."""
        specs = to_specs(request, self.config, request_id or f"img-{uuid.uuid4().hex}")
        try:
            latents = await asyncio.gather(*(self.router.submit.remote(spec) for spec in specs))
        except BaseException as exc:
            # Free the siblings of a failed or abandoned request; but a duplicate id belongs to
            # another caller's live request, which must not be cancelled.
            if not isinstance(exc, DuplicateRequestError):
                for spec in specs:
                    self.router.cancel.remote(spec.request_id)
            raise _as_api_error(exc) from None
        pngs = await asyncio.gather(
            *(self.vae_decoder.decode_png.remote(spec.model, lat) for spec, lat in zip(specs, latents))
        )
        return {
            "created": int(time.time()),
            "data": [{"b64_json": base64.b64encode(png).decode(), "seed": spec.seed} for spec, png in zip(specs, pngs)],
        }

    async def progress(self, request_id: str) -> dict | None:
        """{status, steps_done, steps_total} while the request is known to the router, else None."""
        return await self.router.progress.remote(request_id)

    async def cancel(self, request_id: str) -> bool:
        return await self.router.cancel.remote(request_id)

    async def create_video(self, request: VideoCreateRequest | dict) -> dict:
        """Queue a video job; returns the OpenAI video object at once (poll `get_video`). Raises APIError."""
        return await _mapped(self.videos.create(request))

    async def get_video(self, video_id: str) -> dict:
        """The OpenAI video object: status, progress (0-100), steps_done/steps_total. Raises APIError (404)."""
        return await _mapped(self.videos.get(video_id))

    async def video_content(self, video_id: str) -> bytes:
        """The finished video as MP4 bytes (a ZIP of PNGs if PyAV is missing). Raises APIError (404, 409)."""
        return (await _mapped(self.videos.content(video_id))).data

    # -- HTTP ----------------------------------------------------------------------------

    @api.post("/v1/images/generations")
    async def http_generate(self, request: Request) -> JSONResponse:
        async def handle() -> JSONResponse:
            self._authorize(request)
            payload = await read_json(request, self.config.limits.max_body_bytes)
            return JSONResponse(await self.generate(payload))

        return await self._observed("/v1/images/generations", handle)

    @api.post("/v1/videos")
    async def http_create_video(self, request: Request) -> JSONResponse:
        async def handle() -> JSONResponse:
            self._authorize(request)
            body = await read_body(request, self.config.limits.max_body_bytes)
            # OpenAI's clients send this route multipart/form-data; curl users send JSON.
            payload = await read_form(request, body) if is_form(request) else parse_json(body)
            return JSONResponse(await self.create_video(payload))

        return await self._observed("/v1/videos", handle)

    @api.get("/v1/videos/{video_id}")
    async def http_get_video(self, video_id: str, request: Request) -> JSONResponse:
        async def handle() -> JSONResponse:
            self._authorize(request)
            return JSONResponse(await self.get_video(video_id))

        return await self._observed("/v1/videos/{video_id}", handle)

    @api.get("/v1/videos/{video_id}/content")
    async def http_video_content(self, video_id: str, request: Request, variant: str = "video") -> Response:
        async def handle() -> Response:
            self._authorize(request)
            video = await _mapped(self.videos.content(video_id, variant))
            return Response(video.data, media_type=video.media_type, headers={FORMAT_HEADER: video.format})

        return await self._observed("/v1/videos/{video_id}/content", handle)

    @api.get("/v1/models")
    async def http_models(self, request: Request) -> JSONResponse:
        self._authorize(request)
        data = [{"id": m.name, "object": "model", "created": 0, "owned_by": "stepserve"} for m in self.config.models]
        return JSONResponse({"object": "list", "data": data})

    @api.get("/health")
    async def http_health(self) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @api.get("/ready")
    async def http_ready(self) -> JSONResponse:
        try:
            await asyncio.wait_for(self.router.ready.remote(), timeout=5.0)
        except Exception as exc:
            raise APIError(503, f"not ready: {type(exc).__name__}", code="not_ready") from None
        return JSONResponse({"status": "ready", **await self.router.stats.remote()})

    @api.get("/metrics")
    async def http_metrics(self) -> Response:
        router_text = await self.router.metrics_text.remote()
        return Response(generate_latest(self.http.registry) + router_text, media_type=CONTENT_TYPE_LATEST)

    def _authorize(self, request: Request) -> None:
        if not self.api_keys:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not any(hmac.compare_digest(token, k) for k in self.api_keys):
            raise APIError(401, "missing or invalid API key (Authorization: Bearer <key>)", code="invalid_api_key")

    async def _observed(self, route: str, handle) -> JSONResponse:
        start = time.perf_counter()
        code = 500
        try:
            response = await handle()
            code = response.status_code
            return response
        except APIError as exc:
            code = exc.status
            raise
        finally:
            self.http.requests.labels(route, str(code)).inc()
            self.http.latency.labels(route).observe(time.perf_counter() - start)
