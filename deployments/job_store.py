"""The job store: the source of truth for video jobs and idempotent image results.

A single-replica Serve deployment of its own, apart from the router, so a router restart loses
no job records and no finished results, and the new router runs the unfinished jobs again from
their last checkpoints (`resume_unfinished`; the router sends each video's checkpoints here). With
`jobs.storage` (disk by default, or Redis) every call's changes are written through before it
returns (`job_journal`), and a restarted store reads them back: its own restart loses nothing
either. Calls run one at a time on the replica's event loop, so the table needs no lock; the
writes go, in call order, to one thread, so a large video's frames do not stall other calls.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import numpy as np

from stepserve.deployments.job_journal import JournalSpec
from stepserve.deployments.jobs import TERMINAL, Checkpoint, JobRecord, JobTable, ResultTooLarge

logger = logging.getLogger("stepserve.job_store")


class JobStore:
    """A `JobTable` on the wall clock, behind async methods a DeploymentHandle calls.

    Raises the job table's errors (`IdempotencyConflict`, `DuplicateJobId`, `JobTableFull`) and
    ValueError for malformed arguments; all pickle through Ray."""

    def __init__(self, ttl_s: float, max_bytes: int, max_jobs: int, journal: JournalSpec | None = None,
                 clock: Callable[[], float] = time.time):
        self.table = JobTable(ttl_s, max_bytes, max_jobs)
        self.clock = clock
        self._ended: dict[str, asyncio.Event] = {}  # job id -> set when it ends (for `wait`)
        self.journal = None if journal is None else journal.open()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="job-journal")  # one: writes stay in order
        if self.journal is not None:
            jobs, images = self.journal.load()
            self.table.restore(jobs, images)
            if jobs or images:
                logger.warning("job store: %d jobs and %d image responses read back from %s", len(jobs),
                               len(images), journal.kind)

    async def _written(self, value: Any = None) -> Any:
        """Write what the call changed through to the journal, then return `value`."""
        changes = self.table.take_changes()
        if changes and self.journal is not None:
            await asyncio.get_running_loop().run_in_executor(self._writer, self.journal.write, changes)
        return value

    async def create(self, record: JobRecord) -> JobRecord:
        """The new job, or the existing one when this is an idempotent retry (compare job ids)."""
        return await self._written(self.table.create(record, self.clock()))

    async def resume_unfinished(self, max_resumes: int, message: str) -> list[tuple[JobRecord, Checkpoint | None]]:
        """The jobs still queued or running, for a router that starts up to run again (what an
        earlier router ran is gone with its workers), each from its last checkpoint (None: from
        the start); those it has resumed `max_resumes` times already fail with `message` (code
        `interrupted`)."""
        resumed, failed = self.table.resume_unfinished(max_resumes, {"code": "interrupted", "message": message},
                                                       self.clock())
        for job_id in failed:
            self._wake(job_id)
        if resumed:
            logger.warning("%d video jobs resume after a router restart: %s", len(resumed),
                           [(r.job_id, r.resumed_from_step) for r, _ in resumed])
        if failed:
            logger.warning("%d video jobs failed after %d router restarts: %s", len(failed), max_resumes, failed)
        return await self._written(resumed)

    async def checkpoint(self, job_id: str, steps: int, state: dict[str, Any], degrees: tuple[int, ...]) -> bool:
        """Keep a running video's state after `steps` steps (the router sends each checkpoint it
        adopts), so a router restart resumes it from there. False when it is not newer, or the
        job is unknown or ended."""
        return await self._written(self.table.checkpoint(job_id, Checkpoint(steps, state, tuple(degrees))))

    async def get(self, job_id: str) -> JobRecord | None:
        return await self._written(self.table.get(job_id, self.clock()))

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
        return await self._written(self.table.get(job_id, self.clock()))

    async def set_status(self, job_id: str, status: str, error: dict[str, str] | None = None) -> bool:
        changed = self.table.update_status(job_id, status, self.clock(), error)
        if changed and status in TERMINAL:
            self._wake(job_id)
        return await self._written(changed)

    def _wake(self, job_id: str) -> None:
        ended = self._ended.pop(job_id, None)
        if ended is not None:
            ended.set()

    async def complete(self, job_id: str, frames: np.ndarray, pauses: int = 0,
                       sp_degrees: tuple[int, ...] = ()) -> bool:
        """Keep a finished video's frames (uint8 [F, H, W, 3]) and mark it completed, with how it
        ran (`pauses`, the SP degree of every step); True also when it already is (a call made
        again). False when the job is unknown or ended otherwise, or when the frames exceed the
        byte budget: the job is then marked failed, saying so."""
        if not (isinstance(frames, np.ndarray) and frames.dtype == np.uint8 and frames.ndim == 4
                and frames.shape[-1] == 3):
            raise ValueError(f"frames must be a uint8 array [F, H, W, 3], got {type(frames).__name__} "
                             f"{getattr(frames, 'dtype', '')} {getattr(frames, 'shape', '')}")
        # Own the bytes: an argument Ray resolved from an ObjectRef is a zero-copy view into the
        # object store, owned by the router, and outliving the router is this store's purpose.
        owned = frames.copy()
        owned.setflags(write=False)
        try:
            stored = self.table.complete(job_id, owned, owned.nbytes, self.clock(), pauses=pauses,
                                         sp_degrees=tuple(sp_degrees))
        except ResultTooLarge as exc:
            logger.warning("video %s failed: %s", job_id, exc)
            error = {"code": "result_too_large",
                     "message": f"the finished video is too large to keep for download: {exc}"}
            self.table.update_status(job_id, "failed", self.clock(), error)
            stored = False
        await self._written()  # before a waiter hears of it: what it then reads survives a restart
        self._wake(job_id)
        if not stored:  # a call made again (the store restarted under the first) finds it done
            record = self.table.get(job_id, self.clock())
            return record is not None and record.status == "completed"
        return stored

    async def content(self, job_id: str) -> np.ndarray | None:
        """A completed job's frames; None for any other job or an unknown id."""
        return await self._written(self.table.result(job_id, self.clock()))

    async def delete(self, job_id: str) -> JobRecord | None:
        self._wake(job_id)  # a waiter then finds it gone
        return await self._written(self.table.delete(job_id))

    async def page(self, after: str | None = None, limit: int = 20, order: Literal["asc", "desc"] = "desc",
                   owner: str | None = None) -> tuple[list[JobRecord], bool]:
        """Jobs in creation order after the cursor `after`, and whether more follow (OpenAI's list
        defaults: newest first, 20 a page); with an `owner`, that tenant's only. ValueError for an
        unknown cursor."""
        return await self._written(self.table.page(after, limit, order, self.clock(), owner))

    async def remember_image(self, key: str, digest: str, body: Any) -> bool:
        """Keep an image response (bytes or a JSON-like dict) for retries under `key`; False if
        the same request was already remembered."""
        return await self._written(self.table.remember_image(key, digest, body, _size(body), self.clock()))

    async def image_for(self, key: str, digest: str) -> Any:
        return await self._written(self.table.image_for(key, digest, self.clock()))

    async def stats(self) -> dict[str, Any]:
        table = self.table
        table.expire(self.clock())
        await self._written()
        return {"jobs": dict(table.counts), "images": table.images, "bytes_stored": table.bytes_stored,
                "max_bytes": table.max_bytes, "evictions": table.evictions}


def _size(body: Any) -> int:
    """Bytes a body takes: its buffer's size, or, for other objects, the size of the pickle Ray
    would ship (close to the memory held by a dict of base64 strings)."""
    try:
        return memoryview(body).nbytes
    except TypeError:
        return len(pickle.dumps(body, protocol=pickle.HIGHEST_PROTOCOL))
