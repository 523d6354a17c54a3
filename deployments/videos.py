"""The `/v1/videos` job API behind the ingress: create, poll, list, cancel, delete, download.

Shared by the HTTP routes and the DeploymentHandle methods of `Ingress`. The job store holds
every job's record (and a finished job's frames) under a TTL and a byte budget; the router
knows a live job's progress. A job's status is the store's once it ended, else the router's:
queued while it waits for a worker, in progress from its first step to its stored result.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections import OrderedDict
from typing import Any

import numpy as np

from stepserve.deployments.config import AppConfig
from stepserve.deployments.edge import AdmissionGate, as_api_error, mapped
from stepserve.deployments.errors import APIError, invalid
from stepserve.deployments.jobs import JobRecord
from stepserve.deployments.video_encoding import EncodedVideo, encode_video, frames_zip
from stepserve.deployments.video_previews import spritesheet, thumbnail
from stepserve.deployments.video_validation import VIDEO_ID, VideoCreateRequest, parse_body, to_video_spec
from stepserve.policies.types import RequestKind, RequestSpec

MAX_PAGE = 100
MAX_WAIT_S = 60.0  # the longest a status request may block for a job to end (`Prefer: wait=N`)
# What GET /v1/videos/{id}/content serves: OpenAI's three, then our `frames`.
VARIANTS = ("video", "thumbnail", "spritesheet", "frames")


class VideoJobs:
    def __init__(self, config: AppConfig, router: Any, store: Any, gate: AdmissionGate, max_files: int = 4):
        self.config = config
        self.router = router
        self.store = store
        self.gate = gate
        self.max_files = max_files
        # Encoded files of the last few completed jobs: a client (or a browser's <video>) may
        # fetch the content more than once, and encoding costs seconds of ingress CPU.
        self._files: OrderedDict[str, EncodedVideo] = OrderedDict()

    # `owner` below: the caller's tenant (`api_access.owner_of`), whose jobs are its own: another
    # tenant's are unknown to it (404). None: every job (no keys, or a trusted handle caller).

    async def create(self, payload: VideoCreateRequest | dict, idempotency_key: str | None = None,
                     owner: str | None = None) -> dict[str, Any]:
        """Queue a job; a retry with the same Idempotency-Key and body returns the same job."""
        req = parse_body(payload, VideoCreateRequest)
        digest = request_digest(req)
        spec = to_video_spec(req, self.config, default_seed=key_seed(idempotency_key))
        rid = spec.request_id
        record = JobRecord(rid, "video", time.time(), spec, idempotency_key=idempotency_key, request_digest=digest,
                           owner=owner)
        # No job before the router is up. One created while a new router starts may be taken up
        # by it (it resumes every unfinished job it finds); this submission then joins it.
        await self.gate.ready(rid)
        record = await mapped(self.store.create.remote(record), rid)  # a retry gets its job back (or a 409)
        if record.job_id != rid:
            return await self._object(record)
        try:
            await self.gate.admit(RequestKind.T2V, rid)
            await self.router.submit_video.remote(spec, self.gate.id)
        except BaseException as exc:
            await self.store.delete.remote(rid)  # never accepted: no trace of it
            raise as_api_error(exc, rid) from None
        return await self._object(record)

    async def get(self, video_id: str, wait_s: float = 0.0, owner: str | None = None) -> dict[str, Any]:
        """The job as it stands; with `wait_s` > 0 (at most MAX_WAIT_S), first wait up to that
        long for it to end, so a client learns of the end at once without polling often."""
        record = await self._record(video_id, owner)
        if wait_s > 0 and not record.terminal:
            record = await self.store.wait.remote(video_id, min(wait_s, MAX_WAIT_S))
            if record is None:  # deleted while we waited
                raise not_found(video_id)
        return await self._object(record)

    async def page(self, after: str | None, limit: int, order: str, owner: str | None = None) -> dict[str, Any]:
        """OpenAI's list shape: newest first by default, `after` a job id cursor."""
        if not 1 <= limit <= MAX_PAGE:
            raise invalid("limit", f"limit must be between 1 and {MAX_PAGE}")
        if order not in ("asc", "desc"):
            raise invalid("order", "order must be 'asc' or 'desc'")
        try:
            records, has_more = await self.store.page.remote(after, limit, order, owner)
        except ValueError:
            raise invalid("after", f"no video {after!r} to list after (unknown or expired)") from None
        data = await asyncio.gather(*(self._object(r) for r in records))
        return {"object": "list", "data": list(data), "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": has_more}

    async def cancel(self, video_id: str, owner: str | None = None) -> dict[str, Any]:
        """Stop a queued or running job at its worker's next step boundary; its record stays (cancelled)."""
        record = await self._record(video_id, owner)
        if record.terminal:
            raise APIError(409, f"video {video_id} already {record.status}; nothing to cancel", param="video_id",
                           code="video_not_cancellable")
        if not await self.router.cancel.remote(video_id):
            await self.store.set_status.remote(video_id, "cancelled")  # the router had already let go of it
        return await self._object(await self._record(video_id, owner))

    async def delete(self, video_id: str, owner: str | None = None) -> dict[str, Any]:
        """Cancel it if it still runs, and forget it (and its file)."""
        record = await self._record(video_id, owner)
        if not record.terminal:
            await self.router.cancel.remote(video_id)
        await self.store.delete.remote(video_id)
        for variant in VARIANTS:
            self._files.pop(f"{video_id}/{variant}", None)
        return {"id": video_id, "object": "video.deleted", "deleted": True}

    async def content(self, video_id: str, variant: str = "video", owner: str | None = None) -> EncodedVideo:
        """variant 'video': the MP4 (OpenAI's default); 'thumbnail' and 'spritesheet': OpenAI's
        preview images (see video_previews); 'frames' (our extension): every frame as a lossless
        PNG in a ZIP, for callers that post-process or compare frames exactly."""
        if variant not in VARIANTS:
            raise invalid("variant", f"variant must be one of {', '.join(map(repr, VARIANTS))}; got {variant!r}",
                          code="unsupported_value")
        record = await self._record(video_id, owner)
        if record.status != "completed":
            raise not_ready(video_id, await self._object(record))
        key = f"{video_id}/{variant}"
        encoded = self._files.get(key)
        if encoded is not None:
            self._files.move_to_end(key)
            return encoded
        frames = await self.store.content.remote(video_id)
        if frames is None:  # evicted between the two calls
            raise not_found(video_id)
        encoded = await asyncio.to_thread(encode_variant, variant, frames, record.spec.fps)
        self._files[key] = encoded
        while len(self._files) > self.max_files:
            self._files.popitem(last=False)
        return encoded

    async def _record(self, video_id: str, owner: str | None) -> JobRecord:
        # Ids this server never hands out are refused without asking the store; another
        # tenant's job is as unknown as one that never was.
        record = await self.store.get.remote(video_id) if VIDEO_ID.match(video_id) else None
        if record is None or owner is not None and record.owner != owner:
            raise not_found(video_id)
        return record

    async def _object(self, record: JobRecord) -> dict[str, Any]:
        progress = None
        if not record.terminal:
            try:
                progress = await self.router.progress.remote(record.job_id)
            except Exception:  # the router is restarting: the record's own status stands
                progress = None
        return video_object(record, progress, self.config.jobs.ttl_s)


