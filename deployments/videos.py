"""The `/v1/videos` job API behind the ingress: create a job, poll it, download the file.

Shared by the HTTP routes and the DeploymentHandle methods of `Ingress`, which map router
exceptions (queue full, duplicate id) to API errors; this module raises `APIError` for the rest.
It talks to the router only through `submit_video`, `video_status` and `video_frames`.

The router's status carries no request fields, so the ingress remembers the spec of each job it
created (bounded, most recent first); a job created through another ingress replica, or
forgotten here, is still served, with `model`, `size`, `seconds`, `prompt` null and the file
encoded at the spec's default frame rate.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import Any

from starlette.datastructures import UploadFile
from starlette.requests import Request

from ..engine.video_sampler import VideoSpec
from .config import AppConfig
from .errors import APIError, invalid
from .video_encoding import EncodedVideo, encode_video, png_zip
from .video_validation import VIDEO_ID, VideoCreateRequest, to_video_spec

logger = logging.getLogger("stepserve.videos")

FORM_TYPES = ("multipart/form-data", "application/x-www-form-urlencoded")
MAX_FORM_FIELDS = 64


class VideoJobs:
    def __init__(self, config: AppConfig, router: Any, max_specs: int = 4096, max_files: int = 4):
        self.config = config
        self.router = router
        self.max_specs = max_specs
        self.max_files = max_files
        self._specs: OrderedDict[str, VideoSpec] = OrderedDict()
        # Encoded files of the last few completed jobs: a client (or a browser's <video>) may
        # fetch the content more than once, and encoding costs seconds of ingress CPU.
        self._files: OrderedDict[str, EncodedVideo] = OrderedDict()

    async def create(self, payload: VideoCreateRequest | dict) -> dict[str, Any]:
        spec = to_video_spec(payload, self.config)
        await self.router.submit_video.remote(spec)  # returns once queued; may raise QueueFullError
        _remember(self._specs, spec.request_id, spec, self.max_specs)
        status = await self.router.video_status.remote(spec.request_id)
        return video_object(spec.request_id, spec, status or _queued(spec))

    async def get(self, video_id: str) -> dict[str, Any]:
        return video_object(video_id, self._specs.get(video_id), await self._status(video_id))

    async def content(self, video_id: str, variant: str = "video") -> EncodedVideo:
        """variant 'video': the MP4 (OpenAI's default); 'frames' (our extension): every frame as
        a lossless PNG in a ZIP, for callers that post-process or compare frames exactly."""
        if variant not in ("video", "frames"):
            raise invalid("variant", f"variant must be 'video' or 'frames', got {variant!r}", code="unsupported_value")
        status = await self._status(video_id)
        if status["status"] != "completed":
            raise not_ready(video_id, status)
        key = f"{video_id}/{variant}"
        encoded = self._files.get(key)
        if encoded is not None:
            self._files.move_to_end(key)
            return encoded
        frames = await self.router.video_frames.remote(video_id)
        if frames is None:  # forgotten by the router between the two calls
            raise not_found(video_id)
        spec = self._specs.get(video_id)
        if spec is None:
            logger.warning("video %s was created elsewhere; encoding at the default %d fps", video_id, VideoSpec.fps)
        fps = spec.fps if spec is not None else VideoSpec.fps
        if variant == "frames":
            encoded = EncodedVideo(await asyncio.to_thread(png_zip, frames), "application/zip", "png-zip", None)
        else:
            encoded = await asyncio.to_thread(encode_video, frames, fps)
        _remember(self._files, key, encoded, self.max_files)
        return encoded

    async def _status(self, video_id: str) -> dict[str, Any]:
        # Ids this server never hands out are refused without asking the router.
        status = await self.router.video_status.remote(video_id) if VIDEO_ID.match(video_id) else None
        if status is None:
            raise not_found(video_id)
        return status


def video_object(video_id: str, spec: VideoSpec | None, status: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's video object, plus num_frames, fps, steps_done, steps_total and seed."""
    done, total = status["steps_done"], status["steps_total"]
    state = status["status"]
    # Steps are most of the work but not all of it (decoding follows): 100 only when completed.
    progress = 100 if state == "completed" else min(99, 100 * done // total) if total else 0
    error = None
    if state == "failed":
        error = {"code": "generation_failed", "message": status.get("error") or "video generation failed"}
    completed_at = status.get("completed_at")
    return {
        "id": video_id,
        "object": "video",
        "created_at": int(status["created_at"]),
        "completed_at": None if completed_at is None else int(completed_at),
        "status": state,
        "model": spec.model if spec else None,
        "progress": progress,
        "prompt": spec.prompt if spec else None,
        # The real length of the clip: frames / fps (65 frames at 16 fps is "4.0625").
        "seconds": f"{spec.num_frames / spec.fps:g}" if spec else None,
        "size": f"{spec.width}x{spec.height}" if spec else None,
        "error": error,
        "num_frames": spec.num_frames if spec else None,
        "fps": spec.fps if spec else None,
        "seed": spec.seed if spec else None,
        "steps_done": done,
        "steps_total": total,
        # How the co-serving scheduler is running it: workers in its SP group now (0 while
        # queued or paused) and how often it was paused for more urgent work.
        "sp_degree": status.get("sp_degree"),
        "pauses": status.get("pauses"),
    }


def not_found(video_id: str) -> APIError:
    return APIError(404, f"video {video_id!r} does not exist (or has expired)", param="video_id",
                    code="video_not_found")


def not_ready(video_id: str, status: dict[str, Any]) -> APIError:
    # 409, not 404: the video exists but its state forbids the download, and a client must be
    # able to tell "poll again" (or "it failed") from "no such video, stop polling".
    if status["status"] == "failed":
        return APIError(409, f"video {video_id} failed and has no content: {status.get('error') or 'unknown error'}",
                        param="video_id", code="video_failed")
    return APIError(409, f"video {video_id} is {status['status']} ({status['steps_done']}/{status['steps_total']} "
                         f"steps); poll GET /v1/videos/{video_id} until status is 'completed'",
                    param="video_id", code="video_not_ready")


async def read_form(request: Request, body: bytes) -> dict[str, str]:
    """A form body (OpenAI's clients send videos.create as multipart/form-data) as a dict of
    strings. `body` was already read under the size limit; the form parser reads it again."""
    async def receive() -> dict[str, Any]:
        nonlocal body
        chunk, body = body, b""
        return {"type": "http.request", "body": chunk, "more_body": False}

    try:
        form = await Request(request.scope, receive).form(max_files=1, max_fields=MAX_FORM_FIELDS)
    except Exception as exc:  # starlette's parser errors are the client's malformed body
        raise invalid(None, f"malformed form body: {exc}", code="invalid_form") from None
    try:
        fields: dict[str, str] = {}
        for key, value in form.multi_items():
            if isinstance(value, UploadFile):
                raise invalid(key, f"{key}: file uploads are not supported", code="unsupported_value")
            if key in fields:
                raise invalid(key, f"{key}: given more than once")
            fields[key] = value
        return fields
    finally:
        await form.close()


def is_form(request: Request) -> bool:
    return request.headers.get("content-type", "").split(";")[0].strip().lower() in FORM_TYPES


def _queued(spec: VideoSpec) -> dict[str, Any]:
    return {"status": "queued", "steps_done": 0, "steps_total": spec.num_inference_steps, "error": None,
            "created_at": time.time(), "completed_at": None}


def _remember(cache: OrderedDict, key: str, value: Any, limit: int) -> None:
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > limit:
        cache.popitem(last=False)
