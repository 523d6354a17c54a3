"""Durable storage for the job store: what each call changed in its `JobTable`, written through
before the call returns, and read back when a store starts (a restarted replica finds the jobs,
finished videos, checkpoints of running ones and remembered image responses it had).

Two backends, one interface (`write(changes)`, `load()`): a folder on local disk (one file a job
and one an image, each written whole to a temporary file, synced and renamed over the old, so a
crash leaves the old or the new, never half) and Redis (two hashes, each write one transaction),
which survives the node: what a cluster configures when the store may restart elsewhere (KubeRay's
GCS fault tolerance already runs one). Values are pickles of the table's own types: the store's
files and keys are private to the app, like Ray's own object spilling.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from stepserve.deployments.jobs import Changes, StoredImage, StoredJob

logger = logging.getLogger("stepserve.job_store")


class JobJournal(Protocol):
    def write(self, changes: Changes) -> None: ...

    def load(self) -> tuple[list[StoredJob], list[StoredImage]]: ...


@dataclass(frozen=True)
class JournalSpec:
    """`jobs.storage` as the store opens it (`JobsConfig.journal_spec`)."""

    kind: Literal["disk", "redis"]
    disk_dir: str | None = None
    redis_url: str | None = None
    redis_password_env: str | None = None  # read where the store runs
    redis_prefix: str = "stepserve"

    def open(self) -> JobJournal:
        if self.kind == "disk":
            return DiskJournal(self.disk_dir)
        password = os.environ.get(self.redis_password_env) if self.redis_password_env else None
        if self.redis_password_env and not password:
            raise ValueError(f"jobs.redis_password_env names {self.redis_password_env!r}, which is unset here")
        return RedisJournal(self.redis_url, password, self.redis_prefix)


class DiskJournal:
    """`<folder>/jobs/<hash of id>.pkl` and `<folder>/images/<hash of key>.pkl`."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        self.jobs, self.images = self.folder / "jobs", self.folder / "images"
        for path in (self.jobs, self.images):
            path.mkdir(parents=True, exist_ok=True, mode=0o700)

    def write(self, changes: Changes) -> None:
        for job in changes.jobs:
            _write_atomically(self.jobs / _name(job.record.job_id), job)
        for job_id in changes.removed_jobs:
            (self.jobs / _name(job_id)).unlink(missing_ok=True)
        for image in changes.images:
            _write_atomically(self.images / _name(image.key), image)
        for key in changes.removed_images:
            (self.images / _name(key)).unlink(missing_ok=True)

    def load(self) -> tuple[list[StoredJob], list[StoredImage]]:
        return _read_all(self.jobs, StoredJob), _read_all(self.images, StoredImage)


class RedisJournal:
    """Hashes `<prefix>:jobs` (job id -> job) and `<prefix>:images` (idempotency key -> image)."""

    def __init__(self, url: str, password: str | None, prefix: str) -> None:
        import redis  # the `redis` extra: only a store configured for Redis needs it

        self.client = redis.Redis.from_url(url, password=password)
        self.jobs_key, self.images_key = f"{prefix}:jobs", f"{prefix}:images"

    def write(self, changes: Changes) -> None:
        with self.client.pipeline(transaction=True) as pipe:
            for job in changes.jobs:
                pipe.hset(self.jobs_key, job.record.job_id, _dumps(job))
            if changes.removed_jobs:
                pipe.hdel(self.jobs_key, *changes.removed_jobs)
            for image in changes.images:
                pipe.hset(self.images_key, image.key, _dumps(image))
            if changes.removed_images:
                pipe.hdel(self.images_key, *changes.removed_images)
            pipe.execute()

    def load(self) -> tuple[list[StoredJob], list[StoredImage]]:
        return ([_loads(v, StoredJob) for v in self.client.hgetall(self.jobs_key).values()],
                [_loads(v, StoredImage) for v in self.client.hgetall(self.images_key).values()])


def _name(key: str) -> str:
    """A file name for any id or key (they are the client's strings)."""
    return hashlib.sha256(key.encode()).hexdigest() + ".pkl"


def _dumps(value: Any) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def _loads(data: bytes, kind: type) -> Any:
    value = pickle.loads(data)
    if not isinstance(value, kind):
        raise ValueError(f"expected a {kind.__name__}, found a {type(value).__name__}")
    return value


def _write_atomically(path: Path, value: Any) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_dumps(value))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read_all(folder: Path, kind: type) -> list[Any]:
    out = []
    for path in folder.glob("*.pkl"):
        try:
            out.append(_loads(path.read_bytes(), kind))
        except Exception:  # a file from another version, or damaged on disk: skip it, say so
            logger.exception("job store: cannot read %s; skipping it", path)
    for stale in folder.glob(".tmp-*"):  # a write that a crash cut short
        stale.unlink(missing_ok=True)
    return out