def encode_variant(variant: str, frames: np.ndarray, fps: int) -> EncodedVideo:
    """One content variant of a finished video's frames; blocking (callers run it in a thread)."""
    if variant == "thumbnail":
        return thumbnail(frames)
    if variant == "spritesheet":
        return spritesheet(frames)
    if variant == "frames":
        return frames_zip(frames)
    return encode_video(frames, fps)


def video_object(record: JobRecord, progress: dict[str, Any] | None, ttl_s: float) -> dict[str, Any]:
    """OpenAI's video object, plus num_frames, fps, seed, steps_done/steps_total and how the
    scheduler runs it (sp_degree, pauses). `ttl_s` is the job store's (`jobs.ttl_s`)."""
    spec: RequestSpec = record.spec
    status = record.status
    done = spec.steps_to_run if status == "completed" else 0
    sp_degree, pauses = 0, record.pauses
    if progress is not None:
        done, sp_degree, pauses = progress["steps_done"], progress["sp_degree"], progress["pauses"]
        if progress["status"] not in ("queued",):
            status = "in_progress"
    total = spec.steps_to_run
    # Steps are most of the work but not all of it (decoding follows): 100 only when completed.
    percent = 100 if status == "completed" else min(99, 100 * done // total)
    return {
        "id": record.job_id,
        "object": "video",
        "created_at": int(record.created_at),
        "completed_at": None if record.completed_at is None else int(record.completed_at),
        # When the store forgets the job and its content (404 from then on), to the second:
        # ttl_s past its end. The byte budget or the record cap may drop it sooner, so this is
        # the latest it stays, not a promise. None while it runs: nothing of a live job expires.
        "expires_at": None if record.completed_at is None else int(record.completed_at + ttl_s),
        "status": status,
        "model": spec.model,
        "progress": percent,
        "prompt": spec.prompt,
        # The real length of the clip: frames / fps (65 frames at 16 fps is "4.0625").
        "seconds": f"{spec.num_frames / spec.fps:g}",
        "size": f"{spec.width}x{spec.height}",
        "error": record.error,
        "num_frames": spec.num_frames,
        "fps": spec.fps,
        "seed": spec.seed,
        "steps_done": done,
        "steps_total": total,
        # Workers in its SP group now (0 while waiting) and how often it yielded to other work.
        "sp_degree": sp_degree,
        "pauses": pauses,
    }


def request_digest(req: Any) -> str:
    """What identifies a request body for idempotent retries (its fields, not its bytes)."""
    return hashlib.sha256(json.dumps(req.model_dump(), sort_keys=True, default=str).encode()).hexdigest()


def key_seed(idempotency_key: str | None) -> int | None:
    """The seed a retried request without one gets: the same for the same key, so the retry is
    the same request."""
    if idempotency_key is None:
        return None
    return int.from_bytes(hashlib.sha256(idempotency_key.encode()).digest()[:4], "big") >> 1


def not_found(video_id: str) -> APIError:
    return APIError(404, f"video {video_id!r} does not exist (or has expired)", param="video_id",
                    code="video_not_found")


def not_ready(video_id: str, video: dict[str, Any]) -> APIError:
    # 409, not 404: the video exists but its state forbids the download, and a client must be
    # able to tell "poll again" (or "it failed") from "no such video, stop polling".
    if video["status"] in ("failed", "cancelled"):
        message = (video.get("error") or {}).get("message") or video["status"]
        return APIError(409, f"video {video_id} {video['status']} and has no content: {message}",
                        param="video_id", code="video_failed")
    return APIError(409, f"video {video_id} is {video['status']} ({video['steps_done']}/{video['steps_total']} "
                         f"steps); poll GET /v1/videos/{video_id} until status is 'completed'",
                    param="video_id", code="video_not_ready")


def preferred_wait_s(prefer: str | None) -> float:
    """Seconds from an RFC 7240 `Prefer: wait=N` header (0 without one). A preference the
    server cannot honour is ignored, as the RFC says, not refused; N is capped at MAX_WAIT_S."""
    for preference in (prefer or "").split(","):
        name, _, value = preference.partition("=")
        if name.strip().lower() == "wait":
            try:
                seconds = float(value.strip().strip('"'))
            except ValueError:
                return 0.0
            return min(seconds, MAX_WAIT_S) if seconds > 0 and seconds == seconds else 0.0
    return 0.0
