"""The HTTP/handle ingress: authenticates, reads and validates requests, admits them at the edge,
and hands them to the images and video-jobs services.

Routes: POST /v1/images/generations, POST /v1/images/edits; POST /v1/videos, GET /v1/videos (list), GET/DELETE
/v1/videos/{id}, POST /v1/videos/{id}/cancel, GET /v1/videos/{id}/content; GET /v1/models,
/health, /ready, /metrics, /docs, /openapi.json. Handle callers use the methods below with the
same request types. With API keys set, every route but /health needs one (`ingress.open_docs`
opens /docs and /openapi.json), and so does any other path: a client without a key learns
nothing, not even which paths exist. Each key is a tenant: its video jobs, Idempotency-Keys and
edit templates are its own (handle callers, trusted code in the cluster, act for every tenant;
without keys there is one). Every error is the OpenAI error shape with an
`x-request-id` header (and `retry-after` on 429 and 503); a 500 body names the request id and
nothing else (the details go to the log).
"""

# No `from __future__ import annotations` here: FastAPI must see real annotations on the route
# methods that `serve.ingress` wraps, or it mistakes `request: Request` for a query parameter.

import asyncio
import json
import logging
import re
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from ray import serve
from starlette.routing import Match

from stepserve.actors.replica_metrics import snapshot
from stepserve.deployments.api_access import ApiAccess
from stepserve.deployments.config import AppConfig, ModelConfig
from stepserve.deployments.edge import AdmissionGate, as_api_error, mapped
from stepserve.deployments.errors import APIError, invalid, server_error
from stepserve.deployments.forms import is_form, read_form
from stepserve.deployments.image_hints import hints_counter
from stepserve.deployments.image_inputs import EDIT_FILE_PARTS, control_image_parts, edit_payload, generation_payload
from stepserve.deployments.images import ImageRequests, request_id_for
from stepserve.deployments.protocol import ImageEditRequest, ImageGenerationRequest
from stepserve.deployments.video_encoding import FORMAT_HEADER
from stepserve.deployments.video_validation import VideoCreateRequest
from stepserve.deployments.videos import VideoJobs, preferred_wait_s
from stepserve.engine.families import family_class
from stepserve.policies.types import RequestKind

logger = logging.getLogger("stepserve.ingress")
# A client's x-request-id we repeat (in the error body, its header, the logs): a plain token.
REQUEST_ID = re.compile(r"[A-Za-z0-9._:+=/-]{1,128}")
# How soon a replica's counts reach the router after they change (`HTTPMetrics`).
PUSH_DELAY_S = 1.0

READY_TIMEOUT_S = 5.0
IDEMPOTENCY_HEADER = "idempotency-key"
MAX_IDEMPOTENCY_KEY = 256

# FastAPI's own /docs, /redoc and /openapi.json would answer anyone: the ingress serves the first
# and last itself, behind its keys.
api = FastAPI(title="stepserve", description="Diffusion serving scheduled by the denoising step.", docs_url=None,
              redoc_url=None, openapi_url=None)
ALL_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


@api.exception_handler(APIError)
async def _on_api_error(_: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())


@api.exception_handler(RequestValidationError)
async def _on_bad_parameter(_: Request, exc: RequestValidationError) -> JSONResponse:
    # FastAPI's own 422 for a query parameter of the wrong type, in the OpenAI shape instead.
    first = exc.errors()[0]
    param = str(first["loc"][-1]) if first.get("loc") else None
    error = invalid(param, f"{param}: {first['msg']}")
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers())


@api.exception_handler(Exception)
async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    error = server_error(request_id_of(request))
    logger.error("unhandled error (request id %s)", error.request_id, exc_info=exc)
    return JSONResponse(error.body(), status_code=500, headers=error.headers())


def request_id_of(request: Request) -> str:
    """The id an HTTP request goes by in its error and in the logs: its `x-request-id` when that
    is a sane token (a client's, which Serve's proxy passes on, or the one the proxy made, which
    Serve's replicas put on their log lines of the request), else a fresh one."""
    given = request.headers.get("x-request-id", "")
    return given if REQUEST_ID.fullmatch(given) else f"req-{uuid.uuid4().hex}"


def api_routes(router: Any = api) -> list[APIRoute]:
    """Every endpoint the app serves (Serve's ingress nests the class's routes in an included router)."""
    routes: list[APIRoute] = []
    for route in router.routes:
        inner = getattr(route, "original_router", None)
        if inner is not None:
            routes += api_routes(inner)
        elif isinstance(route, APIRoute):
            routes.append(route)
    return routes


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


