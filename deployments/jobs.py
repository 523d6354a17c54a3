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
    resumes: int = 0  # times a starting router took it up again from the start (a router restart)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"unknown job status {self.status!r}; one of {STATUSES}")

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL


@dataclass(slots=True)
class _Entry:
    record: JobRecord
    result: Any = None
    # Neighbours in creation order: a linked list makes `page` O(limit) from any cursor.
    prev: str | None = None
    next: str | None = None


@dataclass(frozen=True, slots=True)
class _Image:
    digest: str
    body: Any
    nbytes: int
    stored_at: float
    seq: int


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
        self._images: OrderedDict[str, _Image] = OrderedDict()
        self._seq = 0
        self.bytes_stored = 0
        self.evictions = 0
        self.counts = {status: 0 for status in STATUSES}

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
        entry = _Entry(record, prev=self._last)
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
                          now: float) -> tuple[list[JobRecord], list[str]]:
        """The live jobs a starting router is to take up again (an earlier router's, lost with
        its workers), queued anew with one resume more; and the ids of those resumed
        `max_resumes` times already, which fail with `error` instead (a job that keeps taking
        its router down must not do so forever)."""
        resumed, failed = [], []
        for job_id, entry in list(self._entries.items()):
            if entry.record.terminal:
                continue
            if entry.record.resumes >= max_resumes:
                self.update_status(job_id, "failed", now, error)
                failed.append(job_id)
            else:
                self._set(entry, status="queued", resumes=entry.record.resumes + 1)
                resumed.append(entry.record)
        return resumed, failed

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
        self._images[key] = _Image(digest, body, nbytes, now, self._next_seq())
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

    # -- internals ---------------------------------------------------------------------------

    def _set(self, entry: _Entry, **changes: Any) -> None:
        self.counts[entry.record.status] -= 1
        entry.record = dataclasses.replace(entry.record, **changes)
        self.counts[entry.record.status] += 1

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _retire(self, job_id: str) -> None:
        self._retired[job_id] = self._next_seq()

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
        self.evictions += 1

    def _remove(self, job_id: str) -> None:
        entry = self._entries.pop(job_id)
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
