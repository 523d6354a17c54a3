"""The job store: the source of truth for video jobs and idempotent image results.

A single-replica Serve deployment of its own, apart from the router, so a router restart loses
no job records and no finished results, and the new router runs the unfinished jobs again
(`resume_unfinished`). It keeps everything in its own process memory: its own restart still
loses them. Calls are short and run one at a time on the replica's event loop, so the table
needs no lock.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import time
from collections.abc import Callable
from typing import Any, Literal

import numpy as np

from stepserve.deployments.jobs import TERMINAL, JobRecord, JobTable, ResultTooLarge

logger = logging.getLogger("stepserve.job_store")


class JobStore:
    """A `JobTable` on the wall clock, behind async methods a DeploymentHandle calls.

    Raises the job table's errors (`IdempotencyConflict`, `DuplicateJobId`, `JobTableFull`) and
    ValueError for malformed arguments; all pickle through Ray."""

    def __init__(self, ttl_s: float, max_bytes: int, max_jobs: int, clock: Callable[[], float] = time.time):
        self.table = JobTable(ttl_s, max_bytes, max_jobs)
        self.clock = clock
        self._ended: dict[str, asyncio.Event] = {}  # job id -> set when it ends (for `wait`)

    async def create(self, record: JobRecord) -> JobRecord:
        """The new job, or the existing one when this is an idempotent retry (compare job ids)."""
        return self.table.create(record, self.clock())

    async def resume_unfinished(self, max_resumes: int, message: str) -> list[JobRecord]:
        """The jobs still queued or running, for a router that starts up to run again from the
        start (what an earlier router ran is gone with its workers); those it has resumed
        `max_resumes` times already fail with `message` (code `interrupted`)."""
        resumed, failed = self.table.resume_unfinished(max_resumes, {"code": "interrupted", "message": message},
                                                       self.clock())
        for job_id in failed:
            self._wake(job_id)
        if resumed:
            logger.warning("%d video jobs resume after a router restart: %s", len(resumed), [r.job_id for r in resumed])
        if failed:
            logger.warning("%d video jobs failed after %d router restarts: %s", len(failed), max_resumes, failed)
        return resumed

    async def get(self, job_id: str) -> JobRecord | None:
        return self.table.get(job_id, self.clock())

    async def wait(self, job_id: str, timeout_s: float) -> JobRecord | None:
        """The job once it has ended, or as it stands after `timeout_s`: a long poll, so a
        client learns of the end when it happens without polling often. None if unknown."""
        record = self.table.get(job_id, self.clock())
        if record is None or record.terminal or timeout_s <= 0:
            return record
        ended = self._ended.setdefault(job_id, asyncio.Event())
        try:
            await asyncio.wait_for(ended.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass
        return self.table.get(job_id, self.clock())

    async def set_status(self, job_id: str, status: str, error: dict[str, str] | None = None) -> bool:
        changed = self.table.update_status(job_id, status, self.clock(), error)
        if changed and status in TERMINAL:
            self._wake(job_id)
        return changed

    def _wake(self, job_id: str) -> None:
        ended = self._ended.pop(job_id, None)
        if ended is not None:
            ended.set()

    async def complete(self, job_id: str, frames: np.ndarray, pauses: int = 0,
                       sp_degrees: tuple[int, ...] = ()) -> bool:
        """Keep a finished video's frames (uint8 [F, H, W, 3]) and mark it completed, with how it
        ran (`pauses`, the SP degree of every step). False when the job is unknown or already
        ended, or when the frames exceed the byte budget: the job is then marked failed, saying so."""
        if not (isinstance(frames, np.ndarray) and frames.dtype == np.uint8 and frames.ndim == 4
                and frames.shape[-1] == 3):
            raise ValueError(f"frames must be a uint8 array [F, H, W, 3], got {type(frames).__name__} "
                             f"{getattr(frames, 'dtype', '')} {getattr(frames, 'shape', '')}")
        # Own the bytes: an argument Ray resolved from an ObjectRef is a zero-copy view into the
        # object store, owned by the router, and outliving the router is this store's purpose.
        owned = frames.copy()
        owned.setflags(write=False)
        try:
            return self.table.complete(job_id, owned, owned.nbytes, self.clock(), pauses=pauses,
                                       sp_degrees=tuple(sp_degrees))
        except ResultTooLarge as exc:
            logger.warning("video %s failed: %s", job_id, exc)
            error = {"code": "result_too_large",
                     "message": f"the finished video is too large to keep for download: {exc}"}
            self.table.update_status(job_id, "failed", self.clock(), error)
            return False
        finally:
            self._wake(job_id)

    async def content(self, job_id: str) -> np.ndarray | None:
        """A completed job's frames; None for any other job or an unknown id."""
        return self.table.result(job_id, self.clock())

    async def delete(self, job_id: str) -> JobRecord | None:
        self._wake(job_id)  # a waiter then finds it gone
        return self.table.delete(job_id)

    async def page(self, after: str | None = None, limit: int = 20, order: Literal["asc", "desc"] = "desc",
                   owner: str | None = None) -> tuple[list[JobRecord], bool]:
        """Jobs in creation order after the cursor `after`, and whether more follow (OpenAI's list
        defaults: newest first, 20 a page); with an `owner`, that tenant's only. ValueError for an
        unknown cursor."""
        return self.table.page(after, limit, order, self.clock(), owner)

    async def remember_image(self, key: str, digest: str, body: Any) -> bool:
        """Keep an image response (bytes or a JSON-like dict) for retries under `key`; False if
        the same request was already remembered."""
        return self.table.remember_image(key, digest, body, _size(body), self.clock())

    async def image_for(self, key: str, digest: str) -> Any:
        return self.table.image_for(key, digest, self.clock())

    async def stats(self) -> dict[str, Any]:
        table = self.table
        table.expire(self.clock())
        return {"jobs": dict(table.counts), "images": table.images, "bytes_stored": table.bytes_stored,
                "max_bytes": table.max_bytes, "evictions": table.evictions}


def _size(body: Any) -> int:
    """Bytes a body takes: its buffer's size, or, for other objects, the size of the pickle Ray
    would ship (close to the memory held by a dict of base64 strings)."""
    try:
        return memoryview(body).nbytes
    except TypeError:
        return len(pickle.dumps(body, protocol=pickle.HIGHEST_PROTOCOL))