def scoped(key: str | None, owner: str | None) -> str | None:
    """An Idempotency-Key as its tenant's own: two tenants' equal keys never meet."""
    return key if key is None or owner is None else f"{owner}/{key}"


def idempotency_key(request: Request) -> str | None:
    key = request.headers.get(IDEMPOTENCY_HEADER)
    if key is None:
        return None
    if not key.strip() or len(key) > MAX_IDEMPOTENCY_KEY:
        raise invalid("Idempotency-Key", f"Idempotency-Key must be 1 to {MAX_IDEMPOTENCY_KEY} characters")
    return key


def model_entry(config: AppConfig, model: ModelConfig) -> dict[str, Any]:
    """A model as GET /v1/models lists it; with the ControlNets and LoRAs served for it where its
    family takes them."""
    entry = {"id": model.name, "object": "model", "created": 0, "owned_by": "stepserve", "kind": model.kind.value}
    if family_class(model.family).takes_addons:
        entry["controlnets"] = [a.name for a in config.controlnets if a.model == model.name]
        entry["loras"] = [a.name for a in config.loras if a.model == model.name]
    return entry


class HTTPMetrics:
    """This replica's HTTP metrics. The router publishes every ingress replica's, summed
    (`actors.replica_metrics`): a change reaches it within `PUSH_DELAY_S`, and a scrape of
    `/metrics` pushes first, so it sees its own replica's counts up to its own request."""

    def __init__(self, router: Any) -> None:
        self.router = router
        self.replica = uuid.uuid4().hex  # (a restarted replica is another: its counts start anew)
        self._sequence = 0
        self._pending: asyncio.Task | None = None
        self.registry = CollectorRegistry()
        self.requests = Counter("stepserve_http_requests", "HTTP requests by route and status code.",
                                ["route", "code"], registry=self.registry)
        # By status code too: a 429 is answered in milliseconds and a 200 in seconds, and an
        # operator must see each (how fast the edge sheds a burst, for one).
        self.latency = Histogram("stepserve_http_latency_seconds", "HTTP request latency in the ingress (from its "
                                 "handler's start: the body read included, the proxy before it not) by route and "
                                 "status code.", ["route", "code"],
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100),
                                 registry=self.registry)
        self.image_stage = Histogram(
            "stepserve_ingress_stage_seconds",
            "An image request's time in the ingress: validate (parse, checks, admission gate), router (the "
            "router call: text encoding to decoded PNG, plus the hops), respond (building the response body).",
            ["stage"], buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25),
            registry=self.registry)
        self.image_hints = hints_counter(self.registry)

    def changed(self) -> None:
        """Something was counted: push within `PUSH_DELAY_S` (one push carries every change before it)."""
        if self._pending is None:
            self._pending = asyncio.get_running_loop().create_task(self._push_soon())

    async def _push_soon(self) -> None:
        await asyncio.sleep(PUSH_DELAY_S)
        self._pending = None  # what is counted from here on takes the next push
        await self.push()

    async def push(self) -> None:
        self._sequence += 1
        try:
            await self.router.ingress_metrics.remote(self.replica, self._sequence, snapshot(self.registry))
        except Exception as exc:  # a lost push costs nothing: the next carries the same counts and more
            logger.warning("could not push this ingress replica's metrics to the router: %s", exc)


