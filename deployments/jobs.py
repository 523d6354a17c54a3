"""The job table: video job records, their results and idempotent image results, bounded.

Pure Python (no Ray, no clock: `now` is an argument) so `JobStore` and the tests share it.
Terminal jobs (completed, failed, cancelled) live `ttl_s` past their completion and within a
byte budget for results and a cap on records; jobs still queued or running are never evicted.
Eviction is always the oldest retired entries first, so what a client can still see is one
contiguous, recent stretch of history. Expiry runs lazily at the start of each call, popping
from the front of FIFOs, so every call costs O(1) amortised plus what it evicts or returns.

Retirement order is the order calls arrive in, and TTL expiry trusts it to match `now`: if the
wall clock steps back, entries retired after the step wait for the ones before it (they are
evicted late, never early).

The table notes what each call changed (`take_changes`), so a store can write just that through
to durable storage (`job_journal`), and `restore` builds the same table again from what was
written.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

STATUSES = ("queued", "in_progress", "completed", "failed", "cancelled")
TERMINAL = frozenset({"completed", "failed", "cancelled"})


class JobError(Exception):
    """Base of the errors the job table raises; one message argument, so they pickle through Ray."""


class IdempotencyConflict(JobError):
    """An idempotency key was reused for a different request (another request digest)."""


class DuplicateJobId(JobError):
    """A job id that is already in the table, without an idempotent retry to explain it."""


class JobTableFull(JobError):
    """Every record slot holds a job still queued or running: nothing may be evicted for a new one."""


class ResultTooLarge(JobError):
    """One result is larger than the whole byte budget, so it can never be kept."""


@dataclass(frozen=True)
class JobRecord:
    """One job as clients see it, minus its result: what it asked for and where it stands."""

    job_id: str
    kind: str
    created_at: float  # wall-clock seconds
    spec: Any  # the request spec, stored as given
    status: str = "queued"
    completed_at: float | None = None
    error: dict[str, str] | None = None  # {"code", "message"}
    idempotency_key: str | None = None
    request_digest: str | None = None
    result_bytes: int = 0
    # How the scheduler ran it, recorded when it completed: times its state left its workers
    # (paused or moved), and the SP degree of every step.
    pauses: int = 0
    sp_degrees: tuple[int, ...] = ()
    owner: str | None = None  # the tenant that made it (a digest of its API key); None: everyone's
    resumes: int = 0  # times a starting router took it up again (a router restart)
    resumed_from_step: int = 0  # the step its last resume started from (its checkpoint's; 0: the start)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"unknown job status {self.status!r}; one of {STATUSES}")

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL


@dataclass(frozen=True)
class Checkpoint:
    """A running job's state as of a step: what a router restart resumes it from."""

    steps: int  # steps done
    state: Any  # the sampler's exported state (host memory)
    degrees: tuple[int, ...]  # the SP degree of each of those steps


@dataclass(slots=True)
class _Entry:
    record: JobRecord
    result: Any = None
    checkpoint: Checkpoint | None = None  # while it runs
    order: int = 0  # its place in creation order (what `restore` sorts by)
    # Neighbours in creation order: a linked list makes `page` O(limit) from any cursor.
    prev: str | None = None
    next: str | None = None


@dataclass(frozen=True)
class StoredJob:
    """One job as durable storage keeps it (`take_changes`, `restore`)."""

    record: JobRecord
    result: Any
    checkpoint: Checkpoint | None
    order: int
    retired: int | None  # its retirement sequence number; None: live


@dataclass(frozen=True, slots=True)
class StoredImage:
    """A remembered image response, in the table and as durable storage keeps it."""

    key: str  # its idempotency key
    digest: str
    body: Any
    nbytes: int
    stored_at: float
    seq: int


@dataclass(frozen=True)
class Changes:
    """What calls changed since the last `take_changes`: jobs and images to write, and to remove."""

    jobs: tuple[StoredJob, ...] = ()
    removed_jobs: tuple[str, ...] = ()
    images: tuple[StoredImage, ...] = ()
    removed_images: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.jobs or self.removed_jobs or self.images or self.removed_images)


