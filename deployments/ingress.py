"""The HTTP/handle ingress: validates, fans a request out to the router, decodes, answers.

Routes: POST /v1/images/generations, GET /v1/models, GET /health, GET /ready, GET /metrics.
Handle callers use `generate(request)` and `progress(request_id)` with the same types.
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
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise APIError(413, f"request body exceeds {limit} bytes", code="request_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"request body exceeds {limit} bytes", code="request_too_large")
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

    # -- HTTP ----------------------------------------------------------------------------

    @api.post("/v1/images/generations")
    async def http_generate(self, request: Request) -> JSONResponse:
        async def handle() -> JSONResponse:
            self._authorize(request)
            payload = await read_json(request, self.config.limits.max_body_bytes)
            return JSONResponse(await self.generate(payload))

        return await self._observed("/v1/images/generations", handle)

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