@serve.ingress(api)
class Ingress:
    def __init__(self, config: AppConfig, router: Any, store: Any, text_encoder: Any | None,
                 access: ApiAccess | None = None):
        """`access`: the digests of the API keys, made where the app was built (`build_app`);
        None: made here, from this process's environment."""
        self.config = config
        self.router = router
        self.text_encoder = text_encoder
        self.access = ApiAccess.of(config) if access is None else access
        if config.api_keys_env and not self.access.keys:
            raise RuntimeError(f"{config.api_keys_env} held no API keys where the app was built: refusing to serve "
                               "openly")
        self.http = HTTPMetrics(router)
        self.gate = AdmissionGate(router)
        self.images = ImageRequests(config, router, store, self.gate, self.http.image_stage, self.http.image_hints)
        self.videos = VideoJobs(config, router, store, self.gate)

    # -- handle API ----------------------------------------------------------------------

    async def generate(self, request: ImageGenerationRequest | dict, request_id: str | None = None) -> dict:
        """Generate images; returns the OpenAI images response body. `request_id`: a client id
        that makes retries idempotent and names the request for `progress`/`cancel`."""
        try:
            return await self.images.generate(request, request_id)
        finally:
            self.http.changed()  # its stages and hints

    async def edit(self, request: ImageEditRequest | dict, request_id: str | None = None) -> dict:
        """Edit an image under a mask (POST /v1/images/edits); as `generate` otherwise."""
        try:
            return await self.images.edit(request, request_id)
        finally:
            self.http.changed()

    async def progress(self, request_id: str) -> dict | None:
        """{status, steps_done, steps_total, ...} of the request `generate` got this id for."""
        return await self.router.progress.remote(request_id_for(request_id))

    async def cancel(self, request_id: str) -> bool:
        rid = request_id_for(request_id)
        siblings = [rid] + [f"{rid}-{i}" for i in range(self.config.limits.max_n)]
        return any(await asyncio.gather(*(self.router.cancel.remote(r) for r in siblings)))

    async def create_video(self, request: VideoCreateRequest | dict, idempotency_key: str | None = None) -> dict:
        """Queue a video job; returns the OpenAI video object at once (poll `get_video`)."""
        return await self.videos.create(request, idempotency_key)

    async def get_video(self, video_id: str, wait_s: float = 0.0) -> dict:
        """The job; with `wait_s` > 0, after waiting up to that long (max 60 s) for it to end."""
        return await self.videos.get(video_id, wait_s)

    async def list_videos(self, after: str | None = None, limit: int = 20, order: str = "desc") -> dict:
        return await self.videos.page(after, limit, order)

    async def cancel_video(self, video_id: str) -> dict:
        return await self.videos.cancel(video_id)

    async def delete_video(self, video_id: str) -> dict:
        return await self.videos.delete(video_id)

    async def video_content(self, video_id: str, variant: str = "video") -> bytes:
        """The finished video's content: variant 'video' (MP4, or a ZIP of PNGs if PyAV is missing),
        'thumbnail' (WebP), 'spritesheet' (JPEG) or 'frames' (a ZIP of PNGs)."""
        return (await self.videos.content(video_id, variant)).data

    # -- HTTP ----------------------------------------------------------------------------

    @api.post("/v1/images/generations")
    async def http_generate(self, request: Request) -> Response:
        async def handle() -> Response:
            key = scoped(idempotency_key(request), self._authorize(request))
            self._shed(RequestKind.T2I, key, request)
            body = await read_body(request, self.config.limits.max_body_bytes)
            if is_form(request):  # control images uploaded as files, not base64
                limits = self.config.limits
                form = await read_form(request, body, control_image_parts(limits.max_controlnets),
                                       max_files=limits.max_controlnets)
                payload = generation_payload(form)
            else:
                payload = parse_json(body)
            return JSONResponse(await self.generate(payload, key))

        return await self._observed("/v1/images/generations", request, handle)

    @api.post("/v1/images/edits")
    async def http_edit(self, request: Request) -> Response:
        async def handle() -> Response:
            owner = self._authorize(request)
            key = scoped(idempotency_key(request), owner)
            self._shed(RequestKind.EDIT.lane, key, request)
            body = await read_body(request, self.config.limits.max_body_bytes)
            if is_form(request):  # OpenAI's clients: the image and mask as file parts
                payload = edit_payload(await read_form(request, body, EDIT_FILE_PARTS, max_files=len(EDIT_FILE_PARTS)))
            else:
                payload = parse_json(body)
            return JSONResponse(await self.images.edit(payload, key, owner))

        return await self._observed("/v1/images/edits", request, handle)

    @api.post("/v1/videos")
    async def http_create_video(self, request: Request) -> Response:
        async def handle() -> Response:
            owner = self._authorize(request)
            key = scoped(idempotency_key(request), owner)
            self._shed(RequestKind.T2V, key, request)
            body = await read_body(request, self.config.limits.max_body_bytes)
            # OpenAI's clients send this route multipart/form-data; curl users send JSON.
            payload = (await read_form(request, body)).fields if is_form(request) else parse_json(body)
            return JSONResponse(await self.videos.create(payload, key, owner))

        return await self._observed("/v1/videos", request, handle)

    @api.get("/v1/videos")
    async def http_list_videos(self, request: Request, after: str | None = None, limit: int = 20,
                               order: str = "desc") -> Response:
        async def handle() -> Response:
            return JSONResponse(await self.videos.page(after, limit, order, self._authorize(request)))

        return await self._observed("/v1/videos:list", request, handle)

    @api.get("/v1/videos/{video_id}")
    async def http_get_video(self, video_id: str, request: Request) -> Response:
        async def handle() -> Response:
            owner = self._authorize(request)
            wait_s = preferred_wait_s(request.headers.get("prefer"))
            headers = {"Preference-Applied": f"wait={wait_s:g}"} if wait_s else None
            return JSONResponse(await self.videos.get(video_id, wait_s, owner), headers=headers)

        return await self._observed("/v1/videos/{video_id}", request, handle)

    @api.delete("/v1/videos/{video_id}")
    async def http_delete_video(self, video_id: str, request: Request) -> Response:
        async def handle() -> Response:
            return JSONResponse(await self.videos.delete(video_id, self._authorize(request)))

        return await self._observed("/v1/videos/{video_id}:delete", request, handle)

    @api.post("/v1/videos/{video_id}/cancel")
    async def http_cancel_video(self, video_id: str, request: Request) -> Response:
        async def handle() -> Response:
            return JSONResponse(await self.videos.cancel(video_id, self._authorize(request)))

        return await self._observed("/v1/videos/{video_id}/cancel", request, handle)

    @api.get("/v1/videos/{video_id}/content")
    async def http_video_content(self, video_id: str, request: Request, variant: str = "video") -> Response:
        async def handle() -> Response:
            video = await self.videos.content(video_id, variant, self._authorize(request))
            return Response(video.data, media_type=video.media_type, headers={FORMAT_HEADER: video.format})

        return await self._observed("/v1/videos/{video_id}/content", request, handle)

    @api.get("/v1/models")
    async def http_models(self, request: Request) -> Response:
        async def handle() -> Response:
            self._authorize(request)
            return JSONResponse({"object": "list", "data": [model_entry(self.config, m) for m in self.config.models]})

        return await self._observed("/v1/models", request, handle)

    @api.get("/health")
    async def http_health(self) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @api.get("/ready")
    async def http_ready(self, request: Request) -> Response:
        """200 while at least one denoiser worker serves and the text encoder (if any) answers."""
        async def handle() -> Response:
            self._authorize(request)
            rid = request_id_of(request)
            try:
                calls = [self.router.readiness.remote()]
                if self.text_encoder is not None:  # None: the workers encode prompts
                    calls.append(self.text_encoder.ready.remote())
                state, *_ = await asyncio.wait_for(asyncio.gather(*calls), READY_TIMEOUT_S)
            except Exception as exc:
                logger.warning("not ready: %r", exc)
                raise server_error(rid, "not_ready", "not ready", status=503, retry_after_s=1.0) from None
            if state["live_workers"] < 1:
                raise server_error(rid, "not_ready", "no denoiser worker is serving", status=503, retry_after_s=1.0)
            return JSONResponse({"status": "ready", **state})

        return await self._observed("/ready", request, handle)

    @api.get("/metrics")
    async def http_metrics(self, request: Request) -> Response:
        self._authorize(request, metrics=True)
        await self.http.push()
        text = await mapped(self.router.metrics_text.remote(), request_id_of(request))
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @api.get("/openapi.json")
    async def http_openapi(self, request: Request) -> Response:
        if not self.config.ingress.open_docs:
            self._authorize(request)
        return JSONResponse(api.openapi())

    @api.get("/docs")
    async def http_docs(self, request: Request) -> HTMLResponse:
        if not self.config.ingress.open_docs:
            self._authorize(request)
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(openapi_url=f"{root}/openapi.json", title="stepserve API")

    # Last: only a path no route above matches comes here.
    @api.api_route("/{path:path}", methods=ALL_METHODS)
    async def http_unknown(self, request: Request, path: str) -> Response:
        self._authorize(request)
        # A known path with another method matches a route above partly: 405, as OpenAI answers.
        if any(route.matches(request.scope)[0] is Match.PARTIAL for route in api_routes()):
            raise APIError(405, f"{request.method} is not allowed on /{path}", code="method_not_allowed")
        raise APIError(404, f"Invalid URL ({request.method} /{path})", code="unknown_url")

    def _shed(self, kind: RequestKind, idempotency_key: str | None, request: Request) -> None:
        """Under overload, refuse before the body is read (`AdmissionGate.shed`). Not a retry with
        an Idempotency-Key: its answer may be stored already, and costs nothing to give."""
        if idempotency_key is None:
            self.gate.shed(kind, request_id_of(request))

    def _authorize(self, request: Request, metrics: bool = False) -> str | None:
        """The caller's tenant, or None when no key is asked for; 401 without a valid key
        (`ApiAccess.owner`)."""
        return self.access.owner(request.headers.get("authorization", ""), metrics)

    async def _observed(self, route: str, request: Request, handle) -> Response:
        start = time.perf_counter()
        code = 500
        try:
            response = await handle()
            code = response.status_code
            return response
        except APIError as exc:
            code = exc.status
            raise
        except Exception as exc:
            error = as_api_error(exc, request_id_of(request))
            code = getattr(error, "status", 500)
            raise error from None
        finally:
            self.http.requests.labels(route, str(code)).inc()
            self.http.latency.labels(route, str(code)).observe(time.perf_counter() - start)
            self.http.changed()