class JobTable:
    """Job records in creation order, results of completed jobs, and remembered image results,
    under a TTL, a byte budget (results and images together) and a cap on job records."""

    def __init__(self, ttl_s: float, max_bytes: int, max_jobs: int):
        if ttl_s < 0 or max_bytes < 0 or max_jobs < 1:
            raise ValueError(f"need ttl_s >= 0, max_bytes >= 0, max_jobs >= 1; got {ttl_s}, {max_bytes}, {max_jobs}")
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.max_jobs = max_jobs
        self._entries: dict[str, _Entry] = {}
        self._first: str | None = None
        self._last: str | None = None
        self._by_key: dict[str, str] = {}  # idempotency key -> job id
        # Terminal job ids and remembered images, each oldest first, valued by a retirement
        # sequence number shared by both: byte-budget eviction takes the older of the two heads.
        self._retired: OrderedDict[str, int] = OrderedDict()
        self._images: OrderedDict[str, StoredImage] = OrderedDict()
        self._seq = 0
        self._order = 0
        self.bytes_stored = 0
        self.evictions = 0
        self.counts = {status: 0 for status in STATUSES}
        self._changed_jobs: dict[str, None] = {}  # written or removed since `take_changes`
        self._changed_images: dict[str, None] = {}

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def images(self) -> int:
        return len(self._images)

    # -- jobs ------------------------------------------------------------------------------

    def create(self, record: JobRecord, now: float) -> JobRecord:
        """Add a new job and return it; or, for a retry of a live job with the same idempotency
        key and request digest, return that job and add nothing."""
        self.expire(now)
        if record.idempotency_key is not None:
            existing_id = self._by_key.get(record.idempotency_key)
            if existing_id is not None:
                existing = self._entries[existing_id].record
                if existing.request_digest != record.request_digest:
                    raise IdempotencyConflict(
                        f"idempotency key {record.idempotency_key!r} was used for a different request "
                        f"(job {existing.job_id})")
                return existing
        if record.job_id in self._entries:
            raise DuplicateJobId(f"job {record.job_id!r} already exists")
        if record.terminal or record.result_bytes:
            raise ValueError(f"a new job must be queued or in progress with no result, not {record.status!r}")
        while len(self._entries) >= self.max_jobs and self._retired:
            self._evict_job(next(iter(self._retired)))
        if len(self._entries) >= self.max_jobs:
            raise JobTableFull(f"all {self.max_jobs} job slots hold queued or running jobs; retry later")
        self._order += 1
        entry = _Entry(record, order=self._order, prev=self._last)
        self._changed_jobs[record.job_id] = None
        if self._last is None:
            self._first = record.job_id
        else:
            self._entries[self._last].next = record.job_id
        self._last = record.job_id
        self._entries[record.job_id] = entry
        if record.idempotency_key is not None:
            self._by_key[record.idempotency_key] = record.job_id
        self.counts[record.status] += 1
        return record

    def get(self, job_id: str, now: float) -> JobRecord | None:
        self.expire(now)
        entry = self._entries.get(job_id)
        return None if entry is None else entry.record

    def find_by_key(self, key: str, now: float) -> JobRecord | None:
        self.expire(now)
        job_id = self._by_key.get(key)
        return None if job_id is None else self._entries[job_id].record

    def update_status(self, job_id: str, status: str, now: float, error: dict[str, str] | None = None) -> bool:
        """Move a live job to `status` ("failed"/"cancelled" retire it, setting completed_at).
        False when nothing changed: the id is unknown (or evicted) or the job already ended,
        since an ended job's outcome is final. "completed" goes through `complete`, with a result."""
        if status not in STATUSES:
            raise ValueError(f"unknown job status {status!r}; one of {STATUSES}")
        if status == "completed":
            raise ValueError("a job completes with its result: use complete()")
        if error is not None and not {"code", "message"} <= error.keys():
            raise ValueError(f"error must have 'code' and 'message', got {sorted(error)}")
        self.expire(now)
        entry = self._entries.get(job_id)
        if entry is None or entry.record.terminal:
            return False
        self._set(entry, status=status, error=error, completed_at=now if status in TERMINAL else None)
        if status in TERMINAL:
            self._retire(job_id)
        return True

    def resume_unfinished(self, max_resumes: int, error: dict[str, str],
                          now: float) -> tuple[list[tuple[JobRecord, Checkpoint | None]], list[str]]:
        """The live jobs a starting router is to take up again (an earlier router's, lost with
        its workers), queued anew with one resume more, each with its last checkpoint (None: from
        the start); and the ids of those resumed `max_resumes` times already, which fail with
        `error` instead (a job that keeps taking its router down must not do so forever)."""
        resumed, failed = [], []
        for job_id, entry in list(self._entries.items()):
            if entry.record.terminal:
                continue
            if entry.record.resumes >= max_resumes:
                self.update_status(job_id, "failed", now, error)
                failed.append(job_id)
            else:
                step = 0 if entry.checkpoint is None else entry.checkpoint.steps
                self._set(entry, status="queued", resumes=entry.record.resumes + 1, resumed_from_step=step)
                resumed.append((entry.record, entry.checkpoint))
        return resumed, failed

    def checkpoint(self, job_id: str, checkpoint: Checkpoint) -> bool:
        """Keep a running job's newer checkpoint; False (keeping nothing) for an unknown or ended
        job, or one no newer than the checkpoint it has."""
        entry = self._entries.get(job_id)
        if entry is None or entry.record.terminal:
            return False
        if entry.checkpoint is not None and entry.checkpoint.steps >= checkpoint.steps:
            return False
        entry.checkpoint = checkpoint
        self._changed_jobs[job_id] = None
        return True

    def complete(self, job_id: str, result: Any, nbytes: int, now: float, **run: Any) -> bool:
        """Store a live job's result and mark it completed. False when the id is unknown or the
        job already ended (e.g. cancelled while its result was being made). Raises
        ResultTooLarge, keeping nothing, when `nbytes` alone exceeds the byte budget."""
        self.expire(now)
        entry = self._entries.get(job_id)
        if entry is None or entry.record.terminal:
            return False
        self._check_size(nbytes, f"job {job_id}'s result")
        entry.result = result
        entry.checkpoint = None
        self._set(entry, status="completed", completed_at=now, result_bytes=nbytes, **run)
        self.bytes_stored += nbytes
        self._retire(job_id)
        self._enforce_budget()
        return True

    def result(self, job_id: str, now: float) -> Any:
        """The stored result of a completed job; None otherwise."""
        self.expire(now)
        entry = self._entries.get(job_id)
        return None if entry is None else entry.result

    def delete(self, job_id: str) -> JobRecord | None:
        """Remove a job (live or not) with its result; the removed record, or None if unknown.
        Stopping the work of a live job is the caller's business."""
        entry = self._entries.get(job_id)
        if entry is None:
            return None
        self._remove(job_id)
        return entry.record

    def page(self, after: str | None, limit: int, order: Literal["asc", "desc"], now: float,
             owner: str | None = None) -> tuple[list[JobRecord], bool]:
        """Up to `limit` jobs in creation order ("asc": oldest first), starting after the job
        `after` (OpenAI list semantics), and whether more follow; with an `owner`, that tenant's
        jobs only. An unknown cursor, e.g. one evicted since the previous page or another
        tenant's, raises ValueError."""
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        if order not in ("asc", "desc"):
            raise ValueError(f"order must be 'asc' or 'desc', got {order!r}")
        self.expire(now)
        forward = order == "asc"
        if after is None:
            job_id = self._first if forward else self._last
        elif after in self._entries and self._owned(self._entries[after].record, owner):
            cursor = self._entries[after]
            job_id = cursor.next if forward else cursor.prev
        else:
            raise ValueError(f"unknown cursor {after!r}: no such job (it may have expired)")
        records = []
        while job_id is not None and len(records) <= limit:  # one more than a page: is there more?
            entry = self._entries[job_id]
            if self._owned(entry.record, owner):
                records.append(entry.record)
            job_id = entry.next if forward else entry.prev
        return records[:limit], len(records) > limit

    @staticmethod
    def _owned(record: JobRecord, owner: str | None) -> bool:
        return owner is None or record.owner == owner

    def expire(self, now: float) -> list[str]:
        """Evict what retired `ttl_s` or more before `now`; returns the evicted job ids (images,
        keyed by idempotency key, are evicted too but not listed)."""
        evicted = []
        while self._retired:
            job_id = next(iter(self._retired))
            if self._entries[job_id].record.completed_at + self.ttl_s > now:
                break
            self._evict_job(job_id)
            evicted.append(job_id)
        while self._images:
            key, image = next(iter(self._images.items()))
            if image.stored_at + self.ttl_s > now:
                break
            self._evict_image(key)
        return evicted

    # -- idempotent image results ------------------------------------------------------------

    def remember_image(self, key: str, digest: str, body: Any, nbytes: int, now: float) -> bool:
        """Keep an image response under its idempotency key (same TTL, shared byte budget).
        False, keeping the first, if the same request was already remembered (two concurrent
        retries both finishing); IdempotencyConflict if the key holds another request's."""
        self.image_for(key, digest, now)
        if key in self._images:
            return False
        self._check_size(nbytes, f"the image response for idempotency key {key!r}")
        self._images[key] = StoredImage(key, digest, body, nbytes, now, self._next_seq())
        self._changed_images[key] = None
        self.bytes_stored += nbytes
        self._enforce_budget()
        return True

    def image_for(self, key: str, digest: str, now: float) -> Any:
        """The remembered response for this key and digest; None if none is remembered;
        IdempotencyConflict if the key was used for a different request."""
        self.expire(now)
        image = self._images.get(key)
        if image is None:
            return None
        if image.digest != digest:
            raise IdempotencyConflict(f"idempotency key {key!r} was used for a different image request")
        return image.body

    # -- durable storage ---------------------------------------------------------------------

    def take_changes(self) -> Changes:
        """What changed since the last call: each changed job or image as it is now, and the ids
        of those gone."""
        jobs, gone = [], []
        for job_id in self._changed_jobs:
            entry = self._entries.get(job_id)
            if entry is None:
                gone.append(job_id)
            else:
                jobs.append(StoredJob(entry.record, entry.result, entry.checkpoint, entry.order,
                                      self._retired.get(job_id)))
        images, gone_images = [], []
        for key in self._changed_images:
            image = self._images.get(key)
            if image is None:
                gone_images.append(key)
            else:
                images.append(image)
        self._changed_jobs.clear()
        self._changed_images.clear()
        return Changes(tuple(jobs), tuple(gone), tuple(images), tuple(gone_images))

    def restore(self, jobs: list[StoredJob], images: list[StoredImage]) -> None:
        """Build this (empty) table again from what `take_changes` gave, in any order: creation
        order, retirement order and the byte count as they were."""
        if self._entries or self._images:
            raise ValueError("restore needs an empty table")
        for job in sorted(jobs, key=lambda j: j.order):
            entry = _Entry(job.record, job.result, job.checkpoint, job.order, prev=self._last)
            if self._last is None:
                self._first = job.record.job_id
            else:
                self._entries[self._last].next = job.record.job_id
            self._last = job.record.job_id
            self._entries[job.record.job_id] = entry
            if job.record.idempotency_key is not None:
                self._by_key[job.record.idempotency_key] = job.record.job_id
            self.counts[job.record.status] += 1
            self.bytes_stored += job.record.result_bytes
            self._order = max(self._order, job.order)
        for job in sorted((j for j in jobs if j.retired is not None), key=lambda j: j.retired):
            self._retired[job.record.job_id] = job.retired
        for image in sorted(images, key=lambda i: i.seq):
            self._images[image.key] = image
            self.bytes_stored += image.nbytes
        self._seq = max([self._seq, *self._retired.values(), *(i.seq for i in images)])

    # -- internals ---------------------------------------------------------------------------

    def _set(self, entry: _Entry, **changes: Any) -> None:
        self.counts[entry.record.status] -= 1
        entry.record = dataclasses.replace(entry.record, **changes)
        self.counts[entry.record.status] += 1
        self._changed_jobs[entry.record.job_id] = None

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _retire(self, job_id: str) -> None:
        self._retired[job_id] = self._next_seq()
        self._entries[job_id].checkpoint = None  # it will not run again
        self._changed_jobs[job_id] = None

    def _check_size(self, nbytes: int, what: str) -> None:
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if nbytes > self.max_bytes:
            raise ResultTooLarge(f"{what} is {nbytes} bytes, more than the job store's whole budget of "
                                 f"{self.max_bytes} bytes")

    def _enforce_budget(self) -> None:
        while self.bytes_stored > self.max_bytes:
            job = next(iter(self._retired.items()), None)
            image = next(iter(self._images.items()), None)
            if image is None or (job is not None and job[1] < image[1].seq):
                self._evict_job(job[0])
            else:
                self._evict_image(image[0])

    def _evict_job(self, job_id: str) -> None:
        self._remove(job_id)
        self.evictions += 1

    def _evict_image(self, key: str) -> None:
        self.bytes_stored -= self._images.pop(key).nbytes
        self._changed_images[key] = None
        self.evictions += 1

    def _remove(self, job_id: str) -> None:
        entry = self._entries.pop(job_id)
        self._changed_jobs[job_id] = None
        record = entry.record
        if entry.prev is None:
            self._first = entry.next
        else:
            self._entries[entry.prev].next = entry.next
        if entry.next is None:
            self._last = entry.prev
        else:
            self._entries[entry.next].prev = entry.prev
        self._retired.pop(job_id, None)
        if record.idempotency_key is not None and self._by_key.get(record.idempotency_key) == job_id:
            del self._by_key[record.idempotency_key]
        self.bytes_stored -= record.result_bytes
        self.counts[record.status] -= 1
